//! Dense (affine) layers over engine-owned weight views, in both Hugging Face layouts.

use rayon::prelude::*;

use crate::backend::{Accumulate, Backend, MatmulShape, Transpose};
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
    /// `y[rows, d_out] = x · W (+ bias)`.
    pub fn forward(
        &self,
        be: &dyn Backend,
        x: &[f32],
        w: &[f32],
        bias: Option<&[f32]>,
        y: &mut [f32],
    ) -> Result<()> {
        let rows = x.len() / self.d_in;
        let acc = match bias {
            Some(b) => {
                y.par_chunks_mut(self.d_out)
                    .for_each(|r| r.copy_from_slice(b));
                Accumulate::Add
            }
            None => Accumulate::Overwrite,
        };
        let tb = match self.layout {
            WeightLayout::InOut => Transpose::No,
            WeightLayout::OutIn => Transpose::Yes,
        };
        let shape = MatmulShape {
            m: rows,
            n: self.d_out,
            k: self.d_in,
            ta: Transpose::No,
            tb,
        };
        be.matmul(shape, x, w, y, acc)
    }

    /// `y += x · W`: fuses a residual connection into the product.
    pub fn forward_add(&self, be: &dyn Backend, x: &[f32], w: &[f32], y: &mut [f32]) -> Result<()> {
        let rows = x.len() / self.d_in;
        let tb = match self.layout {
            WeightLayout::InOut => Transpose::No,
            WeightLayout::OutIn => Transpose::Yes,
        };
        let shape = MatmulShape {
            m: rows,
            n: self.d_out,
            k: self.d_in,
            ta: Transpose::No,
            tb,
        };
        be.matmul(shape, x, w, y, Accumulate::Add)
    }

    /// `dx (=|+=) dy · Wᵀ` (in the layout's terms).
    pub fn backward_input(
        &self,
        be: &dyn Backend,
        dy: &[f32],
        w: &[f32],
        dx: &mut [f32],
        acc: Accumulate,
    ) -> Result<()> {
        let rows = dy.len() / self.d_out;
        let tb = match self.layout {
            WeightLayout::InOut => Transpose::Yes,
            WeightLayout::OutIn => Transpose::No,
        };
        let shape = MatmulShape {
            m: rows,
            n: self.d_in,
            k: self.d_out,
            ta: Transpose::No,
            tb,
        };
        be.matmul(shape, dy, w, dx, acc)
    }

    /// `dW += xᵀ · dy` (stored in the layout) and `db += Σ_rows dy`.
    pub fn backward_params(
        &self,
        be: &dyn Backend,
        x: &[f32],
        dy: &[f32],
        dw: &mut [f32],
        db: Option<&mut [f32]>,
    ) -> Result<()> {
        let rows = x.len() / self.d_in;
        let shape = match self.layout {
            WeightLayout::InOut => (self.d_in, self.d_out, x, dy),
            WeightLayout::OutIn => (self.d_out, self.d_in, dy, x),
        };
        let (m, n, a, b) = shape;
        let s = MatmulShape {
            m,
            n,
            k: rows,
            ta: Transpose::Yes,
            tb: Transpose::No,
        };
        be.matmul(s, a, b, dw, Accumulate::Add)?;
        if let Some(db) = db {
            column_sums(dy, self.d_out, db);
        }
        Ok(())
    }
}

/// `acc[j] += Σ_i m[i, j]`, parallel over column blocks and serial over rows (fixed order).
pub fn column_sums(m: &[f32], cols: usize, acc: &mut [f32]) {
    const BLOCK: usize = 64;
    acc.par_chunks_mut(BLOCK).enumerate().for_each(|(c, a)| {
        let j0 = c * BLOCK;
        for row in m.chunks(cols) {
            let w = a.len();
            a.iter_mut()
                .zip(&row[j0..j0 + w])
                .for_each(|(a, v)| *a += v);
        }
    });
}
