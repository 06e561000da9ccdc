//! Collectives: the `Communicator` contract that the ZeRO engine is built on, and its
//! implementations (`local`: ranks as threads in one process; `mpi`: Open MPI across processes).
//!
//! Invariant: for a given world size, `all_reduce` and `reduce_scatter` compute every element
//! as the sum over ranks in rank order, `((x0 + x1) + x2) + ...`, accumulated in f32 and
//! rounded once to the buffer's dtype; `Avg` divides that sum by the world size. The engine's
//! bitwise equivalence across ZeRO stages depends on it. `local` always does; `mpi` does with
//! [`Reduction::RankOrdered`], and by default ([`Reduction::Native`]) hands f32 sums to MPI's
//! own reductions, which equal rank order at two ranks only.

use crate::Result;
pub use ferrozero_config::resolved::CommBackend;

pub use crate::backend::ReduceOp;

/// How a communicator whose transport has its own reductions (MPI) forms sums.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Reduction {
    /// The transport's own all-reduce (`MPI_Allreduce`) for f32 `Sum`/`Avg`: its bandwidth,
    /// and its association order, which is deterministic for a world size and length but is
    /// rank order only at two ranks. Reduce-scatters, bf16/f16 and `Max` are rank-ordered
    /// either way (an all-to-all and a fold beat `MPI_Reduce_scatter_block`; MPI has no bf16).
    #[default]
    Native,
    /// Rank order `((x0 + x1) + x2) + ...` in f32, rounded once: bitwise equal to `local`
    /// at every world size, so ZeRO stages stay bitwise identical over MPI too.
    RankOrdered,
}

use crate::tensor::staging::{read_host, write_host};
/// The host buffers collectives exchange (defined with the tensor types, whose host views
/// they are).
pub use crate::tensor::{BufMut, BufRef};
use crate::tensor::{View, ViewMut};

/// The collectives ZeRO needs. Every rank of the group must call the same collectives in the
/// same order with the same lengths and dtypes; a mismatch, a dead peer or a timeout is an
/// [`crate::Error::Comm`] on every surviving rank, never a hang or silent corruption.
pub trait Communicator: Send {
    /// This rank, `0..world_size`.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn world_size(&self) -> usize;
    /// The transport underneath, as `comms.backend` names it: the engine refuses a
    /// communicator other than the one the config asks for.
    fn backend(&self) -> CommBackend;
    /// Whether reductions add in a fixed order (results independent of timing and equal to
    /// the local communicator's for the same group structure). NCCL's native ring is not.
    fn deterministic(&self) -> bool {
        true
    }
    /// In-place reduction across ranks.
    fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()>;
    /// Reduces `input` (length `world_size * output.len()`) across ranks; rank r receives
    /// elements `r*n .. (r+1)*n` of the result in `output`.
    fn reduce_scatter(&self, input: BufRef<'_>, output: BufMut<'_>, op: ReduceOp) -> Result<()>;
    /// Concatenates every rank's `input` in rank order into `output`
    /// (length `world_size * input.len()`).
    fn all_gather(&self, input: BufRef<'_>, output: BufMut<'_>) -> Result<()>;
    /// Copies `root`'s buffer to every rank.
    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<()>;
    /// Every rank's `input` is `world_size` equal slots; `output` (as long) receives slot
    /// `rank` of every rank's input, in rank order. A copy, never arithmetic, so any bits
    /// travel (ZeRO++'s packed quantized words). By default one [`Communicator::all_gather`]
    /// of whole inputs, of which each rank keeps its slots (the transport moves `world_size`
    /// times the bytes); `local` exchanges the slots alone (device memory staged through
    /// host memory by [`Communicator::all_to_all_view`]'s default), and `mpi` with one
    /// `MPI_Alltoall`.
    fn all_to_all(&self, input: BufRef<'_>, output: BufMut<'_>) -> Result<()> {
        all_to_all_by_gather(self, input, output)
    }
    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<()>;

    /// [`Communicator::all_reduce`] on elements wherever they live (the engine's buffers).
    /// Every rank passes the same kind of memory. By default device memory is staged through
    /// host memory (explicit copies: the transport reaches host memory only, as MPI does);
    /// `local` exchanges device buffers in device memory and `nccl` hands them to NCCL.
    fn all_reduce_view(&self, buf: ViewMut<'_>, op: ReduceOp) -> Result<()> {
        write_host(buf, |b| self.all_reduce(b, op))
    }
    /// [`Communicator::reduce_scatter`] on elements wherever they live (see
    /// [`Communicator::all_reduce_view`]); both buffers on one device.
    fn reduce_scatter_view(
        &self,
        input: View<'_>,
        output: ViewMut<'_>,
        op: ReduceOp,
    ) -> Result<()> {
        read_host(input, |i| {
            write_host(output, |o| self.reduce_scatter(i, o, op))
        })
    }
    /// [`Communicator::all_gather`] on elements wherever they live (see
    /// [`Communicator::all_reduce_view`]); both buffers on one device.
    fn all_gather_view(&self, input: View<'_>, output: ViewMut<'_>) -> Result<()> {
        read_host(input, |i| write_host(output, |o| self.all_gather(i, o)))
    }
    /// [`Communicator::all_to_all`] on elements wherever they live (see
    /// [`Communicator::all_reduce_view`]); both buffers on one device.
    fn all_to_all_view(&self, input: View<'_>, output: ViewMut<'_>) -> Result<()> {
        read_host(input, |i| write_host(output, |o| self.all_to_all(i, o)))
    }
    /// [`Communicator::broadcast`] on elements wherever they live (see
    /// [`Communicator::all_reduce_view`]).
    fn broadcast_view(&self, buf: ViewMut<'_>, root: usize) -> Result<()> {
        write_host(buf, |b| self.broadcast(b, root))
    }
    /// Returns once every collective this rank started has finished, or with the error of
    /// the one that failed. Collectives that finish before they return (every communicator
    /// but `nccl` on device buffers) leave nothing to wait for. Every later collective
    /// settles the earlier ones first, so the engine needs no call: its step sums the loss on
    /// the host right after its one wait for the device. It is for a caller that must know
    /// sooner (a communicator that runs no further collective, a benchmark's timing).
    fn fence(&self) -> Result<()> {
        Ok(())
    }
    /// A new, independent communicator over the same ranks (collective call), so that a
    /// communication worker thread can run collectives concurrently with this one, as a
    /// second NCCL stream would.
    fn duplicate(&self) -> Result<Box<dyn Communicator>>;
    /// Splits into sub-groups (collective call): ranks with the same `color` form a group,
    /// ordered by `key` then by rank. Used for hierarchical partitioning.
    fn split(&self, color: usize, key: usize) -> Result<Box<dyn Communicator>>;
    /// Splits into groups of `g` consecutive ranks (rank `r` is position `r % g` of group
    /// `r / g`; collective): MiCS's shard groups, hpZ's partitions. By default a
    /// [`Communicator::split`]; a communicator that cannot see its peers' colours
    /// (`meta::MetaComm`) computes it.
    fn split_blocks(&self, g: usize) -> Result<Box<dyn Communicator>> {
        let r = self.rank();
        self.split(r / g.max(1), r)
    }
    /// Splits into `g` strided groups (rank `r` is position `r / g` of group `r % g`;
    /// collective): MiCS's replica groups across the shard groups. See
    /// [`Communicator::split_blocks`].
    fn split_strided(&self, g: usize) -> Result<Box<dyn Communicator>> {
        let r = self.rank();
        self.split(r % g.max(1), r)
    }
}

/// [`Communicator::all_to_all`] through one all-gather of whole inputs.
pub fn all_to_all_by_gather<C: Communicator + ?Sized>(
    comm: &C,
    input: BufRef<'_>,
    output: BufMut<'_>,
) -> Result<()> {
    let (world, rank, n) = (comm.world_size(), comm.rank(), input.len());
    if n % world != 0 || output.len() != n || output.dtype() != input.dtype() {
        return Err(crate::Error::Shape {
            op: "all_to_all",
            expected: format!(
                "an input of {world} equal slots and an output as long, of one dtype"
            ),
            got: format!(
                "{n} {:?} elements into {} {:?}",
                input.dtype(),
                output.len(),
                output.dtype()
            ),
        });
    }
    let m = n / world;
    let mut all = crate::tensor::FlatBuf::zeros(input.dtype(), n * world);
    comm.all_gather(input, all.as_mut())?;
    let mut out = output;
    let size = input.dtype().size();
    for k in 0..world {
        let src = all.as_ref_range(k * n + rank * m..k * n + (rank + 1) * m);
        let dst = out.reborrow().range(k * m..(k + 1) * m);
        dst.bytes_mut().copy_from_slice(&src.bytes()[..m * size]);
    }
    Ok(())
}

/// A collective's failure on `rank`, timed from `start`: the one error every transport
/// reports.
pub(crate) fn failure(
    rank: usize,
    op: &'static str,
    peer: Option<usize>,
    start: std::time::Instant,
    reason: String,
) -> crate::Error {
    crate::Error::Comm {
        op,
        rank,
        peer,
        elapsed: start.elapsed(),
        reason,
    }
}

/// The host collectives of a communicator whose view collectives are its own, each handing
/// its host buffers to the `_view` form (the trait's defaults go the other way, so that a
/// transport of host memory writes the host forms alone); `all_to_all` too when named.
macro_rules! host_by_views {
    () => {
        fn all_reduce(
            &self,
            buf: $crate::tensor::BufMut<'_>,
            op: $crate::comm::ReduceOp,
        ) -> $crate::Result<()> {
            self.all_reduce_view($crate::tensor::ViewMut::Host(buf), op)
        }

        fn reduce_scatter(
            &self,
            input: $crate::tensor::BufRef<'_>,
            output: $crate::tensor::BufMut<'_>,
            op: $crate::comm::ReduceOp,
        ) -> $crate::Result<()> {
            use $crate::tensor::{View, ViewMut};
            self.reduce_scatter_view(View::Host(input), ViewMut::Host(output), op)
        }

        fn all_gather(
            &self,
            input: $crate::tensor::BufRef<'_>,
            output: $crate::tensor::BufMut<'_>,
        ) -> $crate::Result<()> {
            use $crate::tensor::{View, ViewMut};
            self.all_gather_view(View::Host(input), ViewMut::Host(output))
        }

        fn broadcast(&self, buf: $crate::tensor::BufMut<'_>, root: usize) -> $crate::Result<()> {
            self.broadcast_view($crate::tensor::ViewMut::Host(buf), root)
        }
    };
    (all_to_all) => {
        $crate::comm::host_by_views!();

        fn all_to_all(
            &self,
            input: $crate::tensor::BufRef<'_>,
            output: $crate::tensor::BufMut<'_>,
        ) -> $crate::Result<()> {
            use $crate::tensor::{View, ViewMut};
            self.all_to_all_view(View::Host(input), ViewMut::Host(output))
        }
    };
}
pub(crate) use host_by_views;

pub mod hybrid;
pub mod local;
pub mod logger;
pub mod meta;
pub mod quantized;
pub mod reference;

pub mod bench;
#[cfg(any(feature = "mpi", test))]
pub(crate) mod cores;
#[cfg(feature = "cuda")]
mod events;
pub mod launch;
#[cfg(feature = "mpi")]
pub mod mpi;
pub mod nccl;
pub mod open;
pub use open::{open, open_rank};
pub mod store;
pub mod worker;
