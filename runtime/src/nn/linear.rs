//! Dense (affine) layers over engine-owned weight views, in both Hugging Face layouts.

use crate::backend::{Accumulate, Backend, Epilogue, MatmulShape, Operand, Transpose};
use crate::tensor::{View, ViewMut};
use crate::Result;

/// How a weight matrix is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightLayout {
    /// `[in, out]`: GPT-2's `Conv1D`; `y = x · W`.
    InOut,
    /// `[out, in]`: PyTorch's `nn.Linear` (Llama); `y = x · Wᵀ`.
    OutIn,
}

/// A linear map's dimensions and layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Linear {
    /// Input features.
    pub d_in: usize,
    /// Output features.
    pub d_out: usize,
    /// Weight layout.
    pub layout: WeightLayout,
}

impl Linear {
    /// The product `[rows, d_out] = x · W` for `x` of `x_len` elements.
    fn forward_shape(&self, x_len: usize) -> MatmulShape {
        MatmulShape {
            m: x_len / self.d_in.max(1),
            n: self.d_out,
            k: self.d_in,
            ta: Transpose::No,
            tb: match self.layout {
                WeightLayout::InOut => Transpose::No,
                WeightLayout::OutIn => Transpose::Yes,
            },
        }
    }

    /// `y[rows, d_out] = x · W (+ bias)`.
    pub fn forward(
        &self,
        be: &dyn Backend,
        x: View<'_>,
        w: View<'_>,
        bias: Option<View<'_>>,
        y: ViewMut<'_>,
    ) -> Result<()> {
        let epilogue = match bias {
            Some(b) => Epilogue::Bias(b),
            None => Epilogue::Store,
        };
        self.product(be, x, w, y, epilogue)
    }

    /// `y = x · W` with `epilogue` applied (a bias, a GELU, a residual: see [`Epilogue`]).
    pub fn product(
        &self,
        be: &dyn Backend,
        x: View<'_>,
        w: View<'_>,
        y: ViewMut<'_>,
        epilogue: Epilogue<'_>,
    ) -> Result<()> {
        be.matmul(self.forward_shape(x.len()), x, w, y, epilogue)
    }

    /// `dx (=|+=) dy · Wᵀ` (in the layout's terms).
    pub fn backward_input(
        &self,
        be: &dyn Backend,
        dy: View<'_>,
        w: View<'_>,
        dx: ViewMut<'_>,
        acc: Accumulate,
    ) -> Result<()> {
        let epilogue = match acc {
            Accumulate::Overwrite => Epilogue::Store,
            Accumulate::Add => Epilogue::Accumulate,
        };
        self.input_product(be, dy, w, dx, epilogue)
    }

    /// `dx = dy · Wᵀ` (in the layout's terms) with `epilogue` applied (e.g. through a GELU).
    pub fn input_product(
        &self,
        be: &dyn Backend,
        dy: View<'_>,
        w: View<'_>,
        dx: ViewMut<'_>,
        epilogue: Epilogue<'_>,
    ) -> Result<()> {
        be.matmul(self.input_grad_shape(dy.len()), dy, w, dx, epilogue)
    }

    /// The product `[rows, d_in] = dy · Wᵀ` for `dy` of `dy_len` elements.
    fn input_grad_shape(&self, dy_len: usize) -> MatmulShape {
        MatmulShape {
            m: dy_len / self.d_out.max(1),
            n: self.d_in,
            k: self.d_out,
            ta: Transpose::No,
            tb: match self.layout {
                WeightLayout::InOut => Transpose::Yes,
                WeightLayout::OutIn => Transpose::No,
            },
        }
    }

    /// `dW += xᵀ · dy` (stored in the layout) and `db += Σ_rows dy`, the bias gradient from
    /// the same product (cuBLASLt's BGRADA/BGRADB on a GPU).
    pub fn backward_params(
        &self,
        be: &dyn Backend,
        x: View<'_>,
        dy: View<'_>,
        dw: ViewMut<'_>,
        db: Option<ViewMut<'_>>,
    ) -> Result<()> {
        let rows = x.len() / self.d_in.max(1);
        // dy is the operand stored [rows, d_out]: our B in the InOut product, A in the OutIn.
        let (m, n, a, b, dy_is) = match self.layout {
            WeightLayout::InOut => (self.d_in, self.d_out, x, dy, Operand::B),
            WeightLayout::OutIn => (self.d_out, self.d_in, dy, x, Operand::A),
        };
        let s = MatmulShape {
            m,
            n,
            k: rows,
            ta: Transpose::Yes,
            tb: Transpose::No,
        };
        let epilogue = match db {
            Some(bias_grad) => Epilogue::AccumulateBiasGrad {
                of: dy_is,
                bias_grad,
            },
            None => Epilogue::Accumulate,
        };
        be.matmul(s, a, b, dw, epilogue)
    }
}
