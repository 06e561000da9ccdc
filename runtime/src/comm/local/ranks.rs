//! [`run_ranks`]: one thread per rank, results in rank order, the root cause of a failure
//! surfaced rather than its echoes on the other ranks.

use std::any::Any;
use std::time::Duration;

use ferrozero_config::resolved::CommsConfig;

use super::LocalComm;
use crate::comm::open::Opened;
use crate::comm::Communicator;
use crate::{Error, Result};

/// The `local` row of [`crate::comm::open::COMMUNICATORS`]: `ranks` (default 1) ranks of a
/// fresh group, to run as threads; refused in a process that is one of several launched
/// ranks, where each process would train alone and write the same outputs.
pub(crate) fn open(ranks: Option<usize>, cfg: &CommsConfig) -> Result<Opened> {
    check_not_launched(std::env::var("WORLD_SIZE").ok().as_deref())?;
    let n = ranks.unwrap_or(1);
    if n == 0 {
        return Err(Error::Invalid("--ranks must be at least 1".into()));
    }
    let comms = LocalComm::group(n, cfg.timeout).into_iter();
    Ok(Opened::Threads(
        comms
            .map(|c| Box::new(c) as Box<dyn Communicator>)
            .collect(),
    ))
}

/// Refuses local ranks when `WORLD_SIZE` (as `ferrozero launch` sets it) says this process is
/// one of several, naming what would work.
fn check_not_launched(world_size: Option<&str>) -> Result<()> {
    match world_size.and_then(|w| w.parse::<usize>().ok()) {
        Some(w) if w > 1 => Err(Error::Config(format!(
            "this process is one of {w} ranks (WORLD_SIZE={w}, as `ferrozero launch` sets it) \
             but comms.backend is \"local\" (ranks as threads): set comms.backend = \"nccl\" \
             for one rank per process, or run without the launcher and use --ranks"
        ))),
        _ => Ok(()),
    }
}

/// Runs `f` on `world_size` threads, each with its own rank of a fresh [`LocalComm`] group,
/// and returns the results in rank order.
///
/// A rank that panics leaves the group (its communicator is dropped while unwinding), so its
/// peers' collectives fail instead of hanging. When ranks fail, the error returned is the
/// root cause: a panic first, then an error that is not a collective failure (the others'
/// collective errors are echoes of it), then the lowest rank's collective error (which names
/// the peer at fault). With more than one rank, a panic or a rank's own error comes back as
/// [`Error::RankFailed`] naming the rank and carrying its text, since the text alone (a file
/// that cannot be read) does not say which rank met it; an error that already names its rank
/// (`RankFailed`, a collective's) comes back as it is.
pub fn run_ranks<T, F>(world_size: usize, timeout: Duration, f: F) -> Result<Vec<T>>
where
    T: Send,
    F: Fn(Box<dyn Communicator>) -> Result<T> + Sync,
{
    if world_size == 0 {
        return Err(Error::Invalid("run_ranks needs at least one rank".into()));
    }
    let comms = LocalComm::group(world_size, timeout)
        .into_iter()
        .map(|c| Box::new(c) as Box<dyn Communicator>)
        .collect();
    run_each(comms, f)
}

/// Runs `f` once per communicator, each on its own thread named after its position, and
/// returns the results in that order (the root cause of a failure first, as [`run_ranks`]).
pub(crate) fn run_each<T, F>(comms: Vec<Box<dyn Communicator>>, f: F) -> Result<Vec<T>>
where
    T: Send,
    F: Fn(Box<dyn Communicator>) -> Result<T> + Sync,
{
    let several = comms.len() > 1;
    let outcomes: Vec<std::thread::Result<Result<T>>> = std::thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| {
                std::thread::Builder::new()
                    .name(format!("fz-rank-{rank}"))
                    .spawn_scoped(s, move || f(comm))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| match h {
                Ok(h) => h.join(),
                Err(e) => Ok(Err(Error::Io {
                    context: "spawning a rank thread".into(),
                    source: e,
                })),
            })
            .collect()
    });
    collect(outcomes, several)
}

/// Results in rank order, or the most telling failure; `name_rank` wraps a failure that does
/// not say its rank in [`Error::RankFailed`].
fn collect<T>(outcomes: Vec<std::thread::Result<Result<T>>>, name_rank: bool) -> Result<Vec<T>> {
    let mut panic = None;
    let mut own = None;
    let mut echo = None;
    let mut ok = Vec::with_capacity(outcomes.len());
    for (rank, o) in outcomes.into_iter().enumerate() {
        match o {
            Err(p) => {
                let msg = panic_message(p.as_ref());
                panic.get_or_insert(Error::RankFailed {
                    op: "job",
                    rank,
                    cause: format!("panicked: {msg}"),
                });
            }
            Ok(Err(e @ Error::Comm { .. })) => {
                echo.get_or_insert(e);
            }
            Ok(Err(e @ Error::RankFailed { .. })) => {
                own.get_or_insert(e);
            }
            Ok(Err(e)) if name_rank => {
                own.get_or_insert(Error::RankFailed {
                    op: "job",
                    rank,
                    cause: e.to_string(),
                });
            }
            Ok(Err(e)) => {
                own.get_or_insert(e);
            }
            Ok(Ok(v)) => ok.push(v),
        }
    }
    match panic.or(own).or(echo) {
        Some(e) => Err(e),
        None => Ok(ok),
    }
}

/// The message of a panic payload (`&str` or `String`), or a placeholder.
fn panic_message(p: &(dyn Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| (*s).to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-string panic payload".into())
}

#[cfg(test)]
mod tests {
    use super::check_not_launched;

    #[test]
    fn local_ranks_under_a_launched_world_are_refused() {
        assert!(check_not_launched(None).is_ok());
        assert!(check_not_launched(Some("1")).is_ok());
        let e = check_not_launched(Some("4")).unwrap_err().to_string();
        assert!(e.contains("one of 4 ranks (WORLD_SIZE=4"), "{e}");
        assert!(e.contains("comms.backend = \"nccl\""), "{e}");
    }
}
