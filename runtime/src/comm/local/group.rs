//! The shared state of a group of in-process ranks and its two barriers.
//!
//! An *entry* barrier starts every collective: each rank announces what it called, and the
//! last to arrive checks the announcements. It honours the deadline, and whether it
//! completed or was aborted is decided under one lock, so no rank can start touching the
//! buffers of a peer that has given up. A *release* barrier ends every collective that
//! shares buffers: nobody returns (and frees its buffer) while a peer may still read or
//! write it. It has no deadline because peers past the entry barrier only run bounded
//! copy loops; it still ends when a peer disappears.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use super::desc::{verify, Desc, Mismatch, OpKind};

/// How a rank left the group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Departure {
    /// Its communicator was dropped during normal execution.
    Dropped,
    /// Its thread panicked (the communicator was dropped while unwinding).
    Panicked,
}

/// Why the group stopped working; kept so that later calls on any rank fail fast with the
/// original cause.
#[derive(Debug, Clone)]
pub(crate) struct Abort {
    /// The collective during which the failure was detected.
    pub op: &'static str,
    /// The rank at fault, when known.
    pub culprit: Option<usize>,
    /// The rank that detected it.
    pub detector: usize,
    /// What happened.
    pub reason: String,
}

/// Barrier flavour.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Start of a collective: announces a descriptor, honours the deadline.
    Entry,
    /// End of a collective: waits until no peer touches this rank's buffers.
    Release,
}

/// A sub-group created by `split`/`duplicate`, handed to one rank.
pub(crate) type Child = (Arc<Group>, usize);

/// State behind the group's lock.
pub(crate) struct State {
    /// Completed barriers.
    pub gen: u64,
    /// Ranks that arrived at the current barrier.
    pub arrived: Vec<bool>,
    /// Number of `true` entries in `arrived`.
    pub count: usize,
    /// Ranks that left the group, and how.
    pub departed: Vec<Option<Departure>>,
    /// Set once the group is broken.
    pub abort: Option<Abort>,
    /// Announcements of the current (or just completed) entry barrier.
    pub descs: Vec<Desc>,
    /// Check result of the last completed entry barrier.
    pub verdict: Result<(), Mismatch>,
    /// Sub-groups created by the last completed split, per rank.
    pub children: Vec<Option<Child>>,
}

/// A group of in-process ranks.
pub(crate) struct Group {
    /// Number of ranks.
    pub n: usize,
    /// Per-collective timeout.
    pub timeout: Duration,
    state: Mutex<State>,
    cv: Condvar,
    /// Mirror of `State::gen` so that waiters can spin without the lock.
    gen_seen: AtomicU64,
}

/// Spin iterations before yielding, and yields before sleeping: short, because with more
/// ranks than cores a spinning waiter steals the time its peers need.
const SPINS: u32 = 2000;
const YIELDS: u32 = 20;

impl Group {
    /// A fresh group of `n` ranks.
    pub(crate) fn new(n: usize, timeout: Duration) -> Arc<Self> {
        Arc::new(Self {
            n,
            timeout,
            state: Mutex::new(State {
                gen: 0,
                arrived: vec![false; n],
                count: 0,
                departed: vec![None; n],
                abort: None,
                descs: vec![Desc::bare(0, OpKind::Barrier); n],
                verdict: Ok(()),
                children: vec![None; n],
            }),
            cv: Condvar::new(),
            gen_seen: AtomicU64::new(0),
        })
    }

    /// Locks the state; a poisoned lock is still consistent because no code panics while
    /// holding it.
    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Marks `rank` as gone and wakes every waiter so that it can notice.
    pub(crate) fn depart(&self, rank: usize, how: Departure) {
        let mut st = self.lock();
        st.departed[rank] = Some(how);
        drop(st);
        self.cv.notify_all();
    }

    /// Records the first failure of the group and wakes every waiter.
    pub(crate) fn abort(&self, st: &mut State, abort: Abort) {
        if st.abort.is_none() {
            st.abort = Some(abort);
        }
        self.cv.notify_all();
    }

    /// Arrives at the next barrier. Returns the locked state once the barrier completed, or
    /// the reason it cannot complete.
    pub(crate) fn arrive(
        &self,
        rank: usize,
        phase: Phase,
        desc: Desc,
        deadline: Option<Instant>,
    ) -> Result<MutexGuard<'_, State>, Abort> {
        let mut st = self.lock();
        if phase == Phase::Entry {
            if let Some(a) = &st.abort {
                return Err(a.clone());
            }
            st.descs[rank] = desc;
        }
        let my_gen = st.gen;
        st.arrived[rank] = true;
        st.count += 1;
        if st.count == self.n {
            self.complete(&mut st, phase);
            return Ok(st);
        }
        drop(st);
        self.spin_until_past(my_gen);
        let mut st = self.lock();
        loop {
            if st.gen > my_gen {
                return Ok(st);
            }
            let outcome = match phase {
                Phase::Entry => self.entry_blocker(&st, rank, desc.op, deadline),
                Phase::Release => self.release_blocker(&st, rank, desc.op),
            };
            if let Some(abort) = outcome {
                self.abort(&mut st, abort.clone());
                return Err(st.abort.clone().unwrap_or(abort));
            }
            st = match deadline.filter(|_| phase == Phase::Entry) {
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    self.cv
                        .wait_timeout(st, left)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0
                }
                None => self.cv.wait(st).unwrap_or_else(PoisonError::into_inner),
            };
        }
    }

    /// Busy-waits briefly for barrier `my_gen` to complete: cheap for small collectives
    /// whose peers arrive within microseconds.
    fn spin_until_past(&self, my_gen: u64) {
        for i in 0..SPINS + YIELDS {
            if self.gen_seen.load(Ordering::Acquire) > my_gen {
                return;
            }
            if i < SPINS {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }

    /// Completes the current barrier (called by the last rank to arrive, under the lock).
    fn complete(&self, st: &mut State, phase: Phase) {
        if phase == Phase::Entry {
            st.verdict = verify(&st.descs);
            if st.verdict.is_ok() && matches!(st.descs[0].op, OpKind::Split | OpKind::Duplicate) {
                st.children = make_children(&st.descs, self.timeout);
            }
        }
        st.arrived.fill(false);
        st.count = 0;
        st.gen += 1;
        self.gen_seen.store(st.gen, Ordering::Release);
        self.cv.notify_all();
    }

    /// Why an entry barrier cannot complete, if it cannot: the group broke, a peer that has
    /// not arrived is gone, or the deadline passed.
    fn entry_blocker(
        &self,
        st: &State,
        rank: usize,
        op: OpKind,
        deadline: Option<Instant>,
    ) -> Option<Abort> {
        if let Some(a) = &st.abort {
            return Some(a.clone());
        }
        let missing = |k: &usize| !st.arrived[*k];
        if let Some(k) = (0..self.n)
            .filter(missing)
            .find(|k| st.departed[*k].is_some())
        {
            return Some(departed_abort(op, rank, k, st.departed[k]));
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            let absent: Vec<usize> = (0..self.n).filter(missing).collect();
            return Some(Abort {
                op: op.name(),
                culprit: absent.first().copied(),
                detector: rank,
                reason: format!(
                    "rank {} stopped answering: rank {rank} waited {:?} for it to enter {} \
                     (ranks not arrived: {absent:?})",
                    absent[0],
                    self.timeout,
                    op.name()
                ),
            });
        }
        None
    }

    /// Why a release barrier cannot complete: every peer still missing is gone.
    fn release_blocker(&self, st: &State, rank: usize, op: OpKind) -> Option<Abort> {
        let missing: Vec<usize> = (0..self.n).filter(|k| !st.arrived[*k]).collect();
        let all_gone = missing.iter().all(|k| st.departed[*k].is_some());
        if all_gone {
            let k = missing[0];
            return Some(departed_abort(op, rank, k, st.departed[k]));
        }
        None
    }
}

/// The abort record for a peer that left while others waited for it.
fn departed_abort(op: OpKind, detector: usize, k: usize, how: Option<Departure>) -> Abort {
    let how = match how {
        Some(Departure::Panicked) => "its thread panicked",
        _ => "its communicator was dropped",
    };
    Abort {
        op: op.name(),
        culprit: Some(k),
        detector,
        reason: format!(
            "rank {k} is dead ({how}) while rank {detector} waited in {}",
            op.name()
        ),
    }
}

/// Sub-groups for a split: ranks with equal color, ordered by (key, rank).
fn make_children(descs: &[Desc], timeout: Duration) -> Vec<Option<Child>> {
    let mut out: Vec<Option<Child>> = vec![None; descs.len()];
    let mut colors: Vec<usize> = descs.iter().map(|d| d.root).collect();
    colors.sort_unstable();
    colors.dedup();
    for color in colors {
        let mut members: Vec<usize> = (0..descs.len())
            .filter(|r| descs[*r].root == color)
            .collect();
        members.sort_by_key(|r| (descs[*r].key, *r));
        let group = Group::new(members.len(), timeout);
        for (new_rank, r) in members.into_iter().enumerate() {
            out[r] = Some((Arc::clone(&group), new_rank));
        }
    }
    out
}
