//! The seam under [`super::NcclComm`]: what it needs from an NCCL library. The real one
//! (`real.rs`, `--features cuda`) calls NCCL through `cudarc::nccl`; the fake (`fake.rs`)
//! lets CI drive every failure path (a dead peer, an asynchronous NCCL error) without a GPU.

use crate::comm::ReduceOp;
use crate::tensor::{View, ViewMut};
use crate::Result;

/// NCCL's unique id (`ncclUniqueId`, 128 bytes), created by rank 0 and handed to every rank
/// through the rendezvous store.
pub type NcclId = [u8; 128];

/// One collective with its buffers where they live, as the communicator's view forms pass
/// them: the real library hands device buffers to NCCL as they are and stages host buffers
/// through device memory.
#[derive(Debug)]
pub enum NcclOp<'a> {
    /// In-place all-reduce.
    AllReduce {
        /// The buffer.
        buf: ViewMut<'a>,
        /// The operator.
        op: ReduceOp,
    },
    /// Reduce-scatter.
    ReduceScatter {
        /// `world * output.len()` elements.
        input: View<'a>,
        /// This rank's reduced chunk.
        output: ViewMut<'a>,
        /// The operator.
        op: ReduceOp,
    },
    /// All-gather.
    AllGather {
        /// This rank's part.
        input: View<'a>,
        /// Every rank's part, in rank order.
        output: ViewMut<'a>,
    },
    /// Broadcast from `root`.
    Broadcast {
        /// The buffer.
        buf: ViewMut<'a>,
        /// The rank whose buffer is copied.
        root: usize,
    },
    /// All-to-all (grouped sends and receives): chunk `r` of `input` goes to rank `r`, and
    /// chunk `r` of `output` comes from rank `r`. The deterministic reductions use it.
    AllToAll {
        /// `world` equal chunks.
        input: View<'a>,
        /// `world` equal chunks.
        output: ViewMut<'a>,
    },
}

impl NcclOp<'_> {
    /// The collective's name in errors.
    pub fn name(&self) -> &'static str {
        match self {
            NcclOp::AllReduce { .. } => "all_reduce",
            NcclOp::ReduceScatter { .. } => "reduce_scatter",
            NcclOp::AllGather { .. } => "all_gather",
            NcclOp::Broadcast { .. } => "broadcast",
            NcclOp::AllToAll { .. } => "all_to_all",
        }
    }
}

/// Where a started collective stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Poll {
    /// Finished; its results are in the op's output buffers.
    Done,
    /// Still running (or waiting for a peer).
    Pending,
    /// NCCL reported an error (`ncclCommGetAsyncError`, or a failed launch).
    Failed(String),
}

/// An NCCL library: creates unique ids and communicators.
pub trait NcclLib: Send + Sync {
    /// The library and its version, for logs.
    fn describe(&self) -> String;
    /// A fresh unique id (rank 0 only).
    fn unique_id(&self) -> Result<NcclId>;
    /// Starts creating this rank's communicator (non-blocking: poll it with
    /// [`NcclHandle::poll_init`], so that a rank that never joins cannot hang the others).
    fn init(&self, id: &NcclId, world: usize, rank: usize) -> Result<Box<dyn NcclHandle>>;
}

/// One rank's NCCL communicator.
pub trait NcclHandle: Send {
    /// Whether initialisation finished ([`Poll::Done`]), is still in progress or failed.
    fn poll_init(&mut self) -> Poll;
    /// Launches `op` (asynchronous: returns once it is queued).
    fn start(&mut self, op: &mut NcclOp<'_>) -> Result<()>;
    /// Progress of the op started last; on [`Poll::Done`] its results are in `op`.
    fn poll(&mut self, op: &mut NcclOp<'_>) -> Poll;
    /// `ncclCommAbort`: stops every operation in flight; the handle is unusable afterwards.
    fn abort(&mut self);
    /// `ncclCommSplit` (collective): ranks with the same `color` form a new communicator,
    /// ordered by `key`, `rank` of `world` in it (the caller computed both; NCCL recomputes
    /// them); like [`NcclLib::init`], poll the new handle with `poll_init`.
    fn split(
        &mut self,
        color: usize,
        key: usize,
        rank: usize,
        world: usize,
    ) -> Result<Box<dyn NcclHandle>>;
}
