//! A unit's module wrapped so that the operations its forward and backward (or both at once)
//! issue are recorded under the unit's name: the layers themselves know nothing of the
//! profiler.

use std::sync::Arc;

use super::record::Recorder;
use crate::nn::{Ctx, Grads, Module, ParamSpec, Params};
use crate::tensor::Tensor;
use crate::Result;

pub(super) struct Scoped {
    pub(super) inner: Arc<dyn Module>,
    pub(super) name: Arc<str>,
    pub(super) rec: Arc<Recorder>,
}

impl Module for Scoped {
    fn param_specs(&self) -> Vec<ParamSpec> {
        self.inner.param_specs()
    }

    fn forward(&self, ctx: &mut Ctx<'_>, params: &Params<'_>, input: &Tensor) -> Result<Tensor> {
        let _scope = self.rec.enter(&self.name);
        self.inner.forward(ctx, params, input)
    }

    fn backward(
        &self,
        ctx: &mut Ctx<'_>,
        params: &Params<'_>,
        grads: &mut Grads<'_>,
        grad_output: &Tensor,
    ) -> Result<Tensor> {
        let _scope = self.rec.enter(&self.name);
        self.inner.backward(ctx, params, grads, grad_output)
    }

    fn forward_backward(
        &self,
        ctx: &mut Ctx<'_>,
        params: &Params<'_>,
        grads: &mut Grads<'_>,
        input: &Tensor,
        grad_output: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let _scope = self.rec.enter(&self.name);
        self.inner
            .forward_backward(ctx, params, grads, input, grad_output)
    }

    fn attention_width(&self) -> usize {
        self.inner.attention_width()
    }

    fn predict(
        &self,
        ctx: &mut Ctx<'_>,
        params: &Params<'_>,
        input: &Tensor,
    ) -> Result<Option<Vec<u32>>> {
        let _scope = self.rec.enter(&self.name);
        self.inner.predict(ctx, params, input)
    }
}
