//! The CPU backend: gemm for every matrix product, rayon (current pool) for the rest.

mod attention;
mod elementwise;
mod math;
mod matmul;
mod norm;
mod rope;
mod token;

use super::Backend;

pub(crate) use matmul::{gemm_raw, StridedMat};

/// Multi-threaded CPU kernels (f32 activations, f32 accumulation).
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuBackend;

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }
}

/// Rows per rayon task so that each task does at least ~32k elements of work: below that,
/// scheduling costs more than it saves.
fn rows_per_task(dim: usize) -> usize {
    (32 * 1024 / dim.max(1)).max(1)
}

/// A raw pointer that may cross threads; users guarantee disjoint writes.
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
impl SendPtr {
    /// The pointer; a method (not field access) so closures capture the whole `Send` wrapper.
    fn get(self) -> *mut f32 {
        self.0
    }
}

// SAFETY: only used to write provably disjoint regions from different rayon tasks.
unsafe impl Send for SendPtr {}
// SAFETY: as above.
unsafe impl Sync for SendPtr {}
