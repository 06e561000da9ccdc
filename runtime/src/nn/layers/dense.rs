//! A linear layer bound to its unit's parameters: [`Linear`]'s products with the weight (and
//! bias) read from the unit's views and their gradients written to its accumulators, and a
//! LoRA adapter's branch beside them when the layer has one.
//!
//! Every method takes `drop`, the batch's [`Draw`] in training (`None` in inference): only
//! an adapter's input dropout reads it. A GELU fused into a product (forward's bias+GELU,
//! backward's DGELU) runs apart when an adapter's branch must be added before the GELU.

use super::lora::Draw;
use super::Lora;
use crate::backend::{Accumulate, Backend, Epilogue};
use crate::nn::linear::Linear;
use crate::nn::{act, Grads, Params};
use crate::tensor::{View, ViewMut};
use crate::{Error, Result};

/// `y = x · W (+ b) (+ scale · B(A x))` with `W`, `b`, `A` and `B` at fixed indices of the
/// unit's parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dense {
    /// Dimensions and weight layout.
    pub lin: Linear,
    /// The weight's index.
    pub weight: usize,
    /// The bias's index, if any.
    pub bias: Option<usize>,
    /// The LoRA adapter on this layer, if any.
    pub lora: Option<Lora>,
}

impl Dense {
    fn bias<'a>(&self, p: &Params<'a>) -> Option<View<'a>> {
        self.bias.map(|b| p.get(b))
    }

    /// `y = x · W (+ b)`, and `+ residual` written by the product itself when given.
    pub fn forward(
        &self,
        be: &dyn Backend,
        p: &Params<'_>,
        (x, residual): (View<'_>, Option<View<'_>>),
        mut y: ViewMut<'_>,
        drop: Option<Draw>,
    ) -> Result<()> {
        let (w, bias) = (p.get(self.weight), self.bias(p));
        match residual {
            Some(residual) => {
                let epilogue = Epilogue::Residual { residual, bias };
                self.lin.product(be, x, w, y.reborrow(), epilogue)?
            }
            None => self.lin.forward(be, x, w, bias, y.reborrow())?,
        }
        match &self.lora {
            Some(l) => l.forward(be, p, x, y, drop),
            None => Ok(()),
        }
    }

    /// `pre = x · W + b` and `y = gelu_tanh(pre)` in one call; the layer needs its bias.
    /// With an adapter, `pre` gains its branch before the GELU, which then runs apart.
    pub fn forward_gelu(
        &self,
        be: &dyn Backend,
        p: &Params<'_>,
        x: View<'_>,
        (mut pre, y): (ViewMut<'_>, ViewMut<'_>),
        drop: Option<Draw>,
    ) -> Result<()> {
        let bias = p.get(needs_bias(self.bias)?);
        let Some(l) = &self.lora else {
            let epilogue = Epilogue::BiasGelu { bias, pre };
            return self.lin.product(be, x, p.get(self.weight), y, epilogue);
        };
        let w = p.get(self.weight);
        self.lin.forward(be, x, w, Some(bias), pre.reborrow())?;
        l.forward(be, p, x, pre.reborrow(), drop)?;
        be.gelu_forward(pre.as_view(), y)
    }

    /// `dx (=|+=) dy · Wᵀ` (and the adapter branch's input gradient).
    pub fn backward_input(
        &self,
        be: &dyn Backend,
        p: &Params<'_>,
        dy: View<'_>,
        (mut dx, acc): (ViewMut<'_>, Accumulate),
        drop: Option<Draw>,
    ) -> Result<()> {
        let w = p.get(self.weight);
        self.lin.backward_input(be, dy, w, dx.reborrow(), acc)?;
        match &self.lora {
            Some(l) => l.backward_input(be, p, dy, dx, drop),
            None => Ok(()),
        }
    }

    /// `dx = (dy · Wᵀ) ⊙ gelu_tanh'(pre)`: the input gradient of `gelu(pre)` fed to this
    /// layer, through the GELU, and the gradient of `before`'s bias (the layer that produced
    /// `pre`) added from the same product (cuBLASLt's DGELU_BGRAD). With an adapter, its
    /// branch's gradient joins the product's before the GELU, which then runs apart.
    pub fn backward_input_gelu(
        &self,
        be: &dyn Backend,
        (p, gr): (&Params<'_>, &mut Grads<'_>),
        before: &Dense,
        (dy, pre): (View<'_>, View<'_>),
        (mut dx, drop): (ViewMut<'_>, Option<Draw>),
    ) -> Result<()> {
        let bias_grad = gr.get_mut(needs_bias(before.bias)?);
        let w = p.get(self.weight);
        match (&self.lora, bias_grad) {
            (None, Some(bias_grad)) => {
                let epilogue = Epilogue::GeluBackwardBiasGrad { pre, bias_grad };
                self.lin.input_product(be, dy, w, dx, epilogue)
            }
            // An adapter's gradient joins the product's before the GELU, and a frozen bias
            // wants no gradient: the GELU runs apart.
            (lora, bias_grad) => {
                let mut dg = act(be, dx.len())?;
                self.lin
                    .backward_input(be, dy, w, dg.view_mut(), Accumulate::Overwrite)?;
                if let Some(l) = lora {
                    l.backward_input(be, p, dy, dg.view_mut(), drop)?;
                }
                be.gelu_backward(pre, dg.view(), dx.reborrow())?;
                be.recycle(dg);
                match bias_grad {
                    Some(db) => be.sum_rows(dx.as_view(), before.lin.d_out, db),
                    None => Ok(()),
                }
            }
        }
    }

    /// `dW += xᵀ · dy`, with a bias `db += Σ dy`, and the adapter's `dA` and `dB`.
    pub fn backward_params(
        &self,
        be: &dyn Backend,
        (p, gr): (&Params<'_>, &mut Grads<'_>),
        (x, dy): (View<'_>, View<'_>),
        drop: Option<Draw>,
    ) -> Result<()> {
        self.base_params(be, gr, x, dy)?;
        match &self.lora {
            Some(l) => l.backward_params(be, (p, gr), x, dy, drop),
            None => Ok(()),
        }
    }

    fn base_params(
        &self,
        be: &dyn Backend,
        gr: &mut Grads<'_>,
        x: View<'_>,
        dy: View<'_>,
    ) -> Result<()> {
        let (dw, db) = match self.bias {
            Some(b) => gr.pair_mut(self.weight, b),
            None => (gr.get_mut(self.weight), None),
        };
        // A frozen weight's gradient never materialises: its product is skipped.
        match (dw, db) {
            (Some(dw), db) => self.lin.backward_params(be, x, dy, dw, db),
            (None, Some(db)) => be.sum_rows(dy, self.lin.d_out, db),
            (None, None) => Ok(()),
        }
    }
}

/// A GELU fused into a product needs the bias of the layer before it.
fn needs_bias(bias: Option<usize>) -> Result<usize> {
    bias.ok_or_else(|| Error::Invalid("a GELU fused into a product needs its bias".into()))
}
