//! `mpi`: the [`Communicator`] contract over MPI (rsmpi with Open MPI), one rank per process,
//! started by `mpirun`/`srun` (or `ferrozero launch`).
//!
//! Every collective has two phases:
//! - **check-in**: the ranks' descriptors are all-gathered by a nonblocking call polled
//!   against the timeout, which detects mismatched calls (an error on every rank) and a rank
//!   that never comes (a timeout error on the others), before any buffer is touched;
//! - **data**: blocking MPI calls on the caller's buffers, as a program calling MPI directly
//!   would make them (`data.rs`), so the bandwidth is Open MPI's own.
//!
//! Sums are [`Reduction::Native`] by default (f32 all-reduces through `MPI_Allreduce`:
//! deterministic for a world size and length, and bitwise equal to `local` at two ranks, but
//! associated as MPI chooses beyond; reduce-scatters are rank-ordered in both modes, an
//! all-to-all and a fold, which measured faster than `MPI_Reduce_scatter_block`);
//! [`Reduction::RankOrdered`] gives `local`'s rank-ordered sums at any world size (see
//! `data.rs` for what it costs).
//!
//! Timeouts: the check-in times out cleanly (the communicator is then marked broken and its
//! leased descriptor buffers are leaked, never freed while MPI may write them). Once every
//! rank has checked in, a data phase that still outlives the timeout means a peer stopped
//! inside MPI; MPI cannot cancel a collective that holds the caller's buffers, so the
//! watchdog reports it and aborts the job (`MPI_Abort`) instead of letting it hang.
//!
//! Waiting never busy-polls for long: the check-in's polling backs off to sleeps (and skips
//! spinning when the node runs more ranks than cores), and on such an oversubscribed node
//! Open MPI is told to yield in its own blocking waits (`mpi_yield_when_idle`).

mod data;
mod exchange;
mod watchdog;

use std::cell::{Cell, OnceCell, RefCell};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use mpi::environment::Universe;
use mpi::topology::{Color, SimpleCommunicator};
use mpi::traits::Communicator as _;
use mpi::Threading;

use crate::comm::Reduction;
use crate::{Error, Result};

pub use watchdog::{Expired, Watchdog};

/// MPI stays initialized while any communicator lives; finalized after the last one drops
/// (mpirun reports processes that exit without finalizing as failed).
struct Env {
    universe: Universe,
    threading: Threading,
    /// This library's `MPI_IN_PLACE` sentinel, where it is known (rsmpi does not export it).
    in_place: Option<usize>,
    /// More ranks on this node than cores: waits must give their core away.
    oversubscribed: bool,
}

// SAFETY: MPI was initialized with MPI_THREAD_MULTIPLE (checked in `MpiComm::world`), so its
// handles may be used from any thread; `Universe` is only dropped once (finalize).
unsafe impl Send for Env {}
// SAFETY: as above.
unsafe impl Sync for Env {}

static ENV: Mutex<Option<Weak<Env>>> = Mutex::new(None);

/// One rank of an MPI communicator.
pub struct MpiComm {
    comm: SimpleCommunicator,
    env: Arc<Env>,
    timeout: Duration,
    rank: usize,
    size: usize,
    seq: Cell<u64>,
    /// Set once a collective timed out or mismatched: the ranks are out of step for good.
    broken: RefCell<Option<String>>,
    /// How sums are formed.
    reduction: Reduction,
    /// Rank-ordered reductions' receive area, kept for the next call.
    scratch: RefCell<Vec<u64>>,
    /// The data phase's deadline, started on first use.
    watch: OnceCell<Watchdog>,
}

// SAFETY: see `Env`: with MPI_THREAD_MULTIPLE a communicator handle may move between threads.
// `MpiComm` is not `Sync`, so one communicator is never used by two threads at once.
unsafe impl Send for MpiComm {}

impl std::fmt::Debug for MpiComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiComm")
            .field("rank", &self.rank)
            .field("world_size", &self.size)
            .field("timeout", &self.timeout)
            .field("threading", &self.env.threading)
            .field("reduction", &self.reduction)
            .finish()
    }
}

/// The `mpi` row of [`crate::comm::open::COMMUNICATORS`]: the world communicator with the
/// section's timeout and reduction.
pub(crate) fn open(
    cfg: &ferrozero_config::resolved::CommsConfig,
) -> Result<Box<dyn crate::comm::Communicator>> {
    use ferrozero_config::resolved::CommReduction;
    let reduction = match cfg.reduction {
        CommReduction::Native => Reduction::Native,
        CommReduction::RankOrdered => Reduction::RankOrdered,
    };
    Ok(Box::new(
        MpiComm::world(cfg.timeout)?.with_reduction(reduction),
    ))
}

impl MpiComm {
    /// The world communicator of this process (initializes MPI on first use).
    pub fn world(timeout: Duration) -> Result<MpiComm> {
        let mut slot = ENV
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let env = match slot.as_ref().and_then(Weak::upgrade) {
            Some(env) => env,
            None => {
                let unavailable = |why: String| Error::Unavailable { what: "MPI", why };
                if slot.is_some() {
                    return Err(unavailable(
                        "MPI was finalized when its last communicator was dropped and cannot \
                         be initialized twice in one process"
                            .into(),
                    ));
                }
                let oversubscribed = node_is_oversubscribed();
                if oversubscribed && std::env::var_os("OMPI_MCA_mpi_yield_when_idle").is_none() {
                    // Read by Open MPI at initialization: its blocking waits then yield the
                    // core instead of spinning on it.
                    std::env::set_var("OMPI_MCA_mpi_yield_when_idle", "1");
                }
                let (universe, threading) = mpi::initialize_with_threading(Threading::Multiple)
                    .ok_or_else(|| {
                        unavailable("MPI_Init_thread failed or MPI is already initialized".into())
                    })?;
                if threading != Threading::Multiple {
                    return Err(unavailable(format!(
                        "this MPI library provides {threading:?} threading, MPI_THREAD_MULTIPLE is needed"
                    )));
                }
                let env = Arc::new(Env {
                    universe,
                    threading,
                    in_place: in_place_sentinel(),
                    oversubscribed,
                });
                *slot = Some(Arc::downgrade(&env));
                env
            }
        };
        let comm = env.universe.world();
        Ok(MpiComm::wrap(comm, env, timeout, Reduction::default()))
    }

    fn wrap(
        comm: SimpleCommunicator,
        env: Arc<Env>,
        timeout: Duration,
        reduction: Reduction,
    ) -> MpiComm {
        let (rank, size) = (comm.rank() as usize, comm.size() as usize);
        MpiComm {
            comm,
            env,
            timeout,
            rank,
            size,
            seq: Cell::new(0),
            broken: RefCell::new(None),
            reduction,
            scratch: RefCell::new(Vec::new()),
            watch: OnceCell::new(),
        }
    }

    /// This communicator with sums formed as `reduction` says (duplicates and splits
    /// inherit it).
    pub fn with_reduction(mut self, reduction: Reduction) -> MpiComm {
        self.reduction = reduction;
        self
    }

    /// How this communicator forms sums.
    pub fn reduction(&self) -> Reduction {
        self.reduction
    }

    /// The data phase's watchdog: on expiry it reports the stuck collective and aborts the
    /// job, since MPI cannot cancel a collective that holds the caller's buffers.
    fn watchdog(&self) -> &Watchdog {
        self.watch.get_or_init(|| {
            let (rank, timeout) = (self.rank, self.timeout);
            let started = Watchdog::start(timeout, move |e: Expired| {
                eprintln!(
                    "ferrozero: collective {} on MPI rank {rank} made no progress for {:?} \
                     (timeout {timeout:?}) after every rank had entered it: a peer stopped \
                     inside MPI or its link hangs. MPI cannot cancel a collective that holds \
                     this rank's buffers, so the job is aborted.",
                    e.op, e.waited
                );
                // SAFETY: MPI_Abort may be called from any thread under
                // MPI_THREAD_MULTIPLE; it does not return.
                unsafe {
                    mpi::ffi::MPI_Abort(mpi::ffi::RSMPI_COMM_WORLD, 124);
                }
            });
            started.unwrap_or_else(|e| {
                tracing::warn!(
                    "MPI rank {}: no watchdog thread ({e}); a data phase stuck in MPI will not \
                     be aborted after the timeout",
                    self.rank
                );
                Watchdog::inactive()
            })
        })
    }

    /// The per-collective timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// A duplicate (collective call) whose collectives time out after `timeout`.
    pub fn duplicate_with_timeout(&self, timeout: Duration) -> Result<MpiComm> {
        let start = Instant::now();
        self.check_in(
            exchange::Desc::bare(0, crate::comm::local::desc::OpKind::Duplicate),
            start,
        )?;
        Ok(MpiComm::wrap(
            self.comm.duplicate(),
            Arc::clone(&self.env),
            timeout,
            self.reduction,
        ))
    }

    /// Records that the ranks are out of step, so later calls fail fast.
    fn break_with(&self, reason: &str) {
        self.broken
            .borrow_mut()
            .get_or_insert_with(|| reason.to_string());
    }

    /// A sub-communicator from a blocking MPI constructor, after the descriptor exchange
    /// proved every rank is there.
    fn child(&self, sub: SimpleCommunicator) -> Box<dyn crate::comm::Communicator> {
        Box::new(MpiComm::wrap(
            sub,
            Arc::clone(&self.env),
            self.timeout,
            self.reduction,
        ))
    }

    /// Converts a split color or key to MPI's `int`.
    fn c_int(&self, what: &str, v: usize, start: Instant) -> Result<i32> {
        i32::try_from(v).map_err(|_| {
            crate::comm::failure(
                self.rank,
                "split",
                None,
                start,
                format!("{what} {v} does not fit in an MPI int"),
            )
        })
    }

    /// `split` for the trait impl.
    fn split_impl(&self, color: usize, key: usize) -> Result<Box<dyn crate::comm::Communicator>> {
        let start = Instant::now();
        let (c, k) = (
            self.c_int("color", color, start)?,
            self.c_int("key", key, start)?,
        );
        self.check_in(exchange::Desc::split(color, key), start)?;
        match self.comm.split_by_color_with_key(Color::with_value(c), k) {
            Some(sub) => Ok(self.child(sub)),
            None => Err(crate::comm::failure(
                self.rank,
                "split",
                None,
                start,
                "MPI_Comm_split returned no communicator".into(),
            )),
        }
    }
}

/// This library's `MPI_IN_PLACE`, from its name: `(void *) 1` in Open MPI, `(void *) -1` in
/// MPICH and its derivatives; `None` (reduce out of place, then copy) for any other.
fn in_place_sentinel() -> Option<usize> {
    let v = mpi::environment::library_version().unwrap_or_default();
    if v.contains("Open MPI") {
        Some(1)
    } else if ["MPICH", "MVAPICH", "Intel(R) MPI"]
        .iter()
        .any(|m| v.contains(m))
    {
        Some(usize::MAX)
    } else {
        None
    }
}

/// Whether this node runs more ranks than it has cores: Open MPI's and the launcher's
/// local-size variables against the node's cores.
fn node_is_oversubscribed() -> bool {
    let local = [
        "OMPI_COMM_WORLD_LOCAL_SIZE",
        "LOCAL_WORLD_SIZE",
        "MPI_LOCALNRANKS",
    ]
    .iter()
    .find_map(|v| std::env::var(v).ok()?.parse::<usize>().ok());
    local.is_some_and(|l| l > crate::comm::cores::node_cores())
}
