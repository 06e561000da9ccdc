//! A linear layer bound to its unit's parameters: [`Linear`]'s products with the weight (and
//! bias) read from the unit's views and their gradients written to its accumulators.

use crate::backend::{Accumulate, Backend, Epilogue};
use crate::nn::linear::Linear;
use crate::nn::{Grads, Params};
use crate::tensor::{View, ViewMut};
use crate::{Error, Result};

/// `y = x · W (+ b)` with `W` and `b` at fixed indices of the unit's parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dense {
    /// Dimensions and weight layout.
    pub lin: Linear,
    /// The weight's index.
    pub weight: usize,
    /// The bias's index, if any.
    pub bias: Option<usize>,
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
        y: ViewMut<'_>,
    ) -> Result<()> {
        let (w, bias) = (p.get(self.weight), self.bias(p));
        match residual {
            Some(residual) => self
                .lin
                .product(be, x, w, y, Epilogue::Residual { residual, bias }),
            None => self.lin.forward(be, x, w, bias, y),
        }
    }

    /// `pre = x · W + b` and `y = gelu_tanh(pre)` in one call; the layer needs its bias.
    pub fn forward_gelu(
        &self,
        be: &dyn Backend,
        p: &Params<'_>,
        x: View<'_>,
        pre: ViewMut<'_>,
        y: ViewMut<'_>,
    ) -> Result<()> {
        let bias = p.get(needs_bias(self.bias)?);
        let epilogue = Epilogue::BiasGelu { bias, pre };
        self.lin.product(be, x, p.get(self.weight), y, epilogue)
    }

    /// `dx (=|+=) dy · Wᵀ`.
    pub fn backward_input(
        &self,
        be: &dyn Backend,
        p: &Params<'_>,
        dy: View<'_>,
        dx: ViewMut<'_>,
        acc: Accumulate,
    ) -> Result<()> {
        self.lin.backward_input(be, dy, p.get(self.weight), dx, acc)
    }

    /// `dx = (dy · Wᵀ) ⊙ gelu_tanh'(pre)`: the input gradient of `gelu(pre)` fed to this
    /// layer, through the GELU, and the gradient of `before`'s bias (the layer that produced
    /// `pre`) added from the same product (cuBLASLt's DGELU_BGRAD).
    pub fn backward_input_gelu(
        &self,
        be: &dyn Backend,
        (p, gr): (&Params<'_>, &mut Grads<'_>),
        before: &Dense,
        (dy, pre): (View<'_>, View<'_>),
        dx: ViewMut<'_>,
    ) -> Result<()> {
        let bias_grad = gr.get_mut(needs_bias(before.bias)?);
        let epilogue = Epilogue::GeluBackwardBiasGrad { pre, bias_grad };
        self.lin
            .input_product(be, dy, p.get(self.weight), dx, epilogue)
    }

    /// `dW += xᵀ · dy` and, with a bias, `db += Σ dy`.
    pub fn backward_params(
        &self,
        be: &dyn Backend,
        gr: &mut Grads<'_>,
        x: View<'_>,
        dy: View<'_>,
    ) -> Result<()> {
        match self.bias {
            Some(b) => {
                let (dw, db) = gr.pair_mut(self.weight, b);
                self.lin.backward_params(be, x, dy, dw, Some(db))
            }
            None => self
                .lin
                .backward_params(be, x, dy, gr.get_mut(self.weight), None),
        }
    }
}

/// A GELU fused into a product needs the bias of the layer before it.
fn needs_bias(bias: Option<usize>) -> Result<usize> {
    bias.ok_or_else(|| Error::Invalid("a GELU fused into a product needs its bias".into()))
}
