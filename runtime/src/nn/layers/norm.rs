//! The normalisations over the residual stream: LayerNorm (GPT-2) and RMSNorm (Llama), each
//! plain or fused with the residual connection before it and the gradient around it.

use crate::backend::Backend;
use crate::nn::saved::saved_struct;
use crate::nn::{stats, Grads, Params};
use crate::tensor::{Storage, View, ViewMut};
use crate::Result;

/// A norm over the last dimension: LayerNorm when it has a bias (a shift), else RMSNorm.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Norm {
    /// The scale's index in the unit's `Params`.
    pub weight: usize,
    /// The shift's index: LayerNorm's.
    pub bias: Option<usize>,
    /// Epsilon.
    pub eps: f32,
}

saved_struct!(
    /// A norm's per-row f32 statistics: LayerNorm's mean (RMSNorm has none) and the
    /// reciprocal std.
    NormStats { mean: Option<Storage>, rstd: Storage }
);

impl Norm {
    /// Zeroed statistics for `rows` rows.
    pub(crate) fn stats(&self, be: &dyn Backend, rows: usize) -> Result<NormStats> {
        let mean = self.bias.map(|_| stats(be, rows)).transpose()?;
        let rstd = stats(be, rows)?;
        Ok(NormStats { mean, rstd })
    }

    /// `y = norm(x)`, its statistics written to `st`.
    pub(crate) fn forward(
        &self,
        be: &dyn Backend,
        p: &Params<'_>,
        x: View<'_>,
        y: ViewMut<'_>,
        st: &mut NormStats,
    ) -> Result<()> {
        let (w, eps, rstd) = (p.get(self.weight), self.eps, st.rstd.view_mut());
        match (self.bias, st.mean.as_mut()) {
            (Some(b), Some(mean)) => {
                be.layernorm_forward(x, w, p.get(b), eps, y, mean.view_mut(), rstd)
            }
            _ => be.rmsnorm_forward(x, w, eps, y, rstd),
        }
    }

    /// `sum = x (+ residual)` and `y = norm(sum)` in one pass over the residual stream.
    pub(crate) fn residual_forward(
        &self,
        be: &dyn Backend,
        p: &Params<'_>,
        (x, residual): (View<'_>, Option<View<'_>>),
        (sum, y): (ViewMut<'_>, ViewMut<'_>),
        st: &mut NormStats,
    ) -> Result<()> {
        let (w, eps, rstd) = (p.get(self.weight), self.eps, st.rstd.view_mut());
        match (self.bias, st.mean.as_mut()) {
            (Some(b), Some(mean)) => {
                let (b, stats) = (p.get(b), (mean.view_mut(), rstd));
                be.residual_layernorm_forward(x, residual, w, b, eps, sum, y, stats)
            }
            _ => be.residual_rmsnorm_forward(x, residual, w, eps, sum, y, rstd),
        }
    }

    /// `dx` = the norm's input gradient for `dy`, plus `dresidual` (the gradient that
    /// reached the residual stream around the norm) when given; the weights' gradients added.
    pub(crate) fn backward(
        &self,
        be: &dyn Backend,
        (p, gr): (&Params<'_>, &mut Grads<'_>),
        (x, st): (View<'_>, &NormStats),
        (dy, dresidual): (View<'_>, Option<View<'_>>),
        dx: ViewMut<'_>,
    ) -> Result<()> {
        let (w, rstd) = (p.get(self.weight), st.rstd.view());
        // A frozen weight's gradient lands in a scratch the kernels fill beside the input
        // gradient (a norm's parameters are one row: the scratch is small).
        let (mut sw, mut sb) = (None, None);
        let r = match (self.bias, st.mean.as_ref(), dresidual) {
            (Some(b), Some(mean), dres) => {
                let (dw, db) = gr.pair_mut(self.weight, b);
                let dw = or_scratch(be, dw, w.len(), &mut sw)?;
                let db = or_scratch(be, db, w.len(), &mut sb)?;
                match dres {
                    Some(r) => {
                        let stats = (mean.view(), rstd);
                        be.layernorm_backward_residual(x, w, stats, dy, r, dx, dw, db)
                    }
                    None => be.layernorm_backward(x, w, mean.view(), rstd, dy, dx, dw, db),
                }
            }
            (_, _, Some(r)) => {
                let dw = or_scratch(be, gr.get_mut(self.weight), w.len(), &mut sw)?;
                be.rmsnorm_backward_residual(x, w, rstd, dy, r, dx, dw)
            }
            _ => {
                let dw = or_scratch(be, gr.get_mut(self.weight), w.len(), &mut sw)?;
                be.rmsnorm_backward(x, w, rstd, dy, dx, dw)
            }
        };
        sw.into_iter().chain(sb).for_each(|s| be.recycle(s));
        r
    }
}

/// The gradient view `g`, or (for a frozen parameter) a zeroed f32 scratch of `len` kept in
/// `slot` until the caller recycles it.
fn or_scratch<'a>(
    be: &dyn Backend,
    g: Option<ViewMut<'a>>,
    len: usize,
    slot: &'a mut Option<crate::tensor::Storage>,
) -> Result<ViewMut<'a>> {
    match g {
        Some(v) => Ok(v),
        None => Ok(slot
            .insert(be.buffer(crate::tensor::DType::F32, len)?)
            .view_mut()),
    }
}
