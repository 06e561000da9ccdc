//! [`open`]: the communicator `comms.backend` names, from a table with one entry per
//! communicator, as [`crate::backend::open`] is for devices. A binary hands its rank body to
//! [`open`] and never names a transport; a new communicator is a folder under `comm/` with an
//! opener of the [`Opener`] shape and one row in [`COMMUNICATORS`].

use ferrozero_config::resolved::{CommBackend, CommsConfig};

use super::local::run_each;
use super::Communicator;
use crate::{Error, Result};

/// What an opener gives: the ranks this process runs.
pub enum Opened {
    /// Every rank of the group, each to run on its own thread of this process (`local`).
    Threads(Vec<Box<dyn Communicator>>),
    /// This process's one rank of a job started outside it (`ferrozero launch`, `mpirun`),
    /// run on the calling thread (MPI and NCCL keep per-thread state).
    Process(Box<dyn Communicator>),
}

/// Opens a communicator: `ranks` is how many ranks this process was asked to run (`None`:
/// not asked, the communicator's own default), the section gives timeout and reduction.
pub type Opener = fn(Option<usize>, &CommsConfig) -> Result<Opened>;

/// Every communicator this build knows, by the `comms.backend` that names it.
pub const COMMUNICATORS: &[(CommBackend, Opener)] = &[
    (CommBackend::Local, super::local::open),
    (CommBackend::Mpi, mpi),
    (CommBackend::Nccl, super::nccl::open),
];

/// Runs `body` once per rank of this process on the communicator `cfg.backend` names, and
/// returns the results in rank order: `ranks` threads for `local`, else once on the calling
/// thread as the rank the launcher gave this process. A communicator this build or machine
/// cannot open is an error that says why ([`Error::Unavailable`]), never a silent fallback.
pub fn open<T, F>(cfg: &CommsConfig, ranks: Option<usize>, body: F) -> Result<Vec<T>>
where
    T: Send,
    F: Fn(Box<dyn Communicator>) -> Result<T> + Sync,
{
    match opener(cfg.backend)?(ranks, cfg)? {
        Opened::Threads(comms) => run_each(comms, body),
        Opened::Process(comm) => Ok(vec![body(comm)?]),
    }
}

/// This process's one rank of a launched job, for callers that hold it themselves (the
/// engine's `initialize`); `local`, which makes all its ranks at once, is refused.
pub fn open_rank(cfg: &CommsConfig) -> Result<Box<dyn Communicator>> {
    match opener(cfg.backend)?(Some(1), cfg)? {
        Opened::Process(comm) => Ok(comm),
        Opened::Threads(_) => Err(Error::Invalid(format!(
            "comms.backend {:?} runs its ranks as threads: use comm::open",
            cfg.backend
        ))),
    }
}

fn opener(backend: CommBackend) -> Result<Opener> {
    COMMUNICATORS
        .iter()
        .find(|(b, _)| *b == backend)
        .map(|(_, o)| *o)
        .ok_or_else(|| Error::Config(format!("no communicator for comms.backend {backend:?}")))
}

/// Refuses `--ranks N > 1` for a communicator that runs one rank per process, naming what
/// starts `N` processes instead.
// Only the process-per-rank openers call it, and a build without `cuda` or `mpi` has none.
#[cfg_attr(not(any(feature = "cuda", feature = "mpi")), allow(dead_code))]
pub(crate) fn one_per_process(name: &str, ranks: Option<usize>) -> Result<()> {
    match ranks {
        Some(n) if n != 1 => Err(Error::Invalid(format!(
            "--ranks {n} with comms.backend = \"{name}\": each process is one rank; start \
             {n} processes with `ferrozero launch --nproc-per-node {n}`"
        ))),
        _ => Ok(()),
    }
}

#[cfg(feature = "mpi")]
fn mpi(ranks: Option<usize>, cfg: &CommsConfig) -> Result<Opened> {
    one_per_process("mpi", ranks)?;
    super::mpi::open(cfg).map(Opened::Process)
}

#[cfg(not(feature = "mpi"))]
fn mpi(_ranks: Option<usize>, cfg: &CommsConfig) -> Result<Opened> {
    Err(Error::Unavailable {
        what: "the MPI backend",
        why: format!(
            "comms.backend = \"mpi\" (reduction {:?}, timeout {:?}) but this build has no MPI: \
             build with --features mpi",
            cfg.reduction, cfg.timeout
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_backend_has_one_row() {
        for b in [CommBackend::Local, CommBackend::Mpi, CommBackend::Nccl] {
            let rows = COMMUNICATORS.iter().filter(|(x, _)| *x == b).count();
            assert_eq!(rows, 1, "{b:?}");
        }
    }

    fn comms(backend: CommBackend) -> CommsConfig {
        CommsConfig {
            backend,
            timeout: std::time::Duration::from_secs(30),
            reduction: ferrozero_config::resolved::CommReduction::Native,
            data_type: None,
        }
    }

    #[test]
    fn local_runs_its_ranks_as_one_group_in_rank_order() {
        let sums = open(&comms(CommBackend::Local), Some(3), |c| {
            let mut v = [c.rank() as f32 + 1.0];
            c.all_reduce(crate::comm::BufMut::F32(&mut v), crate::comm::ReduceOp::Sum)?;
            Ok((c.rank(), v[0]))
        })
        .unwrap();
        assert_eq!(sums, vec![(0, 6.0), (1, 6.0), (2, 6.0)]);
        let e = open_rank(&comms(CommBackend::Local))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("use comm::open"), "{e}");
    }

    #[cfg(not(feature = "mpi"))]
    #[test]
    fn a_communicator_this_build_lacks_says_how_to_get_it() {
        let e = open(&comms(CommBackend::Mpi), None, |_| Ok(())).unwrap_err();
        assert!(e.to_string().contains("--features mpi"), "{e}");
    }

    #[test]
    fn a_process_per_rank_refuses_several_ranks() {
        assert!(one_per_process("nccl", None).is_ok());
        assert!(one_per_process("nccl", Some(1)).is_ok());
        let e = one_per_process("nccl", Some(3)).unwrap_err().to_string();
        assert!(e.contains("--ranks 3 with comms.backend = \"nccl\""), "{e}");
        assert!(e.contains("--nproc-per-node 3"), "{e}");
    }
}
