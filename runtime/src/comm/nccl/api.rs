//! The seam under [`super::NcclComm`]: what it needs from an NCCL library. The real one
//! (`real.rs`, `--features cuda`) calls NCCL through `cudarc::nccl`; the fake (`fake.rs`)
//! lets CI drive every failure path (a dead peer, an asynchronous NCCL error, a collective
//! that is queued but never finishes) without a GPU.

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

    /// The op's input and output (the same buffer for the in-place ones).
    pub fn views(&self) -> (View<'_>, View<'_>) {
        match self {
            NcclOp::AllReduce { buf, .. } | NcclOp::Broadcast { buf, .. } => {
                (buf.as_view(), buf.as_view())
            }
            NcclOp::ReduceScatter { input, output, .. }
            | NcclOp::AllGather { input, output }
            | NcclOp::AllToAll { input, output } => (*input, output.as_view()),
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
///
/// Where an op runs: an op whose buffers are all device memory of one device
/// ([`super::device::device_of`]) is queued on that device's collective stream, which the
/// communicator has made wait for the device's compute stream; the communicator records the
/// op's end there itself once [`NcclHandle::poll_enqueued`] says the op is on the stream. Any
/// other op runs on the library's own stream, host buffers staged through device memory.
pub trait NcclHandle: Send {
    /// Whether initialisation finished ([`Poll::Done`]), is still in progress or failed.
    fn poll_init(&mut self) -> Poll;
    /// Launches `op` (asynchronous: returns once NCCL accepted it).
    fn start(&mut self, op: &mut NcclOp<'_>) -> Result<()>;
    /// Whether the op started last is on its stream yet ([`Poll::Done`]): a non-blocking
    /// communicator may still be queueing it when [`NcclHandle::start`] returns, and an event
    /// recorded before it is queued would mark nothing.
    fn poll_enqueued(&mut self, op: &mut NcclOp<'_>) -> Poll;
    /// Progress of the op started last. `op` is given for an op on the library's stream (on
    /// [`Poll::Done`] its results are in `op`'s host buffers); `None` for an op on a device's
    /// stream, whose end the communicator's own event marks (this then only reports NCCL's
    /// asynchronous errors and whether the library saw the op finish).
    fn poll(&mut self, op: Option<&mut NcclOp<'_>>) -> Poll;
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
