//! A micro-batch's passes through the units: forward (with checkpointing and the fused last
//! unit), backward (recompute, the unit's gradients, reductions as each unit finishes), and
//! evaluation's forward without gradients.
//!
//! The fused last unit (`Module::forward_backward`): `train_batch` knows the loss gradient
//! before forward (the loss scale over the global batch's targets), and its backward follows
//! forward at once, so the last unit (the loss head) computes its loss and its gradients
//! together: a device runs each chunk's logits product once, nothing is saved, checkpointed or
//! recomputed. Its parameters are forward's gather (hpZ cuts no secondary copy of them:
//! backward does not gather them again) and its gradients land in the micro-step buffers
//! then; everything backward does after a unit's computation (prefetching the next unit, the
//! reduction, the shared group's after its first user) still happens at the start of
//! backward, in the same order, so no reduction, lane or bit changes. `Engine::forward` (the
//! manual API) does not fuse: its caller may never call backward.

use std::time::Instant;

use super::core::Engine;
use super::eval::Evaluation;
use super::ledger::{Category, Location};
use super::optimizer_overlap::LendCtx;
use super::overlap::CommOverlap;
use super::rules;
use super::stage::{
    grad_staging_bytes, reduce_gradient, reduce_output, to_storage, Extent, Reduced,
};
use super::unit_views::{unit_params, unit_params_and_grads};
use crate::nn::{Batch, BatchIds, Ctx, Grads, Module, Params};
use crate::tensor::{Storage, Tensor};
use crate::{Error, Result};

impl Engine {
    /// Runs one unit's forward with its parameters gathered; fills `saved[unit]` when training.
    pub(super) fn run_unit_forward(
        &mut self,
        unit: usize,
        (batch, ids): (&Batch, &BatchIds),
        input: &Tensor,
        training: bool,
    ) -> Result<Tensor> {
        let rng = (self.unit_seed(unit), self.rng_row(batch));
        let Self {
            model,
            groups,
            acts,
            be,
            params: flow,
            ..
        } = self;
        let u = &model.units[unit];
        let params = unit_params(groups, &flow.places, unit)?;
        let mut ctx = Ctx::new(&**be, (batch, ids), training, rng, &mut acts.saved[unit]);
        u.module
            .forward(&mut ctx, &params, input)
            .map_err(|e| e.in_unit(&u.name))
    }

    fn track_saved(&mut self, unit: usize) {
        let b = self.acts.saved[unit]
            .as_ref()
            .map_or(0, |s| s.bytes() as u64);
        self.ledger
            .alloc(Location::Device, Category::Activations, b);
        self.acts.saved_bytes[unit] = b;
    }

    fn untrack_saved(&mut self, unit: usize) {
        let b = std::mem::take(&mut self.acts.saved_bytes[unit]);
        self.ledger.free(Location::Device, Category::Activations, b);
    }

    /// Forward over every unit; returns the sum of token losses of this micro-batch as a
    /// one-element tensor on the device (read it only when the value is needed: a sync).
    pub(super) fn forward_pass(
        &mut self,
        batch: (&Batch, &BatchIds),
        training: bool,
    ) -> Result<Tensor> {
        self.forward_units(batch, training, None)
    }

    /// [`Engine::forward_pass`]; in training with `fused` (the loss gradient), the last unit
    /// runs its backward at once (the fused unit): not checkpointed, nothing saved.
    pub(super) fn forward_units(
        &mut self,
        batch: (&Batch, &BatchIds),
        training: bool,
        fused: Option<f32>,
    ) -> Result<Tensor> {
        // A gradient left by a failed step must not seed the next backward.
        self.acts.head_grad = None;
        if training && self.acts.micro == 0 && self.acts.losses.is_empty() {
            self.obs.step_begin(self.opt.steps + 1, &*self.be)?;
        }
        let t = Instant::now();
        // The step's staging (uploads in flight) is still held: the device's locked bytes now.
        self.ledger
            .observe_device_locked(self.be.page_locked_bytes());
        let mut x = Tensor::default();
        let n = self.model.units.len();
        for unit in 0..n {
            let fuse = fused.filter(|_| training && unit + 1 == n);
            self.gather_unit(unit, fuse.is_some())?;
            if unit + 1 < n {
                self.prefetch(unit + 1);
            }
            let out = match fuse {
                Some(g) => self.run_unit_fused(unit, batch, &x, g),
                None => self.run_unit_forward(unit, batch, &x, training),
            };
            // Below the backward floor nothing is kept for a backward that will not come.
            let keep = training && fuse.is_none();
            let below = unit < self.acts.floor;
            if !(keep && !below && out.is_ok() && self.reused_soon(unit)) {
                self.release_unit(unit);
            }
            let out = out?;
            if keep && below {
                self.acts.saved[unit] = None;
            } else if keep {
                if self.checkpointing() {
                    self.acts.saved[unit] = None;
                    let input = std::mem::take(&mut x);
                    let loc = rules::ckpt_location(&self.cfg);
                    let be = &*self.be;
                    (self.acts.checkpoints).leave((unit, input), loc, be, &mut self.ledger)?;
                } else {
                    self.track_saved(unit);
                }
            }
            self.ledger.check_limit()?;
            // The unit kept what it needs of its input (a copy); the buffer is reused.
            let input = std::mem::replace(&mut x, out);
            self.be.recycle(input.storage);
        }
        self.obs.timings.forward += t.elapsed().as_secs_f64();
        if x.numel() != 1 {
            return Err(Error::Shape {
                op: "model output",
                expected: "[1] loss sum".into(),
                got: format!("{:?}", x.shape),
            });
        }
        Ok(x)
    }

    /// Backward over every unit in reverse; `loss_grad` = d(objective)/d(loss sum).
    pub(super) fn backward_pass(
        &mut self,
        batch: (&Batch, &BatchIds),
        loss_grad: f32,
    ) -> Result<()> {
        let t = Instant::now();
        self.params.hpz.set_backward(true);
        let r = self.backward_units(batch, loss_grad);
        self.params.hpz.set_backward(false);
        if r.is_err() {
            // Gradients still on their way down land (their buffers come back) before the
            // error leaves the engine.
            if let Err(e) = self.land_downloads() {
                tracing::error!("after a failed backward: {e}");
            }
        }
        // Gradients on their way down (and checkpoints that went down) hold staging memory.
        self.ledger
            .observe_device_locked(self.be.page_locked_bytes());
        r?;
        self.obs.timings.backward += t.elapsed().as_secs_f64();
        Ok(())
    }

    fn backward_units(&mut self, batch: (&Batch, &BatchIds), loss_grad: f32) -> Result<()> {
        let first_shared_user = self
            .model
            .units
            .iter()
            .position(|u| !u.uses_shared.is_empty());
        let n = self.model.units.len();
        // After a fused last unit, backward starts below it from its input gradient.
        let (mut grad, top) = match self.acts.head_grad.take() {
            Some(dx) => {
                self.finish_fused_unit(n - 1, first_shared_user)?;
                (dx, n - 1)
            }
            None => (Tensor::scalar(loss_grad), n),
        };
        let floor = self.acts.floor;
        for unit in (floor..top).rev() {
            self.gather_unit(unit, false)?;
            if let Some(next) = rules::backward_next(unit, floor) {
                self.prefetch(next);
            }
            if let Some(below) = rules::checkpoint_up_with(unit, floor) {
                self.checkpoint_ahead(below)?;
            }
            let trace = self.obs.trace.clone();
            let r = trace.span("compute", "backward", unit, || {
                self.unit_backward(unit, batch, &grad)
            });
            self.release_unit(unit);
            let grad_output = std::mem::replace(&mut grad, r?);
            self.be.recycle(grad_output.storage);
            self.reduce_unit(unit, first_shared_user)?;
        }
        self.finish_reductions()?;
        self.land_downloads()
    }

    /// A unit's gradient is final: it is reduced, and the shared group's after its first user.
    pub(super) fn reduce_unit(
        &mut self,
        unit: usize,
        first_shared_user: Option<usize>,
    ) -> Result<()> {
        self.reduce_group(unit)?;
        self.ledger.check_limit()?;
        if let (Some(s), Some(first)) = (self.shared_index(), first_shared_user) {
            if first == unit {
                self.reduce_group(s)?;
            }
        }
        Ok(())
    }

    fn unit_backward(
        &mut self,
        unit: usize,
        (batch, ids): (&Batch, &BatchIds),
        grad: &Tensor,
    ) -> Result<Tensor> {
        let loc = rules::ckpt_location(&self.cfg);
        let be = &*self.be;
        if let Some(input) = (self.acts.checkpoints).take(unit, loc, be, &mut self.ledger)? {
            self.run_unit_forward(unit, (batch, ids), &input, true)?;
            self.track_saved(unit);
        }
        let out = self.with_unit_grads(unit, (batch, ids), |m, ctx, p, g| {
            m.backward(ctx, p, g, grad)
        });
        self.untrack_saved(unit);
        out
    }

    /// Runs `f` on unit `unit`'s module in training mode, with its gathered parameters and its
    /// micro-step gradients (allocated here, and the shared group's when the unit uses it);
    /// the unit's saved state is gone after, whatever `f` returns.
    pub(super) fn with_unit_grads<R>(
        &mut self,
        unit: usize,
        (batch, ids): (&Batch, &BatchIds),
        f: impl FnOnce(&dyn Module, &mut Ctx<'_>, &Params<'_>, &mut Grads<'_>) -> Result<R>,
    ) -> Result<R> {
        let rng = (self.unit_seed(unit), self.rng_row(batch));
        // Frozen groups have no micro-step gradient (`ensure_micro` leaves them).
        for &g in self.params.places.groups(unit) {
            self.groups[g].ensure_micro(&*self.be, &mut self.ledger)?;
        }
        let Self {
            model,
            groups,
            acts,
            be,
            params: flow,
            ..
        } = self;
        let u = &model.units[unit];
        let (params, mut grads) = unit_params_and_grads(groups, &flow.places, unit)?;
        let mut ctx = Ctx::new(&**be, (batch, ids), true, rng, &mut acts.saved[unit]);
        let out = f(&*u.module, &mut ctx, &params, &mut grads).map_err(|e| e.in_unit(&u.name));
        drop(grads);
        self.acts.saved[unit] = None;
        out
    }

    /// Forward of one micro-batch in training mode (DeepSpeed's `engine(batch)`); returns the
    /// micro-batch's mean token loss on this rank. Call [`Engine::backward`] next.
    pub fn forward(&mut self, batch: &Batch) -> Result<f64> {
        let ids = BatchIds::new(&*self.be, batch)?;
        let loss = self.forward_pass((batch, &ids), true)?;
        // The caller asked for the value: it leaves the device now.
        let sum = f64::from(loss.to_vec_f32()?[0]);
        self.acts.losses.push(loss);
        self.acts.tokens += batch.valid_targets() as u64;
        self.acts.last_batch = Some((batch.clone(), ids));
        Ok(sum / batch.valid_targets().max(1) as f64)
    }

    /// Backward of the last forward, with DeepSpeed's scaling: the micro-batch mean loss,
    /// divided by the accumulation steps and averaged over ranks.
    pub fn backward(&mut self) -> Result<()> {
        let (batch, ids) = self
            .acts
            .last_batch
            .take()
            .ok_or_else(|| Error::Invalid("backward() without a preceding forward()".into()))?;
        let denom =
            batch.valid_targets().max(1) * self.cfg.gradient_accumulation_steps * self.world_size();
        let grad = (self.opt.scaler.scale() / denom as f64) as f32;
        self.backward_pass((&batch, &ids), grad)?;
        self.acts.micro += 1;
        Ok(())
    }

    /// Whether the next [`Engine::step`] will update parameters (accumulation boundary).
    pub fn is_gradient_accumulation_boundary(&self) -> bool {
        self.acts.micro >= self.cfg.gradient_accumulation_steps
    }

    /// Evaluates one batch (collective in stage 3: every rank must call it).
    pub fn evaluate(&mut self, batch: &Batch) -> Result<Evaluation> {
        let n = self.model.units.len();
        let ids = BatchIds::new(&*self.be, batch)?;
        let mut x = Tensor::default();
        let mut predictions = None;
        for unit in 0..n {
            self.gather_unit(unit, false)?;
            let r = self.eval_unit(unit, (batch, &ids), &x, unit + 1 == n);
            self.release_unit(unit);
            let (out, pred) = r?;
            predictions = predictions.or(pred);
            x = out;
        }
        Ok(Evaluation {
            loss_sum: x.to_vec_f32()?.first().copied().unwrap_or(0.0) as f64,
            tokens: batch.valid_targets() as u64,
            predictions,
        })
    }

    fn eval_unit(
        &mut self,
        unit: usize,
        (batch, ids): (&Batch, &BatchIds),
        x: &Tensor,
        last: bool,
    ) -> Result<(Tensor, Option<Vec<u32>>)> {
        let out = self.run_unit_forward(unit, (batch, ids), x, false)?;
        if !last {
            return Ok((out, None));
        }
        let Self {
            model,
            groups,
            be,
            params: flow,
            ..
        } = self;
        let u = &model.units[unit];
        let params = unit_params(groups, &flow.places, unit)?;
        let mut saved = None;
        let mut ctx = Ctx::new(&**be, (batch, ids), false, (0, 0), &mut saved);
        Ok((out, u.module.predict(&mut ctx, &params, x)?))
    }

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
        let floor = self.acts.floor;
        if let Some(next) = rules::backward_next(unit, floor) {
            self.prefetch(next);
        }
        // The unit below's checkpoint comes up while this unit's gradient is reduced, as it
        // would during this unit's backward without the fusion.
        if let Some(below) = rules::checkpoint_up_with(unit, floor) {
            self.checkpoint_ahead(below)?;
        }
        self.reduce_unit(unit, first_shared_user)
    }

    /// Starts bringing unit `unit`'s checkpoint back to the device when it waits in host
    /// memory ([`Checkpoints::ahead`](super::ckpt_offload::Checkpoints::ahead)).
    fn checkpoint_ahead(&mut self, unit: usize) -> Result<()> {
        let loc = rules::ckpt_location(&self.cfg);
        (self.acts.checkpoints).ahead(unit, loc, &*self.be, &mut self.ledger)
    }

    /// Reduces group `g`'s micro-step gradient across ranks and accumulates it (overlapped:
    /// queued on the worker, accumulated in [`Engine::finish_reductions`]).
    pub(super) fn reduce_group(&mut self, g: usize) -> Result<()> {
        let t = Instant::now();
        let Some(micro) = self.groups[g].take_micro(&mut self.ledger) else {
            return Ok(());
        };
        // The payload is rounded to the wire dtype once here; `accumulate` widens the sum back.
        let wire = super::build::reduce_dtype(&self.cfg);
        // One rank reduces nothing: the f32 gradient itself is the step's, read rounded to
        // the accumulator's dtype, unless the wire's rounding would differ from that one.
        if self.comm.world.world_size() == 1 && self.grads.downloads.moves(&self.groups[g], wire) {
            self.hold_reduced(g, micro)?;
            self.obs.timings.reduce += t.elapsed().as_secs_f64();
            return Ok(());
        }
        let buf = to_storage(micro, wire, &*self.be)?;
        let bytes = buf.bytes();
        if self.comm.world.world_size() > 1 {
            self.grads.reduced_bytes += bytes;
        }
        self.ledger
            .alloc(Location::Device, Category::CommBuffers, bytes);
        let (mut extent, mut world, s) = (
            self.params.stage.grads(),
            self.groups[g].layout.world_size,
            self.groups[g].layout.shard_len,
        );
        if world == 1 && self.comm.replicas() > 1 {
            // Shard groups of one rank (`mics_shard_size = 1`): the shard is the whole
            // gradient, summed in place across the replicas like a full one.
            (extent, world) = (Extent::Full, self.world_size());
        }
        let bucket = (
            self.cfg.zero.reduce_bucket_size,
            rules::grad_wire(&self.cfg),
        );
        let out = reduce_output(extent, &buf, world, s)?;
        if out.is_some() {
            // Held while the reduction runs (on the worker too): counted at its start.
            let staging = grad_staging_bytes(bucket.1, world, s, buf.dtype());
            self.ledger
                .alloc(Location::Device, Category::CommBuffers, staging);
            self.ledger
                .free(Location::Device, Category::CommBuffers, staging);
        }
        match &mut self.grads.overlap {
            CommOverlap::On(o) => {
                o.reduce((g, bytes), move |c| {
                    reduce_gradient(extent, buf, out, world, s, c, bucket)
                });
                self.bound_reductions()?;
            }
            CommOverlap::Off => {
                let shards = self.comm.shards();
                let red = reduce_gradient(extent, buf, out, world, s, shards, bucket);
                self.ledger
                    .free(Location::Device, Category::CommBuffers, bytes);
                self.accumulate(g, red?)?;
            }
        }
        self.obs.timings.reduce += t.elapsed().as_secs_f64();
        Ok(())
    }

    fn accumulate(&mut self, g: usize, reduced: Reduced) -> Result<()> {
        let Reduced { sum, spent } = reduced;
        if let Some(spent) = spent {
            self.be.recycle(spent);
        }
        if self.grads.downloads.moves(&self.groups[g], sum.dtype()) {
            return self.hold_reduced(g, sum);
        }
        // The cast runs where the reduction did (on the device), wherever the sum is added.
        let sum = to_storage(sum, self.groups[g].grad_dtype(), &*self.be)?;
        self.accumulate_reduced(g, sum)
    }

    /// Waits for every queued reduction and accumulates the results in submission order.
    pub(super) fn finish_reductions(&mut self) -> Result<()> {
        let t = Instant::now();
        while self.finish_oldest_reduction()? {}
        self.obs.timings.reduce += t.elapsed().as_secs_f64();
        Ok(())
    }

    /// Waits for the oldest queued reduction and accumulates it; false when none is queued.
    fn finish_oldest_reduction(&mut self) -> Result<bool> {
        let Some((g, bytes, p)) = self.grads.overlap.pop_reduction() else {
            return Ok(false);
        };
        let red = p.wait();
        self.ledger
            .free(Location::Device, Category::CommBuffers, bytes);
        self.accumulate(g, red?)?;
        Ok(true)
    }

    /// Keeps queued reductions within DeepSpeed's double buffer (two `reduce_bucket_size`
    /// buckets of elements, and always the newest one), so overlap never holds a second copy
    /// of every gradient; results are still accumulated in submission order.
    fn bound_reductions(&mut self) -> Result<()> {
        while self.grads.overlap.over_bound(&self.cfg, &self.groups) {
            self.finish_oldest_reduction()?;
        }
        Ok(())
    }

    /// Makes `sum` group `g`'s gradient for the step (`GradDownloads::moves`); the group
    /// may step at an armed boundary.
    fn hold_reduced(&mut self, g: usize, sum: Storage) -> Result<()> {
        self.groups[g].hold_gradient(sum, &mut self.ledger)?;
        self.lend_for_step(g)
    }

    /// Adds group `g`'s reduced micro-step gradient into its accumulator
    /// (`GradDownloads::add`); once the addition is done, at an armed boundary the group
    /// may step.
    fn accumulate_reduced(&mut self, g: usize, sum: Storage) -> Result<()> {
        let grp = (g, &mut self.groups[g]);
        if (self.grads.downloads).add(grp, sum, &*self.be, &mut self.ledger)? {
            return self.lend_for_step(g);
        }
        while self.grads.downloads.over_bound() {
            self.land_oldest_download()?;
        }
        Ok(())
    }

    /// Lands every gradient still on its way down (the end of a backward).
    pub(super) fn land_downloads(&mut self) -> Result<()> {
        while self.land_oldest_download()? {}
        Ok(())
    }

    /// Lands the oldest download (`GradDownloads::land_oldest`) and lends its group when
    /// its gradient is final; false when none is queued.
    fn land_oldest_download(&mut self) -> Result<bool> {
        let downloads = &mut self.grads.downloads;
        match downloads.land_oldest(&mut self.groups, &*self.be, &mut self.ledger)? {
            None => Ok(false),
            Some(done) => done
                .map_or(Ok(()), |g| self.lend_for_step(g))
                .map(|()| true),
        }
    }

    /// Called when group `g`'s gradient is final: lends the group to the optimizer lane when
    /// the write-behind is armed.
    fn lend_for_step(&mut self, g: usize) -> Result<()> {
        let ctx = LendCtx {
            rank: self.shard_rank(),
            opt: &self.opt.optimizer,
            be: &self.be,
            trace: &self.obs.trace,
            tile: self.cfg.zero.sub_group_size.max(1),
            nvme: self.opt.nvme.shared(),
        };
        self.opt.lane.lend((g, &mut self.groups), ctx)
    }
}
