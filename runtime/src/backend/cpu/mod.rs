//! The CPU backend: gemm for every matrix product, rayon (current pool) for the rest.

mod attention;
mod elementwise;
mod math;
mod matmul;
mod norm;
mod optim;
mod optim_wide;
mod rope;
mod simd;
mod token;

use super::check::expect_len;
use super::{Backend, MemoryOps};
use crate::tensor::{BufRef, DType, FlatBuf, IdBuf, Storage, View, ViewMut};
use crate::{Error, Result};

pub(crate) use matmul::{gemm_raw, StridedMat};

/// Multi-threaded CPU kernels (f32 activations, f32 accumulation).
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuBackend;

impl Backend for CpuBackend {
    fn name(&self) -> String {
        "cpu".into()
    }
}

impl MemoryOps for CpuBackend {
    fn act_dtype(&self) -> DType {
        DType::F32
    }

    fn zeros(&self, dtype: DType, len: usize) -> Result<Storage> {
        // A plain zeroed vector, not the engine's buffer cache: layers' transients are
        // short-lived and glibc serves them well below 32 MiB.
        Ok(Storage::Host(match dtype {
            DType::F32 => FlatBuf::F32(vec![0.0; len]),
            DType::Bf16 => FlatBuf::Bf16(vec![half::bf16::ZERO; len]),
            DType::F16 => FlatBuf::F16(vec![half::f16::ZERO; len]),
        }))
    }

    fn upload(&self, src: BufRef<'_>) -> Result<Storage> {
        Ok(Storage::Host(FlatBuf::from_ref(src)))
    }

    fn upload_ids(&self, ids: &[i32]) -> Result<IdBuf> {
        Ok(IdBuf::Host(ids.to_vec()))
    }

    fn copy(&self, src: View<'_>) -> Result<Storage> {
        match src {
            View::Host(b) => Ok(Storage::Host(crate::tensor::spare::copy_of(b))),
            View::Cuda(_) | View::Meta(_) => Err(foreign("copy", "source")),
        }
    }

    fn param_dtype(&self, storage: DType) -> DType {
        crate::backend::MemoryModel::cpu().param_dtype(storage)
    }

    fn buffer(&self, dtype: DType, len: usize) -> Result<Storage> {
        Ok(Storage::Host(FlatBuf::zeros(dtype, len)))
    }

    fn buffer_uninit(&self, dtype: DType, len: usize) -> Result<Storage> {
        Ok(Storage::Host(crate::tensor::spare::take(dtype, len)))
    }

    fn recycle(&self, buf: Storage) {
        if let Storage::Host(b) = buf {
            crate::tensor::spare::give(b);
        }
    }

    fn adopt(&self, host: FlatBuf) -> Result<Storage> {
        Ok(Storage::Host(host))
    }
}

/// The error for a view the CPU backend cannot read (device memory or a dtype it does not take).
fn foreign(op: &'static str, what: &str) -> Error {
    Error::Invalid(format!(
        "{op}: {what} is not host f32 memory; the CPU backend computes on host f32 views \
         (copy device tensors to the host, or use the backend that owns them)"
    ))
}

/// The host f32 elements of an input view.
fn f32_in<'a>(op: &'static str, what: &str, v: View<'a>) -> Result<&'a [f32]> {
    v.host_f32().ok_or_else(|| foreign(op, what))
}

/// The host f32 elements of an output view.
fn f32_out<'a>(op: &'static str, what: &str, v: ViewMut<'a>) -> Result<&'a mut [f32]> {
    v.host_f32().ok_or_else(|| foreign(op, what))
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

/// Inputs of the CPU kernels' unit tests.
#[cfg(test)]
mod test_values {
    /// `n` hashed values spread over `[-spread/2, spread/2)` (`rot` varies the hash), with a
    /// tail that is not a multiple of any vector width when `n` is not.
    pub(super) fn hashed(n: usize, salt: u32, rot: u32, spread: f32) -> Vec<f32> {
        (0..n as u32)
            .map(|i| {
                let h = (i ^ salt).wrapping_mul(2_654_435_761).rotate_left(rot);
                (h as f32 / u32::MAX as f32 - 0.5) * spread
            })
            .collect()
    }

    /// Whether `a` and `b` hold the same bits.
    pub(super) fn same_bits(a: &[f32], b: &[f32]) -> bool {
        a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
    }
}
