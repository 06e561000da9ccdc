//! The feed-forward half of a block: GPT-2's GELU MLP or Llama's SwiGLU. The down projection,
//! which writes the residual stream, is the block's to run (with the residual and dropout);
//! the MLP runs everything before it in forward and after it in backward.

use super::lora::Draw;
use super::Dense;
use crate::backend::{Accumulate, Backend};
use crate::nn::saved::{saved_struct, Held};
use crate::nn::{act, Grads, Params};
use crate::tensor::{Storage, View};
use crate::{Error, Result};

/// A feed-forward layer.
#[derive(Debug, Clone, PartialEq)]
pub enum Mlp {
    /// `proj(gelu_tanh(fc(x)))`; `fc` has a bias (its gradient comes from `proj`'s product).
    Gelu {
        /// The up projection (`c_fc`).
        fc: Dense,
        /// The down projection (`c_proj`).
        proj: Dense,
    },
    /// `down(silu(gate(x)) ⊙ up(x))`.
    SwiGlu {
        /// `gate_proj`.
        gate: Dense,
        /// `up_proj`.
        up: Dense,
        /// `down_proj`.
        down: Dense,
    },
}

saved_struct!(
    /// The hidden activations forward keeps, the down projection's input last (GELU: the
    /// pre-activation and its GELU; SwiGLU: gate, up and their product).
    MlpActs { bufs: Vec<Storage> }
);

impl MlpActs {
    /// The down projection's input.
    pub(crate) fn down_input(&self) -> View<'_> {
        self.bufs[self.bufs.len() - 1].view()
    }
}

impl Mlp {
    /// The down projection, back to the residual stream's width.
    pub fn down(&self) -> &Dense {
        match self {
            Mlp::Gelu { proj, .. } => proj,
            Mlp::SwiGlu { down, .. } => down,
        }
    }

    /// The hidden width.
    fn inner(&self) -> usize {
        self.down().lin.d_in
    }

    /// Everything before the down projection.
    pub(crate) fn forward(
        &self,
        be: &dyn Backend,
        p: &Params<'_>,
        x: View<'_>,
        drop: Option<Draw>,
    ) -> Result<MlpActs> {
        let n = x.len() / self.down().lin.d_out.max(1) * self.inner();
        let bufs = match self {
            Mlp::Gelu { fc, .. } => {
                let (mut h, mut g) = (act(be, n)?, act(be, n)?);
                fc.forward_gelu(be, p, x, (h.view_mut(), g.view_mut()), drop)?;
                vec![h, g]
            }
            Mlp::SwiGlu { gate, up, .. } => {
                let (mut g, mut u) = (act(be, n)?, act(be, n)?);
                gate.forward(be, p, (x, None), g.view_mut(), drop)?;
                up.forward(be, p, (x, None), u.view_mut(), drop)?;
                let mut y = act(be, n)?;
                be.swiglu_forward(g.view(), u.view(), y.view_mut())?;
                vec![g, u, y]
            }
        };
        Ok(MlpActs { bufs })
    }

    /// The down projection's backward from `dy` (its parameters' gradients added), and on
    /// to the gradients at the up projections' outputs.
    pub(crate) fn backward_down(
        &self,
        be: &dyn Backend,
        (p, gr): (&Params<'_>, &mut Grads<'_>),
        s: &MlpActs,
        (dy, drop): (View<'_>, Option<Draw>),
    ) -> Result<Vec<Storage>> {
        let n = s.bufs[0].len();
        match self {
            Mlp::Gelu { fc, proj } => {
                // Through the GELU inside the product, with fc's bias gradient.
                let mut dh = act(be, n)?;
                let pre = s.bufs[0].view();
                proj.backward_input_gelu(be, (p, gr), fc, (dy, pre), (dh.view_mut(), drop))?;
                proj.backward_params(be, (p, gr), (s.down_input(), dy), drop)?;
                Ok(vec![dh])
            }
            Mlp::SwiGlu { down, .. } => {
                let mut dact = act(be, n)?;
                down.backward_input(be, p, dy, (dact.view_mut(), Accumulate::Overwrite), drop)?;
                down.backward_params(be, (p, gr), (s.down_input(), dy), drop)?;
                let (mut dgate, mut dup) = (act(be, n)?, act(be, n)?);
                let (g, u) = (s.bufs[0].view(), s.bufs[1].view());
                be.swiglu_backward(g, u, dact.view(), dgate.view_mut(), dup.view_mut())?;
                be.recycle(dact);
                Ok(vec![dgate, dup])
            }
        }
    }

    /// The up projections' backward from `inner` ([`Mlp::backward_down`]'s gradients, handed
    /// back here): the gradient of the input `x` forward saw.
    pub(crate) fn backward_up(
        &self,
        be: &dyn Backend,
        (p, gr): (&Params<'_>, &mut Grads<'_>),
        (x, drop): (View<'_>, Option<Draw>),
        inner: Vec<Storage>,
    ) -> Result<Storage> {
        let mut dx = act(be, x.len())?;
        match (self, inner.as_slice()) {
            (Mlp::Gelu { fc, .. }, [dh]) => {
                fc.backward_input(
                    be,
                    p,
                    dh.view(),
                    (dx.view_mut(), Accumulate::Overwrite),
                    drop,
                )?;
                // fc's bias gradient came from proj's product, through the GELU.
                let fc = Dense { bias: None, ..*fc };
                fc.backward_params(be, (p, gr), (x, dh.view()), drop)?;
            }
            (Mlp::SwiGlu { gate, up, .. }, [dgate, dup]) => {
                let (dg, du) = (dgate.view(), dup.view());
                gate.backward_input(be, p, dg, (dx.view_mut(), Accumulate::Overwrite), drop)?;
                up.backward_input(be, p, du, (dx.view_mut(), Accumulate::Add), drop)?;
                gate.backward_params(be, (p, gr), (x, dg), drop)?;
                up.backward_params(be, (p, gr), (x, du), drop)?;
            }
            _ => {
                return Err(Error::Invalid(
                    "an MLP's backward got another's gradients".into(),
                ))
            }
        }
        inner.hand_back(be);
        Ok(dx)
    }
}
