//! Collectives: the `Communicator` contract that the ZeRO engine is built on, and its
//! implementations (`local`: ranks as threads in one process; `mpi`: Open MPI across processes).
//!
//! Invariant: for a given world size, `all_reduce` and `reduce_scatter` compute every element
//! as the sum over ranks in rank order, `((x0 + x1) + x2) + ...`, accumulated in f32 and
//! rounded once to the buffer's dtype; `Avg` divides that sum by the world size. The engine's
//! bitwise equivalence across ZeRO stages depends on it.

use half::{bf16, f16};

use crate::tensor::DType;
use crate::Result;

/// Reduction operator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    /// Sum in rank order.
    Sum,
    /// Sum in rank order, then divide by the world size.
    Avg,
    /// Element-wise maximum.
    Max,
}

/// A mutable buffer of one of the communicable dtypes.
#[derive(Debug)]
pub enum BufMut<'a> {
    /// f32 elements.
    F32(&'a mut [f32]),
    /// bf16 elements.
    Bf16(&'a mut [bf16]),
    /// f16 elements.
    F16(&'a mut [f16]),
}

/// A read-only buffer of one of the communicable dtypes.
#[derive(Debug, Clone, Copy)]
pub enum BufRef<'a> {
    /// f32 elements.
    F32(&'a [f32]),
    /// bf16 elements.
    Bf16(&'a [bf16]),
    /// f16 elements.
    F16(&'a [f16]),
}

impl BufMut<'_> {
    /// Element count.
    pub fn len(&self) -> usize {
        match self {
            BufMut::F32(b) => b.len(),
            BufMut::Bf16(b) => b.len(),
            BufMut::F16(b) => b.len(),
        }
    }
    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The dtype.
    pub fn dtype(&self) -> DType {
        match self {
            BufMut::F32(_) => DType::F32,
            BufMut::Bf16(_) => DType::Bf16,
            BufMut::F16(_) => DType::F16,
        }
    }
}

impl BufRef<'_> {
    /// Element count.
    pub fn len(&self) -> usize {
        match self {
            BufRef::F32(b) => b.len(),
            BufRef::Bf16(b) => b.len(),
            BufRef::F16(b) => b.len(),
        }
    }
    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The dtype.
    pub fn dtype(&self) -> DType {
        match self {
            BufRef::F32(_) => DType::F32,
            BufRef::Bf16(_) => DType::Bf16,
            BufRef::F16(_) => DType::F16,
        }
    }
}

/// The collectives ZeRO needs. Every rank of the group must call the same collectives in the
/// same order with the same lengths and dtypes; a mismatch, a dead peer or a timeout is an
/// [`crate::Error::Comm`] on every surviving rank, never a hang or silent corruption.
pub trait Communicator: Send {
    /// This rank, `0..world_size`.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn world_size(&self) -> usize;
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
    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<()>;
    /// A new, independent communicator over the same ranks (collective call), so that a
    /// communication worker thread can run collectives concurrently with this one, as a
    /// second NCCL stream would.
    fn duplicate(&self) -> Result<Box<dyn Communicator>>;
    /// Splits into sub-groups (collective call): ranks with the same `color` form a group,
    /// ordered by `key` then by rank. Used for hierarchical partitioning.
    fn split(&self, color: usize, key: usize) -> Result<Box<dyn Communicator>>;
}

pub mod local;
pub mod reference;

/// Buffers convert from slices of their element types, so generic code can stay generic.
macro_rules! buf_from {
    ($t:ty, $v:ident) => {
        impl<'a> From<&'a mut [$t]> for BufMut<'a> {
            fn from(b: &'a mut [$t]) -> Self {
                BufMut::$v(b)
            }
        }
        impl<'a> From<&'a [$t]> for BufRef<'a> {
            fn from(b: &'a [$t]) -> Self {
                BufRef::$v(b)
            }
        }
    };
}
buf_from!(f32, F32);
buf_from!(bf16, Bf16);
buf_from!(f16, F16);
pub mod bench;
pub mod launch;
#[cfg(feature = "mpi")]
pub mod mpi;
pub mod store;
pub mod worker;
