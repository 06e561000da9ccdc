//! The failure board: keys in the rendezvous store where ranks of one NCCL communicator say
//! what went wrong, so that an error can name the rank at fault (NCCL itself only says that
//! *a* peer is gone), and where `split` learns the new groups' membership.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::comm::store::TcpStore;
use crate::Result;

/// What a rank writes when a collective is stuck but NCCL reported nothing.
const WAITING: &str = "waiting";

/// One communicator's keys in the store.
pub(super) struct Board {
    store: Arc<TcpStore>,
    tag: String,
    rank: usize,
    world: usize,
}

/// The board's reading of a failure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Verdict {
    /// The rank at fault, when the board shows one.
    pub culprit: Option<usize>,
    /// What the board shows, in one sentence.
    pub text: String,
}

impl Board {
    pub(super) fn new(store: Arc<TcpStore>, tag: &str, rank: usize, world: usize) -> Self {
        Self {
            store,
            tag: tag.to_string(),
            rank,
            world,
        }
    }

    /// The board of a communicator split from this one.
    pub(super) fn child(&self, n: u64, color: usize, rank: usize, world: usize) -> Self {
        Self::new(
            Arc::clone(&self.store),
            &format!("{}/split{n}/c{color}", self.tag),
            rank,
            world,
        )
    }

    fn key(&self, seq: u64, rank: usize) -> String {
        format!("{}/fail/{seq}/{rank}", self.tag)
    }

    /// Records this rank's failure of collective `seq` (`reason` from NCCL, or none when it
    /// only timed out), waits a little for the peers' entries and names the rank at fault:
    /// the first that reported an NCCL error, else the first that never reported (dead, or
    /// stuck before this collective).
    pub(super) fn report(&self, seq: u64, reason: Option<&str>, timeout: Duration) -> Verdict {
        let mine = reason.unwrap_or(WAITING);
        if let Err(e) = self.store.set(&self.key(seq, self.rank), mine.as_bytes()) {
            return unreachable_store(e);
        }
        let grace = (timeout / 4).min(Duration::from_secs(2));
        let entries = match self.collect(seq, grace) {
            Ok(e) => e,
            Err(e) => return unreachable_store(e),
        };
        judge(self.rank, seq, &entries)
    }

    /// Every peer's entry for `seq` (`None` for a peer that wrote none within `grace`).
    fn collect(&self, seq: u64, grace: Duration) -> Result<Vec<Option<String>>> {
        let start = Instant::now();
        let mut out = vec![None; self.world];
        loop {
            for (r, slot) in out.iter_mut().enumerate().filter(|(_, s)| s.is_none()) {
                *slot = self
                    .store
                    .get(&self.key(seq, r))?
                    .map(|v| String::from_utf8_lossy(&v).into_owned());
            }
            if out.iter().all(Option::is_some) || start.elapsed() >= grace {
                return Ok(out);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// This rank's place in the communicator `split(color, key)` makes (the `n`-th split):
    /// every rank posts its color and key, then reads everyone's.
    pub(super) fn split_membership(
        &self,
        n: u64,
        color: usize,
        key: usize,
    ) -> Result<(usize, usize)> {
        let k = |r: usize| format!("{}/split{n}/member/{r}", self.tag);
        self.store
            .set(&k(self.rank), format!("{color} {key}").as_bytes())?;
        let mut members = Vec::new();
        for r in 0..self.world {
            let v = String::from_utf8_lossy(&self.store.wait(&k(r))?).into_owned();
            let mut it = v
                .split(' ')
                .map(|x| x.parse::<usize>().unwrap_or(usize::MAX));
            let (c, kk) = (
                it.next().unwrap_or(usize::MAX),
                it.next().unwrap_or(usize::MAX),
            );
            if c == color {
                members.push((kk, r));
            }
        }
        members.sort_unstable();
        let rank = members
            .iter()
            .position(|&(_, r)| r == self.rank)
            .unwrap_or(0);
        Ok((rank, members.len()))
    }
}

/// The culprit among the board's entries; see [`Board::report`].
pub(super) fn judge(me: usize, seq: u64, entries: &[Option<String>]) -> Verdict {
    let failed = entries
        .iter()
        .enumerate()
        .find(|(r, e)| *r != me && e.as_deref().is_some_and(|e| e != WAITING));
    if let Some((r, e)) = failed {
        return Verdict {
            culprit: Some(r),
            text: format!(
                "rank {r} reported an NCCL error in collective #{seq}: {}",
                e.as_deref().unwrap_or_default()
            ),
        };
    }
    let missing: Vec<usize> = (0..entries.len())
        .filter(|&r| entries[r].is_none())
        .collect();
    match missing.first() {
        Some(&r) => Verdict {
            culprit: Some(r),
            text: format!(
                "rank {r} never reached collective #{seq} (dead, or stuck before it); ranks \
                 not reporting: {missing:?}"
            ),
        },
        None => Verdict {
            culprit: None,
            text: format!("every rank reached collective #{seq} and is waiting inside NCCL"),
        },
    }
}

fn unreachable_store(e: crate::Error) -> Verdict {
    Verdict {
        culprit: None,
        text: format!(
            "the rendezvous store could not be asked which rank failed ({e}); rank 0 serves \
             it, so rank 0 may be the one that died"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(s: &str) -> Option<String> {
        Some(s.to_string())
    }

    #[test]
    fn an_nccl_error_on_a_peer_beats_a_silent_one() {
        let v = judge(0, 7, &[e(WAITING), None, e("unhandled cuda error")]);
        assert_eq!(v.culprit, Some(2));
        assert!(
            v.text.contains("#7") && v.text.contains("unhandled cuda error"),
            "{}",
            v.text
        );
    }

    #[test]
    fn a_peer_that_never_reported_is_named() {
        let v = judge(1, 3, &[e(WAITING), e(WAITING), None, None]);
        assert_eq!(v.culprit, Some(2));
        assert!(v.text.contains("[2, 3]"), "{}", v.text);
    }

    #[test]
    fn everyone_waiting_names_nobody() {
        let v = judge(0, 1, &[e("my own error"), e(WAITING)]);
        assert_eq!(v.culprit, None);
    }
}
