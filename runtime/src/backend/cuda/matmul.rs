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
use super::storage::{by_dtype, CudaView};
use crate::backend::{ElementwiseOps, Epilogue, MatmulOps, MatmulShape, Transpose};
use crate::tensor::{View, ViewMut};
use crate::Result;

const OP: &str = "matmul";

/// cuBLASLt's description of `C (=|+=) op(A) · op(B)` for row-major operands.
fn gemm(
    s: MatmulShape,
    a: CudaView<'_>,
    b: CudaView<'_>,
    c: super::driver::DevPtr,
    c_type: crate::tensor::DType,
) -> Gemm {
    let (m, n, k) = (s.m as u64, s.n as u64, s.k as u64);
    // Our B becomes cuBLASLt's A: stored [k, n] (No) is column-major [n, k] with ld n; stored
    // [n, k] (Yes) is column-major [k, n] with ld k, transposed back.
    let (transa, lda) = match s.tb {
        Transpose::No => (Op::N, n),
        Transpose::Yes => (Op::T, k),
    };
    // Our A becomes cuBLASLt's B: stored [m, k] (No) is column-major [k, m] with ld k; stored
    // [k, m] (Yes) is column-major [m, k] with ld m, transposed back.
    let (transb, ldb) = match s.ta {
        Transpose::No => (Op::N, k),
        Transpose::Yes => (Op::T, m),
    };
    let mut g = Gemm::new(
        transa,
        transb,
        n,
        m,
        k,
        b.ptr(),
        lda.max(1),
        a.ptr(),
        ldb.max(1),
        c,
        n.max(1),
        a.dtype(),
    );
    g.c_type = c_type;
    g
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
        expect_len(OP, "A", a.len(), s.m * s.k)?;
        expect_len(OP, "B", b.len(), s.k * s.n)?;
        expect_len(OP, "C", c.len(), s.m * s.n)?;
        expect_dtype(OP, a.dtype(), &[("B", b.dtype())])?;
        if s.m == 0 || s.n == 0 {
            return Ok(());
        }
        if s.k == 0 {
            // cuBLASLt rejects k = 0; the product is all zeros.
            return match epilogue {
                Epilogue::Accumulate => Ok(()),
                _ => self.fill_product_of_nothing(c, epilogue),
            };
        }
        let mut g = gemm(s, a, b, c.ptr(), c.dtype());
        match epilogue {
            Epilogue::Store => {}
            Epilogue::Accumulate => g.beta = 1.0,
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
                // cuBLASLt's aux output needs a leading dimension that is a multiple of 8 and
                // 16-byte alignment; otherwise the bias product and GELU run separately.
                if !s.n.is_multiple_of(8) || !pre.ptr().0.is_multiple_of(16) {
                    g.c = pre.ptr();
                    g.epilogue = LtEpilogue::Bias { bias: bias.ptr() };
                    self.dev.driver().gemm(&g, STREAM)?;
                    return self.gelu_forward(View::Cuda(pre.as_view()), ViewMut::Cuda(c));
                }
                g.epilogue = LtEpilogue::GeluAuxBias {
                    bias: bias.ptr(),
                    aux: pre.ptr(),
                    aux_ld: s.n as u64,
                };
            }
        }
        self.dev.driver().gemm(&g, STREAM)
    }
}

impl CudaBackend {
    /// `C = 0` for an empty contraction (cuBLASLt rejects `k = 0`); with a bias it is refused
    /// rather than emulated, as no layer has zero input features.
    fn fill_product_of_nothing(
        &self,
        c: super::storage::CudaViewMut<'_>,
        epilogue: Epilogue<'_>,
    ) -> Result<()> {
        if !matches!(epilogue, Epilogue::Store) {
            return Err(crate::Error::Invalid(format!(
                "{OP}: a bias epilogue over an empty contraction (k = 0) is not supported on CUDA"
            )));
        }
        let n = c.len();
        let mut args = super::launch::Args::new().ptr(c.ptr()).len(n).f32(0.0);
        self.dev.launch(
            by_dtype!("fill", c.dtype()),
            self.dev.grid_for(n),
            &mut args,
        )
    }
}
