//! `nccl`: the NCCL communicator, one process per GPU.
//!
//! The unique id travels through the TCP rendezvous store (rank 0 creates it and `set`s it,
//! the others `wait` for it). Every collective is launched, then polled until NCCL has queued
//! it and, at the latest before the next one, until it finishes, NCCL reports an asynchronous
//! error, or `comms.timeout` passes; on failure the rank aborts its communicator
//! (`ncclCommAbort`, so nothing stays stuck on the GPU), writes what it saw to the store's
//! failure board and reads its peers' entries, so that the error names the collective, its
//! number and the rank that never arrived or failed first.
//!
//! Ordering (`device.rs`, `run.rs`): a collective whose buffers are all memory of one device
//! is queued on that device's collective stream, which first waits for an event (`ready`)
//! recorded on the compute stream that wrote the buffers; after it, `done` is recorded there
//! and the compute stream waits for it before anything reads the results. The host fences
//! no stream: it returns once NCCL has queued the collective and settles it (the completion
//! poll above) at the communicator's next collective, a split, [`Communicator::fence`] or
//! the communicator's drop. Collectives with host buffers are polled to completion at once.
//!
//! Reduction order: NCCL's native ring/tree sums do not add in rank order. With
//! `deterministic` set, `reduce_scatter` becomes an all-to-all plus a rank-ordered sum (the
//! local communicator's arithmetic, bit for bit) and `all_reduce` a deterministic
//! reduce-scatter plus an all-gather: the "stages are bitwise identical" invariant then holds
//! across communicators, at the cost measured in `docs/scaling.md`.
//!
//! Buffers: the view forms hand device buffers to the library as they are (NCCL reads and
//! writes them in place); host buffers are staged through device memory by the library on
//! its own stream.
//!
//! The library underneath is a trait ([`NcclLib`]): the real one needs `--features cuda`
//! (`real.rs`); [`fake`] drives the failure paths in CI.

mod api;
mod board;
#[cfg(feature = "cuda")]
mod device;
#[cfg(not(feature = "cuda"))]
#[path = "no_device.rs"]
mod device;
pub mod fake;
mod ordered;
#[cfg(feature = "cuda")]
pub mod real;
mod run;

use std::cell::{Cell, RefCell};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use api::{NcclHandle, NcclId, NcclLib, NcclOp, Poll};
use board::Board;
use device::Marks;
use run::{poll_until, Pending};

use super::store::TcpStore;
use super::{BufMut, CommBackend, Communicator, ReduceOp};
use crate::tensor::staging::{read_host, write_host};
use crate::tensor::{View, ViewMut};
use crate::{Error, Result};

/// Options of an NCCL communicator.
#[derive(Debug, Clone)]
pub struct NcclOptions {
    /// Every collective (and the initialisation) fails after this long without finishing.
    pub timeout: Duration,
    /// Rank-ordered reductions (`comms.reduction = "rank_ordered"`).
    pub deterministic: bool,
}

impl NcclOptions {
    /// The options the config's `comms` section asks for.
    pub fn from_config(c: &ferrozero_config::resolved::CommsConfig) -> Self {
        Self {
            timeout: c.timeout,
            deterministic: c.reduction == ferrozero_config::resolved::CommReduction::RankOrdered,
        }
    }
}

/// One rank of an NCCL communicator.
pub struct NcclComm {
    handle: RefCell<Box<dyn NcclHandle>>,
    board: Board,
    rank: usize,
    world: usize,
    opts: NcclOptions,
    /// Collectives started so far (their number names them on the failure board).
    seq: Cell<u64>,
    /// Communicators made from this one so far (names their store keys).
    children: Cell<u64>,
    /// Set once a collective failed: the communicator was aborted and fails fast afterwards.
    broken: RefCell<Option<String>>,
    /// This communicator's events on the devices whose buffers it exchanged.
    marks: Marks,
    /// The collective left running on a device's stream, settled before the next one.
    pending: RefCell<Option<Pending>>,
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("opts", &self.opts)
            .finish()
    }
}

impl NcclComm {
    /// Creates this rank's communicator (collective over `world` ranks): rank 0 makes the
    /// unique id and publishes it under `tag` in `store`; every rank then initialises.
    pub fn init(
        lib: &dyn NcclLib,
        store: Arc<TcpStore>,
        tag: &str,
        (rank, world): (usize, usize),
        opts: NcclOptions,
    ) -> Result<Self> {
        if rank >= world {
            return Err(Error::Invalid(format!(
                "NCCL rank {rank} is outside a world of {world}"
            )));
        }
        let key = format!("{tag}/nccl-id");
        let id = if rank == 0 {
            let id = lib.unique_id()?;
            store.set(&key, &id)?;
            id
        } else {
            let v = store.wait(&key)?;
            v.as_slice().try_into().map_err(|_| {
                Error::Invalid(format!(
                    "the store's {key} holds {} bytes, not an NCCL id of 128",
                    v.len()
                ))
            })?
        };
        let handle = lib.init(&id, world, rank)?;
        let board = Board::new(store, tag, rank, world);
        Self::ready(handle, board, rank, world, opts)
    }

    /// Waits (within the timeout) for `handle`'s initialisation, then wraps it.
    fn ready(
        mut handle: Box<dyn NcclHandle>,
        board: Board,
        rank: usize,
        world: usize,
        opts: NcclOptions,
    ) -> Result<Self> {
        let start = Instant::now();
        let outcome = poll_until(opts.timeout, start, || handle.poll_init());
        let comm = Self {
            handle: RefCell::new(handle),
            board,
            rank,
            world,
            opts,
            seq: Cell::new(0),
            children: Cell::new(0),
            broken: RefCell::new(None),
            marks: Marks::default(),
            pending: RefCell::new(None),
        };
        match outcome {
            Poll::Done => Ok(comm),
            Poll::Failed(reason) => Err(comm.fail("init", 0, start, Some(reason))),
            Poll::Pending => Err(comm.fail("init", 0, start, None)),
        }
    }

    /// Checks a collective's lengths on this rank before anything is launched.
    fn check_lengths(&self, op: &'static str, input: usize, output: usize) -> Result<()> {
        let ok = match op {
            "reduce_scatter" => input == output * self.world,
            "all_gather" => output == input * self.world,
            "all_to_all" => input == output && input.is_multiple_of(self.world),
            _ => input == output,
        };
        if ok {
            return Ok(());
        }
        Err(crate::comm::failure(
            self.rank,
            op,
            None,
            Instant::now(),
            format!(
                "{op} on {} ranks cannot take {input} input and {output} output elements",
                self.world
            ),
        ))
    }
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn backend(&self) -> CommBackend {
        CommBackend::Nccl
    }

    fn deterministic(&self) -> bool {
        self.opts.deterministic
    }

    crate::comm::host_by_views!(all_to_all);

    /// Device buffers go to NCCL as they are; the rank-ordered sum runs on the host, so
    /// with `deterministic` they are staged through host memory.
    fn all_reduce_view(&self, buf: ViewMut<'_>, op: ReduceOp) -> Result<()> {
        if self.opts.deterministic && op != ReduceOp::Max {
            return write_host(buf, |b| ordered::all_reduce(self, b, op));
        }
        self.run(NcclOp::AllReduce { buf, op })
    }

    fn reduce_scatter_view(
        &self,
        input: View<'_>,
        output: ViewMut<'_>,
        op: ReduceOp,
    ) -> Result<()> {
        self.check_lengths("reduce_scatter", input.len(), output.len())?;
        if self.opts.deterministic && op != ReduceOp::Max {
            return read_host(input, |i| {
                write_host(output, |o| ordered::reduce_scatter(self, i, o, op))
            });
        }
        self.run(NcclOp::ReduceScatter { input, output, op })
    }

    fn all_gather_view(&self, input: View<'_>, output: ViewMut<'_>) -> Result<()> {
        self.check_lengths("all_gather", input.len(), output.len())?;
        self.run(NcclOp::AllGather { input, output })
    }

    /// NCCL's grouped sends and receives of the slots alone, device buffers as they are (a
    /// copy: deterministic whatever the transport).
    fn all_to_all_view(&self, input: View<'_>, output: ViewMut<'_>) -> Result<()> {
        self.check_lengths("all_to_all", input.len(), output.len())?;
        self.run(NcclOp::AllToAll { input, output })
    }

    fn broadcast_view(&self, buf: ViewMut<'_>, root: usize) -> Result<()> {
        if root >= self.world {
            let why = format!("broadcast root {root} is not a rank of {}", self.world);
            return Err(crate::comm::failure(
                self.rank,
                "broadcast",
                None,
                Instant::now(),
                why,
            ));
        }
        self.run(NcclOp::Broadcast { buf, root })
    }

    /// A one-element all-reduce: it completes only once every rank launched it.
    fn barrier(&self) -> Result<()> {
        let mut v = [0.0f32];
        self.run(NcclOp::AllReduce {
            buf: ViewMut::Host(BufMut::F32(&mut v)),
            op: ReduceOp::Sum,
        })
    }

    fn duplicate(&self) -> Result<Box<dyn Communicator>> {
        self.split(0, self.rank)
    }

    /// Settles the collective left running on a device's stream (see `run.rs`).
    fn fence(&self) -> Result<()> {
        self.settle()
    }

    fn split(&self, color: usize, key: usize) -> Result<Box<dyn Communicator>> {
        self.settle()?;
        let start = Instant::now();
        if let Some(reason) = self.broken.borrow().clone() {
            return Err(crate::comm::failure(
                self.rank, "split", None, start, reason,
            ));
        }
        let n = self.children.get();
        self.children.set(n + 1);
        // Members learn the new group's size and their rank in it from the board.
        let (rank, world) = self.board.split_membership(n, color, key)?;
        let handle = self
            .handle
            .borrow_mut()
            .split(color, key, rank, world)
            .map_err(|e| crate::comm::failure(self.rank, "split", None, start, e.to_string()))?;
        let board = self.board.child(n, color, rank, world);
        Ok(Box::new(Self::ready(
            handle,
            board,
            rank,
            world,
            self.opts.clone(),
        )?))
    }
}

impl Drop for NcclComm {
    /// A collective still running on a device's stream finishes before the handle goes (its
    /// drop aborts the communicator, which would stop it halfway).
    fn drop(&mut self) {
        if let Err(e) = self.settle() {
            tracing::warn!("rank {}: {e}", self.rank);
        }
    }
}

/// The `nccl` row of [`crate::comm::open::COMMUNICATORS`]: this process's rank of a job
/// `ferrozero launch` started ([`NcclComm::from_env`]).
#[cfg(feature = "cuda")]
pub(crate) fn open(
    ranks: Option<usize>,
    cfg: &ferrozero_config::resolved::CommsConfig,
) -> Result<super::open::Opened> {
    super::open::one_per_process("nccl", ranks)?;
    let comm = NcclComm::from_env(NcclOptions::from_config(cfg))?;
    Ok(super::open::Opened::Process(Box::new(comm)))
}

/// Without the CUDA build there is no NCCL library to open.
#[cfg(not(feature = "cuda"))]
pub(crate) fn open(
    _ranks: Option<usize>,
    _cfg: &ferrozero_config::resolved::CommsConfig,
) -> Result<super::open::Opened> {
    Err(Error::Unavailable {
        what: "the NCCL backend",
        why: "this ferrozero was built without the `cuda` feature (cargo build --features cuda)"
            .into(),
    })
}

#[cfg(feature = "cuda")]
impl NcclComm {
    /// The world communicator of a job started by `ferrozero launch` (which sets `RANK`,
    /// `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR` and `MASTER_PORT`): NCCL on GPU
    /// `LOCAL_RANK`, the unique id through the store that rank 0 serves. The communicator
    /// holds the store, so the hosting rank, when it drops the communicator, waits for the
    /// others to leave the store before it stops serving.
    pub fn from_env(opts: NcclOptions) -> Result<Self> {
        let store = TcpStore::from_env(opts.timeout)?;
        let var = |n: &str| {
            std::env::var(n)
                .ok()
                .and_then(|v| v.parse::<usize>().ok())
                .ok_or_else(|| {
                    Error::Config(format!(
                        "{n} is not set or not a number (start ranks with `ferrozero launch`)"
                    ))
                })
        };
        let (rank, world, local) = (var("RANK")?, var("WORLD_SIZE")?, var("LOCAL_RANK")?);
        let lib = real::RealNccl::open(local)?;
        tracing::info!(
            "{} on GPU {local} for rank {rank} of {world}",
            lib.describe()
        );
        Self::init(&lib, Arc::new(store), "world", (rank, world), opts)
    }
}
