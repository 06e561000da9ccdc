//! Matrix products through the `gemm` crate (f32 accumulation), threaded on the current
//! rayon pool for large products and single-threaded for small ones (attention's per-head
//! products run one per rayon task instead).

use std::borrow::Cow;

use gemm::Parallelism;
use rayon::prelude::*;

use super::{expect_len, CpuBackend};
use crate::backend::{Accumulate, Epilogue, MatmulOps, MatmulShape, Operand, Transpose};
use crate::tensor::{BufRef, View, ViewMut};
use crate::Result;

const OP: &str = "matmul";

/// Below this many multiply-adds a product runs on one thread.
const PARALLEL_FLOPS: usize = 1 << 18;

/// A strided matrix view: element `(i, j)` at `ptr + i*rs + j*cs`.
#[derive(Clone, Copy)]
pub(crate) struct StridedMat {
    pub ptr: *const f32,
    pub rs: isize,
    pub cs: isize,
}

/// Rows (or columns) per part are rounded to this, a multiple of the AVX2 and AVX-512
/// micro-kernels' tile sides (16 rows, 6 or 4 columns), so only the last part has edge tiles.
const PART_ALIGN: usize = 48;

/// `dst (=|+=) lhs · rhs` on strided views, on `threads` threads for large products.
///
/// A threaded product is split into `threads` independent single-threaded products along its
/// longer output side (rows of `lhs` or columns of `rhs`), joined once: every output element
/// is still one single-threaded dot product over the whole of `k` in gemm's order, and a
/// preempted thread on a busy machine delays only its own part, not a barrier per k-block as
/// in gemm's own threading.
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
    (acc, alpha): (Accumulate, f32),
    threads: usize,
) {
    let long = m.max(n);
    let parts = if m * n * k >= PARALLEL_FLOPS {
        threads.min(long.div_ceil(PART_ALIGN)).max(1)
    } else {
        1
    };
    if parts == 1 {
        // SAFETY: forwarded from the caller.
        unsafe { gemm_one((m, n, k), dst, lhs, rhs, (acc, alpha)) };
        return;
    }
    let step = long.div_ceil(parts).div_ceil(PART_ALIGN) * PART_ALIGN;
    let (d, l, r) = (SendMat(dst), SendMat(lhs), SendMat(rhs));
    (0..long.div_ceil(step)).into_par_iter().for_each(|p| {
        let (lo, hi) = (p * step, ((p + 1) * step).min(long));
        let (d, l, r) = (&d, &l, &r);
        // SAFETY: parts cover disjoint rows (or columns) of `dst`, each inside the caller's
        // views; the inputs are only read.
        unsafe {
            if m >= n {
                let (d, l) = (d.0.offset(lo, 0), l.0.offset(lo, 0));
                gemm_one((hi - lo, n, k), d, l, r.0, (acc, alpha));
            } else {
                let (d, r) = (d.0.offset(0, lo), r.0.offset(0, lo));
                gemm_one((m, hi - lo, k), d, l.0, r, (acc, alpha));
            }
        }
    });
}

/// A strided matrix shared read-only (or, for `dst`, in disjoint parts) across rayon tasks.
struct SendMat(StridedMat);
// SAFETY: `gemm_raw` hands each task a disjoint part of `dst` and only reads the inputs.
unsafe impl Send for SendMat {}
// SAFETY: as above.
unsafe impl Sync for SendMat {}

impl StridedMat {
    /// The view starting at element `(i, j)`.
    fn offset(self, i: usize, j: usize) -> Self {
        let off = i as isize * self.rs + j as isize * self.cs;
        Self {
            ptr: self.ptr.wrapping_offset(off),
            ..self
        }
    }
}

/// One single-threaded product; see [`gemm_raw`] for the contract.
unsafe fn gemm_one(
    (m, n, k): (usize, usize, usize),
    dst: StridedMat,
    lhs: StridedMat,
    rhs: StridedMat,
    (acc, alpha): (Accumulate, f32),
) {
    let read_dst = acc == Accumulate::Add;
    // SAFETY: the caller guarantees the views; gemm computes dst = 1·dst + alpha·lhs·rhs.
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
            alpha,
            false,
            false,
            false,
            Parallelism::None,
        )
    }
}

/// A matrix operand as host f32, widening bf16/f16 exactly (every half value is an f32).
fn operand<'a>(what: &str, v: View<'a>) -> Result<Cow<'a, [f32]>> {
    use half::slice::HalfFloatSliceExt;
    match v {
        View::Host(BufRef::F32(s)) => Ok(Cow::Borrowed(s)),
        View::Host(BufRef::Bf16(s)) => Ok(Cow::Owned(s.to_f32_vec())),
        View::Host(BufRef::F16(s)) => Ok(Cow::Owned(s.to_f32_vec())),
        View::Cuda(_) | View::Meta(_) => Err(super::foreign("matmul", what)),
    }
}

impl CpuBackend {
    /// `c (=|+=) op(a) · op(b)` on host f32 slices.
    pub(super) fn matmul_host(
        &self,
        s: MatmulShape,
        a: &[f32],
        b: &[f32],
        c: &mut [f32],
        acc: Accumulate,
    ) -> Result<()> {
        self.matmul_host_scaled(s, (a, b), c, acc, 1.0)
    }

    /// `c (=|+=) alpha · op(a) · op(b)` on host f32 slices.
    fn matmul_host_scaled(
        &self,
        s: MatmulShape,
        (a, b): (&[f32], &[f32]),
        c: &mut [f32],
        acc: Accumulate,
        alpha: f32,
    ) -> Result<()> {
        crate::backend::check::matmul(s, a.len(), b.len(), c.len())?;
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
                (acc, alpha),
                rayon::current_num_threads(),
            );
        }
        Ok(())
    }

    /// Fills every row of `c` with `bias`, so that an accumulating product adds `A·B` to it.
    fn broadcast_bias(&self, bias: View<'_>, c: &mut [f32], n: usize) -> Result<()> {
        let bias = super::f32_in("matmul", "bias", bias)?;
        expect_len(OP, "bias", bias.len(), n)?;
        c.par_chunks_mut(n.max(1))
            .for_each(|r| r.copy_from_slice(bias));
        Ok(())
    }
}

impl MatmulOps for CpuBackend {
    fn matmul(
        &self,
        s: MatmulShape,
        a: View<'_>,
        b: View<'_>,
        c: ViewMut<'_>,
        epilogue: Epilogue<'_>,
    ) -> Result<()> {
        let (a, b) = (operand("A", a)?, operand("B", b)?);
        let c = super::f32_out("matmul", "C", c)?;
        match epilogue {
            Epilogue::Store => self.matmul_host(s, &a, &b, c, Accumulate::Overwrite),
            Epilogue::Accumulate => self.matmul_host(s, &a, &b, c, Accumulate::Add),
            Epilogue::ScaledAccumulate(alpha) => {
                self.matmul_host_scaled(s, (&a, &b), c, Accumulate::Add, alpha)
            }
            Epilogue::Bias(bias) => {
                expect_len(OP, "C", c.len(), s.m * s.n)?;
                self.broadcast_bias(bias, c, s.n)?;
                self.matmul_host(s, &a, &b, c, Accumulate::Add)
            }
            Epilogue::BiasGelu { bias, pre } => {
                let pre = super::f32_out("matmul", "pre-activation", pre)?;
                expect_len(OP, "pre-activation", pre.len(), s.m * s.n)?;
                self.broadcast_bias(bias, pre, s.n)?;
                self.matmul_host(s, &a, &b, pre, Accumulate::Add)?;
                use crate::backend::ElementwiseOps;
                self.gelu_forward(View::from(&*pre), ViewMut::from(c))
            }
            Epilogue::AccumulateBiasGrad { of, bias_grad } => {
                let len = s.bias_grad_len(of)?;
                expect_len(OP, "bias gradient", bias_grad.len(), len)?;
                self.matmul_host(s, &a, &b, c, Accumulate::Add)?;
                // The same column sums of the same operand as a separate `sum_rows` call.
                let grad: &[f32] = if of == Operand::A { &a } else { &b };
                use crate::backend::ElementwiseOps;
                self.sum_rows(View::from(grad), len, bias_grad)
            }
            Epilogue::GeluBackwardBiasGrad { pre, bias_grad } => {
                self.gelu_backward_bias_grad(s, &a, &b, c, pre, bias_grad)
            }
            Epilogue::Residual { residual, bias } => {
                expect_len(OP, "C", c.len(), s.m * s.n)?;
                expect_len(OP, "residual", residual.len(), s.m * s.n)?;
                use crate::backend::ElementwiseOps;
                match bias {
                    Some(bias) => {
                        self.broadcast_bias(bias, c, s.n)?;
                        self.matmul_host(s, &a, &b, c, Accumulate::Add)?;
                        self.add_assign(ViewMut::from(c), residual)
                    }
                    None => {
                        c.copy_from_slice(super::f32_in("matmul", "residual", residual)?);
                        self.matmul_host(s, &a, &b, c, Accumulate::Add)
                    }
                }
            }
        }
    }
}

impl CpuBackend {
    /// `c = (a·b) ⊙ gelu'(pre)` and `bias_grad += Σ_rows c`, exactly as a product into a
    /// scratch, `gelu_backward` and `sum_rows` in turn.
    fn gelu_backward_bias_grad(
        &self,
        s: MatmulShape,
        a: &[f32],
        b: &[f32],
        c: &mut [f32],
        pre: View<'_>,
        bias_grad: ViewMut<'_>,
    ) -> Result<()> {
        use crate::backend::{ElementwiseOps, MemoryOps};
        expect_len(OP, "pre-activation", pre.len(), s.m * s.n)?;
        expect_len(OP, "bias gradient", bias_grad.len(), s.n)?;
        let mut scratch = self.buffer_uninit(crate::tensor::DType::F32, s.m * s.n)?;
        let product = super::f32_out("matmul", "product", scratch.view_mut())?;
        self.matmul_host(s, a, b, product, Accumulate::Overwrite)?;
        self.gelu_backward(pre, scratch.view(), ViewMut::from(&mut *c))?;
        self.recycle(scratch);
        self.sum_rows(View::from(&*c), s.n, bias_grad)
    }
}
