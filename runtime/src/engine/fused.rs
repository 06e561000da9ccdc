//! The last unit's forward and backward in one call (`Module::forward_backward`).
//!
//! `train_batch` knows the loss gradient before forward (the loss scale over the global
//! batch's targets), and its backward follows forward at once, so the last unit (the loss
//! head) computes its loss and its gradients together: a device runs each chunk's logits
//! product once, nothing is saved, checkpointed or recomputed. Its parameters are forward's
//! gather (hpZ cuts no secondary copy of them: backward does not gather them again) and its
//! gradients land in the micro-step buffers then; everything backward does after a unit's
//! computation (prefetching the next unit, the reduction, the shared group's after its first
//! user) still happens at the start of backward, in the same order, so no reduction, lane or
//! bit changes. `Engine::forward` (the manual API) does not fuse: its caller may never call
//! backward.

use super::core::Engine;
use crate::nn::{Batch, BatchIds};
use crate::tensor::Tensor;
use crate::Result;

impl Engine {
    /// Forward over every unit for `train_batch`: the last runs its backward too, for
    /// `loss_grad`; its input gradient waits in `head_grad` for [`Engine::backward_pass`].
    pub(super) fn forward_pass_fused(
        &mut self,
        batch: (&Batch, &BatchIds),
        loss_grad: f32,
    ) -> Result<Tensor> {
        self.forward_units(batch, true, Some(loss_grad))
    }

    /// The last unit's forward and backward with its parameters gathered; returns the loss.
    pub(super) fn run_unit_fused(
        &mut self,
        unit: usize,
        (batch, ids): (&Batch, &BatchIds),
        input: &Tensor,
        loss_grad: f32,
    ) -> Result<Tensor> {
        let trace = self.obs.trace.clone();
        let grad = Tensor::scalar(loss_grad);
        let r = trace.span("compute", "backward", unit, || {
            self.with_unit_grads(unit, (batch, ids), |m, ctx, p, g| {
                m.forward_backward(ctx, p, g, input, &grad)
            })
        });
        let (loss, dx) = r?;
        self.acts.head_grad = Some(dx);
        Ok(loss)
    }

    /// What backward does after the fused unit's computation: the next unit's prefetch, then
    /// the unit's reduction (and the shared group's, when it is the first user).
    pub(super) fn finish_fused_unit(
        &mut self,
        unit: usize,
        first_shared_user: Option<usize>,
    ) -> Result<()> {
        if unit > 0 {
            self.prefetch(unit - 1);
        }
        // The unit below's checkpoint comes up while this unit's gradient is reduced, as it
        // would during this unit's backward without the fusion.
        if let Some(below) = super::rules::checkpoint_up_with(unit) {
            self.checkpoint_ahead(below)?;
        }
        self.reduce_unit(unit, first_shared_user)
    }
}
