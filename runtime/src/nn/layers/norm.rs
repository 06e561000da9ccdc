//! The normalisations over the residual stream: LayerNorm (GPT-2) and RMSNorm (Llama), each
//! plain or fused with the residual connection before it and the gradient around it.

use crate::backend::{Backend, MemoryModel};
use crate::nn::saved::saved_struct;
use crate::nn::{stats, Grads, Params};
use crate::tensor::{DType, View, ViewMut};
use crate::Result;

/// A norm's parameters (indices in the unit's `Params`) and epsilon.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Norm {
    /// LayerNorm: a weight and a bias.
    Layer {
        /// The scale's index.
        weight: usize,
        /// The shift's index.
        bias: usize,
        /// Epsilon.
        eps: f32,
    },
    /// RMSNorm: a weight.
    Rms {
        /// The scale's index.
        weight: usize,
        /// Epsilon.
        eps: f32,
    },
}

saved_struct!(
    /// A norm's per-row f32 statistics: LayerNorm's mean (RMSNorm has none) and the
    /// reciprocal std.
    NormStats { mean: Option<crate::tensor::Storage>, rstd: crate::tensor::Storage }
);

impl Norm {
    /// Zeroed statistics for `rows` rows.
    pub(crate) fn stats(&self, be: &dyn Backend, rows: usize) -> Result<NormStats> {
        let mean = match self {
            Norm::Layer { .. } => Some(stats(be, rows)?),
            Norm::Rms { .. } => None,
        };
        Ok(NormStats {
            mean,
            rstd: stats(be, rows)?,
        })
    }

    /// Bytes of [`Norm::stats`] for `rows` rows on a device described by `m`.
    pub(crate) fn stats_bytes(&self, rows: usize, m: &MemoryModel) -> usize {
        let per = m.bytes(DType::F32, rows);
        match self {
            Norm::Layer { .. } => 2 * per,
            Norm::Rms { .. } => per,
        }
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
        let rstd = st.rstd.view_mut();
        match (*self, st.mean.as_mut()) {
            (Norm::Layer { weight, bias, eps }, Some(mean)) => {
                let (w, b) = (p.get(weight), p.get(bias));
                be.layernorm_forward(x, w, b, eps, y, mean.view_mut(), rstd)
            }
            (Norm::Rms { weight, eps }, _) => be.rmsnorm_forward(x, p.get(weight), eps, y, rstd),
            (Norm::Layer { .. }, None) => Err(no_mean()),
        }
    }

    /// `sum = x (+ residual)` and `y = norm(sum)` in one pass over the residual stream.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn residual_forward(
        &self,
        be: &dyn Backend,
        p: &Params<'_>,
        (x, residual): (View<'_>, Option<View<'_>>),
        sum: ViewMut<'_>,
        y: ViewMut<'_>,
        st: &mut NormStats,
    ) -> Result<()> {
        let rstd = st.rstd.view_mut();
        match (*self, st.mean.as_mut()) {
            (Norm::Layer { weight, bias, eps }, Some(mean)) => {
                let (w, b, stats) = (p.get(weight), p.get(bias), (mean.view_mut(), rstd));
                be.residual_layernorm_forward(x, residual, w, b, eps, sum, y, stats)
            }
            (Norm::Rms { weight, eps }, _) => {
                be.residual_rmsnorm_forward(x, residual, p.get(weight), eps, sum, y, rstd)
            }
            (Norm::Layer { .. }, None) => Err(no_mean()),
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
        let rstd = st.rstd.view();
        match (*self, st.mean.as_ref(), dresidual) {
            (Norm::Layer { weight, bias, .. }, Some(mean), dres) => {
                let (w, (dw, db)) = (p.get(weight), gr.pair_mut(weight, bias));
                match dres {
                    Some(r) => {
                        let stats = (mean.view(), rstd);
                        be.layernorm_backward_residual(x, w, stats, dy, r, dx, dw, db)
                    }
                    None => be.layernorm_backward(x, w, mean.view(), rstd, dy, dx, dw, db),
                }
            }
            (Norm::Rms { weight, .. }, _, Some(r)) => {
                let (w, dw) = (p.get(weight), gr.get_mut(weight));
                be.rmsnorm_backward_residual(x, w, rstd, dy, r, dx, dw)
            }
            (Norm::Rms { weight, .. }, _, None) => {
                be.rmsnorm_backward(x, p.get(weight), rstd, dy, dx, gr.get_mut(weight))
            }
            (Norm::Layer { .. }, None, _) => Err(no_mean()),
        }
    }
}

/// Statistics made by [`Norm::stats`] for another norm.
fn no_mean() -> crate::Error {
    crate::Error::Invalid("a LayerNorm's statistics lack the mean".into())
}
