//! Row-major matrix products through cuBLASLt's column-major GEMM.
//!
//! A row-major `C[m, n]` is the column-major `Cᵀ` (`n × m`, leading dimension `n`), so
//! `C = op(A) · op(B)` is computed as `Cᵀ = op(B)ᵀ · op(A)ᵀ`: cuBLASLt's `m' = n`, `n' = m`,
//! `k' = k`, its A is our B and its B our A. A row-major operand stored `[r, c]` is the
//! column-major `[c, r]` with leading dimension `c`; when our operand is used as stored, its
//! column-major transpose is exactly what the swapped product needs (`Op::N`), and when it is
//! used transposed, cuBLASLt transposes it back (`Op::T`). Biases (length `n`, one per output
//! column) are cuBLASLt's per-row bias of `Cᵀ`.

use super::backend::{expect_dtype, expect_len, CudaBackend};
use super::device::STREAM;
use super::driver::{Epilogue as LtEpilogue, Gemm, Op};
use super::launch::Args;
use super::storage::{by_dtype, CudaBuf, CudaView, CudaViewMut};
use crate::backend::{ElementwiseOps, Epilogue, MatmulOps, MatmulShape, Operand, Transpose};
use crate::tensor::{DType, View, ViewMut};
use crate::Result;

const OP: &str = "matmul";

/// Elements between consecutive rows of each row-major operand as stored (at least the
/// stored row's length): what cuBLASLt calls the leading dimensions of the swapped product.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RowStrides {
    /// A's (`[m, k]`, or `[k, m]` used transposed).
    pub a: usize,
    /// B's (`[k, n]`, or `[n, k]` used transposed).
    pub b: usize,
    /// C's (`[m, n]`).
    pub c: usize,
}

impl RowStrides {
    /// Densely packed operands: each row stride is the stored row's length.
    pub(crate) fn packed(s: MatmulShape) -> Self {
        RowStrides {
            a: if s.ta == Transpose::No { s.k } else { s.m },
            b: if s.tb == Transpose::No { s.n } else { s.k },
            c: s.n,
        }
    }
}

/// cuBLASLt's description of `C (=|+=) op(A) · op(B)` for row-major operands with the given
/// row strides (`RowStrides::packed` for dense ones): a row-major operand stored `[r, c]` with
/// row stride `ld` is the column-major `[c, r]` with leading dimension `ld`, whether used as
/// stored (`Op::N`) or transposed back (`Op::T`). Our B becomes cuBLASLt's A, our A its B.
fn gemm_strided(
    s: MatmulShape,
    a: CudaView<'_>,
    b: CudaView<'_>,
    c: super::driver::DevPtr,
    c_type: crate::tensor::DType,
    ld: RowStrides,
) -> Gemm {
    let op = |t: Transpose| if t == Transpose::No { Op::N } else { Op::T };
    let mut g = Gemm::new(
        op(s.tb),
        op(s.ta),
        s.n as u64,
        s.m as u64,
        s.k as u64,
        b.ptr(),
        ld.b.max(1) as u64,
        a.ptr(),
        ld.a.max(1) as u64,
        c,
        ld.c.max(1) as u64,
        a.dtype(),
    );
    g.c_type = c_type;
    g
}

/// Fails unless a view of `len` elements holds `rows` rows of `cols` elements `ld` apart.
fn expect_rows(what: &str, len: usize, rows: usize, cols: usize, ld: usize) -> Result<()> {
    let need = if rows == 0 { 0 } else { (rows - 1) * ld + cols };
    if ld < cols || len < need {
        return Err(crate::Error::Invalid(format!(
            "{OP}: {what} holds {len} elements; {rows} rows of {cols} with row stride {ld} \
             need a stride of at least {cols} and {need} elements"
        )));
    }
    Ok(())
}

impl MatmulOps for CudaBackend {
    fn matmul(
        &self,
        s: MatmulShape,
        a: View<'_>,
        b: View<'_>,
        c: ViewMut<'_>,
        epilogue: Epilogue<'_>,
    ) -> Result<()> {
        let (a, b) = (self.dev_in(OP, "A", a)?, self.dev_in(OP, "B", b)?);
        let c = self.dev_out(OP, "C", c)?;
        crate::backend::check::matmul(s, a.len(), b.len(), c.len())?;
        expect_dtype(OP, a.dtype(), &[("B", b.dtype())])?;
        // Before the empty-product exits: a bias gradient can be due when dW has no elements.
        if let Epilogue::AccumulateBiasGrad { of, bias_grad } = epilogue {
            return self.accumulate_bias_grad(s, (a, b, c), of, bias_grad);
        }
        if s.m == 0 || s.n == 0 {
            return Ok(());
        }
        if s.k == 0 {
            // cuBLASLt rejects k = 0; the product is all zeros.
            return match epilogue {
                Epilogue::Accumulate | Epilogue::ScaledAccumulate(_) => Ok(()),
                _ => self.fill_product_of_nothing(c, epilogue),
            };
        }
        let mut g = gemm_strided(s, a, b, c.ptr(), c.dtype(), RowStrides::packed(s));
        match epilogue {
            Epilogue::AccumulateBiasGrad { of, bias_grad } => {
                return self.accumulate_bias_grad(s, (a, b, c), of, bias_grad);
            }
            Epilogue::GeluBackwardBiasGrad { pre, bias_grad } => {
                return self.gelu_backward_bias_grad(s, g, c, pre, bias_grad);
            }
            Epilogue::Store => {}
            Epilogue::Accumulate => g.beta = 1.0,
            Epilogue::ScaledAccumulate(alpha) => (g.alpha, g.beta) = (alpha, 1.0),
            Epilogue::Residual { residual, bias } => {
                let r = self.dev_in(OP, "residual", residual)?;
                expect_len(OP, "residual", r.len(), s.m * s.n)?;
                expect_dtype(OP, c.dtype(), &[("residual", r.dtype())])?;
                // Out of place: C is the residual (read with beta = 1), D the layer's output.
                (g.c, g.d, g.beta) = (r.ptr(), Some(c.ptr()), 1.0);
                if let Some(bias) = bias {
                    let bias = self.dev_in(OP, "bias", bias)?;
                    expect_len(OP, "bias", bias.len(), s.n)?;
                    expect_dtype(OP, c.dtype(), &[("bias", bias.dtype())])?;
                    g.epilogue = LtEpilogue::Bias { bias: bias.ptr() };
                }
            }
            Epilogue::Bias(bias) => {
                let bias = self.dev_in(OP, "bias", bias)?;
                expect_len(OP, "bias", bias.len(), s.n)?;
                expect_dtype(OP, c.dtype(), &[("bias", bias.dtype())])?;
                g.epilogue = LtEpilogue::Bias { bias: bias.ptr() };
            }
            Epilogue::BiasGelu { bias, pre } => {
                let bias = self.dev_in(OP, "bias", bias)?;
                let pre = self.dev_out(OP, "pre-activation", pre)?;
                expect_len(OP, "bias", bias.len(), s.n)?;
                expect_len(OP, "pre-activation", pre.len(), s.m * s.n)?;
                expect_dtype(
                    OP,
                    c.dtype(),
                    &[("bias", bias.dtype()), ("pre", pre.dtype())],
                )?;
                g.epilogue = LtEpilogue::Bias { bias: bias.ptr() };
                // cuBLASLt's aux output needs a leading dimension that is a multiple of 8 and
                // 16-byte alignment; otherwise (or when refused) the bias product and GELU run
                // separately.
                if s.n.is_multiple_of(8) && pre.ptr().0.is_multiple_of(16) {
                    let aux = LtEpilogue::GeluAuxBias {
                        bias: bias.ptr(),
                        aux: pre.ptr(),
                        aux_ld: s.n as u64,
                    };
                    if self.fused(&Gemm { epilogue: aux, ..g })? {
                        return Ok(());
                    }
                }
                g.c = pre.ptr();
                self.gemm_with_bias(g, s, c.dtype())?;
                return self.gelu_forward(View::Cuda(pre.as_view()), ViewMut::Cuda(c));
            }
        }
        self.gemm_with_bias(g, s, c.dtype())
    }
}

/// Epilogues cuBLASLt has refused in this process, so each is logged once.
static REFUSED: std::sync::Mutex<Vec<&'static str>> = std::sync::Mutex::new(Vec::new());

impl CudaBackend {
    /// Runs `g` with its fused epilogue: `Ok(false)` when cuBLASLt has no algorithm for it
    /// (nothing ran; said once per epilogue in the log, and counted in the device activity),
    /// and the caller then runs the separate kernels the epilogue replaces.
    fn fused(&self, g: &Gemm) -> Result<bool> {
        match self.dev.driver().gemm(g, STREAM) {
            Ok(()) => Ok(true),
            Err(crate::Error::GemmRefused { epilogue, detail }) => {
                let mut seen = REFUSED.lock().unwrap_or_else(|e| e.into_inner());
                if !seen.contains(&epilogue) {
                    seen.push(epilogue);
                    tracing::warn!(
                        "cuBLASLt has no algorithm for {epilogue} ({detail}); such products run \
                         as a plain product and separate kernels from now on (slower, the same \
                         values to rounding), counted as gemm_fallbacks_per_step"
                    );
                }
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    /// `g`, whose epilogue is none or a bias over the row-major `[s.m, s.n]` output: fused when
    /// cuBLASLt can, else the plain product and then the bias added to every row.
    fn gemm_with_bias(&self, g: Gemm, s: MatmulShape, dtype: DType) -> Result<()> {
        let LtEpilogue::Bias { bias } = g.epilogue else {
            return self.dev.driver().gemm(&g, STREAM);
        };
        if self.fused(&g)? {
            return Ok(());
        }
        let plain = Gemm {
            epilogue: LtEpilogue::None,
            ..g
        };
        self.dev.driver().gemm(&plain, STREAM)?;
        let n = s.m * s.n;
        let mut args = Args::new()
            .ptr(plain.d.unwrap_or(plain.c))
            .ptr(bias)
            .len(s.m)
            .len(s.n);
        self.dev.launch(
            by_dtype!("add_bias_rows", dtype),
            self.dev.grid_for(n),
            &mut args,
        )
    }

    /// `C (=|+=) op(A) · op(B)` over row-major operands whose rows lie `ld` elements apart
    /// (a padded buffer's rows, e.g. the head's logits): same dtype rules as
    /// [`MatmulOps::matmul`], no epilogue; `accumulate` adds to C. Only the `[m, n]` block of C
    /// is written and only the operands' `[rows, cols]` blocks are read.
    pub(crate) fn matmul_strided(
        &self,
        s: MatmulShape,
        (a, b, c): (CudaView<'_>, CudaView<'_>, CudaViewMut<'_>),
        ld: RowStrides,
        accumulate: bool,
    ) -> Result<()> {
        let stored =
            |t: Transpose, r: usize, c: usize| if t == Transpose::No { (r, c) } else { (c, r) };
        let (ar, ac) = stored(s.ta, s.m, s.k);
        let (br, bc) = stored(s.tb, s.k, s.n);
        expect_rows("A", a.len(), ar, ac, ld.a)?;
        expect_rows("B", b.len(), br, bc, ld.b)?;
        expect_rows("C", c.len(), s.m, s.n, ld.c)?;
        expect_dtype(OP, a.dtype(), &[("B", b.dtype())])?;
        if s.m == 0 || s.n == 0 || s.k == 0 {
            return Err(crate::Error::Invalid(format!(
                "{OP}: a strided product needs m, n and k of at least 1, got {s:?}"
            )));
        }
        let mut g = gemm_strided(s, a, b, c.ptr(), c.dtype(), ld);
        if accumulate {
            g.beta = 1.0;
        }
        self.dev.driver().gemm(&g, STREAM)
    }

    /// `C += op(A)·op(B)` and the bias gradient of operand `of` in the same cuBLASLt product
    /// (BGRADA when it is our B, BGRADB when our A: the operands swap in the row-major
    /// translation). cuBLASLt overwrites its bias-gradient output while the layer accumulates
    /// over micro-steps, so it lands in a scratch that one `add_assign` adds to the gradient.
    /// Without an f32 C (cuBLASLt's vectors have C's type), or when cuBLASLt refuses the
    /// epilogue, the column sums run separately.
    fn accumulate_bias_grad(
        &self,
        s: MatmulShape,
        (a, b, c): (CudaView<'_>, CudaView<'_>, CudaViewMut<'_>),
        of: Operand,
        bias_grad: ViewMut<'_>,
    ) -> Result<()> {
        let grad = self.dev_out(OP, "bias gradient", bias_grad)?;
        let len = s.bias_grad_len(of)?;
        expect_len(OP, "bias gradient", grad.len(), len)?;
        expect_dtype(OP, DType::F32, &[("bias gradient", grad.dtype())])?;
        let operand = if of == Operand::A { a } else { b };
        if c.dtype() == DType::F32 && s.m > 0 && s.n > 0 && s.k > 0 {
            let scratch = CudaBuf::uninit(&self.dev, DType::F32, len)?;
            let mut g = gemm_strided(s, a, b, c.ptr(), c.dtype(), RowStrides::packed(s));
            g.beta = 1.0;
            let bias_grad = scratch.view().ptr();
            g.epilogue = match of {
                Operand::A => LtEpilogue::BiasGradB { bias_grad },
                Operand::B => LtEpilogue::BiasGradA { bias_grad },
            };
            if self.fused(&g)? {
                return self.add_f32(grad, &scratch);
            }
        }
        self.matmul(
            s,
            View::Cuda(a),
            View::Cuda(b),
            ViewMut::Cuda(c),
            Epilogue::Accumulate,
        )?;
        self.sum_rows(View::Cuda(operand), len, ViewMut::Cuda(grad))
    }

    /// `C = op(A)·op(B) ⊙ gelu'(pre)` and `bias_grad += Σ_rows C`: cuBLASLt's DGELU_BGRAD,
    /// its (overwritten) bias gradient in C's type in a scratch added to the f32 gradient (a
    /// bf16 C rounds each micro-step's bias gradient to bf16 once, as the engine rounds every
    /// gradient it accumulates in bf16), when [`CudaBackend::with_fused_dgelu`] asked for it.
    /// Otherwise, or where cuBLASLt's aux layout rules fail or it refuses the epilogue, the
    /// product, the GELU gradient and the column sums run separately.
    fn gelu_backward_bias_grad(
        &self,
        s: MatmulShape,
        mut g: Gemm,
        mut c: CudaViewMut<'_>,
        pre: View<'_>,
        bias_grad: ViewMut<'_>,
    ) -> Result<()> {
        let pre = self.dev_in(OP, "pre-activation", pre)?;
        let grad = self.dev_out(OP, "bias gradient", bias_grad)?;
        expect_len(OP, "pre-activation", pre.len(), s.m * s.n)?;
        expect_len(OP, "bias gradient", grad.len(), s.n)?;
        expect_dtype(OP, c.dtype(), &[("pre-activation", pre.dtype())])?;
        expect_dtype(OP, DType::F32, &[("bias gradient", grad.dtype())])?;
        if self.fused_dgelu() && s.n.is_multiple_of(8) && pre.ptr().0.is_multiple_of(16) {
            let scratch = CudaBuf::uninit(&self.dev, c.dtype(), s.n)?;
            let dgelu = LtEpilogue::DGeluBiasGrad {
                aux: pre.ptr(),
                aux_ld: s.n as u64,
                bias_grad: scratch.view().ptr(),
            };
            if self.fused(&Gemm {
                epilogue: dgelu,
                ..g
            })? {
                if scratch.dtype() == DType::F32 {
                    return self.add_f32(grad, &scratch);
                }
                let mut wide = CudaBuf::uninit(&self.dev, DType::F32, s.n)?;
                scratch.cast_into(&mut wide)?;
                return self.add_f32(grad, &wide);
            }
        }
        let product = CudaBuf::uninit(&self.dev, c.dtype(), s.m * s.n)?;
        g.c = product.view().ptr();
        self.dev.driver().gemm(&g, STREAM)?;
        let dy = View::Cuda(product.view());
        self.gelu_backward(View::Cuda(pre), dy, ViewMut::Cuda(c.reborrow()))?;
        self.sum_rows(View::Cuda(c.as_view()), s.n, ViewMut::Cuda(grad))
    }

    /// `dst += src` over f32 elements of equal length (the `add_assign` kernel).
    fn add_f32(&self, dst: CudaViewMut<'_>, src: &CudaBuf) -> Result<()> {
        let mut args = Args::new()
            .ptr(dst.ptr())
            .ptr(src.view().ptr())
            .len(dst.len());
        self.dev
            .launch("add_assign_f32", self.dev.grid_for(dst.len()), &mut args)
    }

    /// `C = 0` for an empty contraction (cuBLASLt rejects `k = 0`); with a bias it is refused
    /// rather than emulated, as no layer has zero input features.
    fn fill_product_of_nothing(&self, c: CudaViewMut<'_>, epilogue: Epilogue<'_>) -> Result<()> {
        // The GELU gradient of an empty product is zero, and so its bias gradient's increment.
        if !matches!(
            epilogue,
            Epilogue::Store | Epilogue::GeluBackwardBiasGrad { .. }
        ) {
            return Err(crate::Error::Invalid(format!(
                "{OP}: an epilogue adding a bias or a residual over an empty contraction (k = 0) is \
                 not supported on CUDA"
            )));
        }
        let n = c.len();
        let mut args = Args::new().ptr(c.ptr()).len(n).f32(0.0);
        self.dev.launch(
            by_dtype!("fill", c.dtype()),
            self.dev.grid_for(n),
            &mut args,
        )
    }
}
