//! A linear layer bound to its unit's parameters: [`Linear`]'s products with the weight (and
//! bias) read from the unit's views and their gradients written to its accumulators.

use crate::backend::{Accumulate, Backend};
use crate::nn::linear::Linear;
use crate::nn::{Grads, Params};
use crate::tensor::{View, ViewMut};
use crate::{Error, Result};

/// `y = x · W (+ b)` with `W` and `b` at fixed indices of the unit's parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dense {
    /// Dimensions and weight layout.
    pub lin: Linear,
    weight: usize,
    bias: Option<usize>,
}

impl Dense {
    /// A layer whose weight is parameter `weight` and bias, if any, parameter `bias`.
    pub fn new(lin: Linear, weight: usize, bias: Option<usize>) -> Self {
        Self { lin, weight, bias }
    }

    /// The same layer with a bias at parameter `bias` (declared apart from its weight, as
    /// Qwen2's q/k/v biases are).
    pub fn with_bias(self, bias: usize) -> Self {
        Self {
            bias: Some(bias),
            ..self
        }
    }

    fn bias<'a>(&self, p: &Params<'a>) -> Option<View<'a>> {
        self.bias.map(|b| p.get(b))
    }

    /// `y = x · W (+ b)`.
    pub fn forward(
        &self,
        be: &dyn Backend,
        p: &Params<'_>,
        x: View<'_>,
        y: ViewMut<'_>,
    ) -> Result<()> {
        self.lin.forward(be, x, p.get(self.weight), self.bias(p), y)
    }

    /// `y = residual + x · W (+ b)`, written by the product.
    pub fn forward_residual(
        &self,
        be: &dyn Backend,
        p: &Params<'_>,
        x: View<'_>,
        residual: View<'_>,
        y: ViewMut<'_>,
    ) -> Result<()> {
        let w = (p.get(self.weight), self.bias(p));
        self.lin.forward_residual(be, x, w, residual, y)
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
        let bias = self.bias(p).ok_or_else(|| {
            Error::Invalid("a GELU layer's product needs a bias to fuse with".into())
        })?;
        self.lin
            .forward_gelu(be, x, p.get(self.weight), bias, pre, y)
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

    /// The input gradient of `gelu(pre)` fed to this layer, through the GELU, with the
    /// gradient of `before`'s bias (the layer that produced `pre`) from the same product.
    pub fn backward_input_gelu(
        &self,
        be: &dyn Backend,
        (p, gr): (&Params<'_>, &mut Grads<'_>),
        before: &Dense,
        dy: View<'_>,
        pre: View<'_>,
        dx: ViewMut<'_>,
    ) -> Result<()> {
        let bias = before.bias.ok_or_else(|| {
            Error::Invalid("a GELU layer's input gradient needs the bias before it".into())
        })?;
        let w = p.get(self.weight);
        self.lin
            .backward_input_gelu(be, dy, w, pre, dx, gr.get_mut(bias))
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
            None => self.weight_grad(be, gr, x, dy),
        }
    }

    /// `dW += xᵀ · dy` only: for a layer whose bias gradient came from the product after it
    /// ([`Dense::backward_input_gelu`]).
    pub fn weight_grad(
        &self,
        be: &dyn Backend,
        gr: &mut Grads<'_>,
        x: View<'_>,
        dy: View<'_>,
    ) -> Result<()> {
        let dw = gr.get_mut(self.weight);
        self.lin.backward_params(be, x, dy, dw, None)
    }
}
