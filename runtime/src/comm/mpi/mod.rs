//! `mpi`: the [`Communicator`] contract over MPI (rsmpi with Open MPI), one rank per process,
//! started by `mpirun`/`srun`.
//!
//! The contract's rank-ordered sums are not what MPI's reductions promise (their algorithms
//! reassociate, and MPI has no bf16/f16), so reductions are built from data movement: an
//! all-to-all hands rank r block r of every rank's buffer, rank r reduces the blocks in rank
//! order with the same kernels as `local`, and an all-gather returns the blocks. Results are
//! therefore bitwise equal to `local`'s.
//!
//! Timeouts: every collective is a nonblocking MPI call polled against a deadline. MPI cannot
//! cancel a collective, so on timeout the scratch buffers it writes are leaked (never freed
//! while MPI may still write them) and the communicator is marked broken. Every collective
//! starts with an all-gather of the ranks' descriptors, which detects mismatched calls.

mod exchange;

use std::cell::{Cell, RefCell};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use mpi::environment::Universe;
use mpi::topology::{Color, SimpleCommunicator};
use mpi::traits::Communicator as _;
use mpi::Threading;

use crate::{Error, Result};

/// MPI stays initialized while any communicator lives; finalized after the last one drops
/// (mpirun reports processes that exit without finalizing as failed).
struct Env {
    universe: Universe,
    threading: Threading,
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
            .finish()
    }
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
                });
                *slot = Some(Arc::downgrade(&env));
                env
            }
        };
        let comm = env.universe.world();
        Ok(MpiComm::wrap(comm, env, timeout))
    }

    fn wrap(comm: SimpleCommunicator, env: Arc<Env>, timeout: Duration) -> MpiComm {
        let (rank, size) = (comm.rank() as usize, comm.size() as usize);
        MpiComm {
            comm,
            env,
            timeout,
            rank,
            size,
            seq: Cell::new(0),
            broken: RefCell::new(None),
        }
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
        ))
    }

    fn error(
        &self,
        op: &'static str,
        peer: Option<usize>,
        start: Instant,
        reason: String,
    ) -> Error {
        Error::Comm {
            op,
            rank: self.rank,
            peer,
            elapsed: start.elapsed(),
            reason,
        }
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
        Box::new(MpiComm::wrap(sub, Arc::clone(&self.env), self.timeout))
    }

    /// Converts a split color or key to MPI's `int`.
    fn c_int(&self, what: &str, v: usize, start: Instant) -> Result<i32> {
        i32::try_from(v).map_err(|_| {
            self.error(
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
            None => Err(self.error(
                "split",
                None,
                start,
                "MPI_Comm_split returned no communicator".into(),
            )),
        }
    }
}
