//! Matrix products through the `gemm` crate (f32 accumulation), threaded on the current
//! rayon pool for large products and single-threaded for small ones (attention's per-head
//! products run one per rayon task instead).

use gemm::Parallelism;

use super::CpuBackend;
use crate::backend::{Accumulate, MatmulOps, MatmulShape, Transpose};
use crate::{Error, Result};

/// Below this many multiply-adds a product runs on one thread.
const PARALLEL_FLOPS: usize = 1 << 18;

/// A strided matrix view: element `(i, j)` at `ptr + i*rs + j*cs`.
#[derive(Clone, Copy)]
pub(crate) struct StridedMat {
    pub ptr: *const f32,
    pub rs: isize,
    pub cs: isize,
}

/// `dst (=|+=) lhs · rhs` on strided views.
///
/// # Safety
/// All three views must be valid for `m×k`, `k×n` and `m×n` elements at their strides, and
/// `dst` must not alias the inputs nor be written concurrently.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm_raw(
    m: usize,
    n: usize,
    k: usize,
    dst: StridedMat,
    lhs: StridedMat,
    rhs: StridedMat,
    acc: Accumulate,
    threads: usize,
) {
    let par = if threads > 1 && m * n * k >= PARALLEL_FLOPS {
        Parallelism::Rayon(threads)
    } else {
        Parallelism::None
    };
    let read_dst = acc == Accumulate::Add;
    // SAFETY: the caller guarantees the views; gemm computes dst = 1·dst + 1·lhs·rhs.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.ptr as *mut f32,
            dst.cs,
            dst.rs,
            read_dst,
            lhs.ptr,
            lhs.cs,
            lhs.rs,
            rhs.ptr,
            rhs.cs,
            rhs.rs,
            1.0,
            1.0,
            false,
            false,
            false,
            par,
        )
    }
}

fn check_len(what: &str, got: usize, want: usize) -> Result<()> {
    if got == want {
        return Ok(());
    }
    Err(Error::Shape {
        op: "matmul",
        expected: format!("{what} with {want} elements"),
        got: format!("{got}"),
    })
}

impl MatmulOps for CpuBackend {
    fn matmul(
        &self,
        s: MatmulShape,
        a: &[f32],
        b: &[f32],
        c: &mut [f32],
        acc: Accumulate,
    ) -> Result<()> {
        check_len("A", a.len(), s.m * s.k)?;
        check_len("B", b.len(), s.k * s.n)?;
        check_len("C", c.len(), s.m * s.n)?;
        if s.m == 0 || s.n == 0 {
            return Ok(());
        }
        let (m, n, k) = (s.m as isize, s.n as isize, s.k as isize);
        let lhs = match s.ta {
            Transpose::No => (k, 1),
            Transpose::Yes => (1, m),
        };
        let rhs = match s.tb {
            Transpose::No => (n, 1),
            Transpose::Yes => (1, k),
        };
        let view = |ptr: *const f32, (rs, cs): (isize, isize)| StridedMat { ptr, rs, cs };
        // SAFETY: lengths were checked above against the strides chosen for each layout.
        unsafe {
            gemm_raw(
                s.m,
                s.n,
                s.k,
                view(c.as_mut_ptr(), (n, 1)),
                view(a.as_ptr(), lhs),
                view(b.as_ptr(), rhs),
                acc,
                rayon::current_num_threads(),
            );
        }
        Ok(())
    }
}
