//! A micro-batch's passes through the units: forward (with checkpointing and the fused last
//! unit), backward (recompute, the unit's gradients, reductions as each unit finishes), and the
//! views of a unit's parameters and gradients they hand to its module.

use std::time::Instant;

use super::core::Engine;
use super::group::{compute_view, Group};
use super::ledger::{Category, Location};
use super::rules;
use crate::nn::{Batch, BatchIds, Ctx, Grads, Module, Params};
use crate::tensor::{Tensor, View, ViewMut};
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
        let seed = self.unit_seed(unit);
        let shared = self.shared_index();
        let Self {
            model,
            groups,
            acts,
            be,
            ..
        } = self;
        let u = &model.units[unit];
        let params = unit_params(groups, unit, &u.uses_shared, shared)?;
        let mut ctx = Ctx {
            be: &**be,
            batch,
            ids,
            training,
            rng_seed: seed,
            saved: &mut acts.saved[unit],
        };
        u.module.forward(&mut ctx, &params, input)
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
    /// runs its backward at once (`fused.rs`): not checkpointed, nothing saved.
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
            if !(training && fuse.is_none() && out.is_ok() && self.reused_soon(unit)) {
                self.release_unit(unit);
            }
            let out = out?;
            if training && fuse.is_none() {
                if self.checkpointing() {
                    self.acts.saved[unit] = None;
                    let input = std::mem::take(&mut x);
                    self.leave_checkpoint(unit, input)?;
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
        for unit in (0..top).rev() {
            self.gather_unit(unit, false)?;
            if unit > 0 {
                self.prefetch(unit - 1);
            }
            if let Some(below) = rules::checkpoint_up_with(unit) {
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
        if let Some(input) = self.take_checkpoint(unit)? {
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
        let seed = self.unit_seed(unit);
        let shared = self.shared_index();
        let uses_shared = !self.model.units[unit].uses_shared.is_empty();
        self.groups[unit].ensure_micro(&*self.be, &mut self.ledger)?;
        if let Some(s) = shared.filter(|_| uses_shared) {
            self.groups[s].ensure_micro(&*self.be, &mut self.ledger)?;
        }
        let Self {
            model,
            groups,
            acts,
            be,
            ..
        } = self;
        let u = &model.units[unit];
        let (params, mut grads) = unit_params_and_grads(groups, unit, &u.uses_shared, shared)?;
        let mut ctx = Ctx {
            be: &**be,
            batch,
            ids,
            training: true,
            rng_seed: seed,
            saved: &mut acts.saved[unit],
        };
        let out = f(&*u.module, &mut ctx, &params, &mut grads);
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
}

fn compute_view_of<'a>(g: &'a Group, what: &str) -> Result<View<'a>> {
    g.compute_params().ok_or_else(|| {
        Error::Invalid(format!(
            "parameters of {what} used before they were gathered"
        ))
    })
}

/// Parameter views for a unit: its own slots, then the shared slots it uses.
pub(super) fn unit_params<'a>(
    groups: &'a [Group],
    unit: usize,
    uses: &[usize],
    shared: Option<usize>,
) -> Result<Params<'a>> {
    let own = compute_view_of(&groups[unit], "a unit")?;
    let mut v = groups[unit]
        .layout
        .slots
        .iter()
        .map(|s| own.range(s.range()))
        .collect::<Result<Vec<View<'_>>>>()?;
    if let Some(s) = shared.filter(|_| !uses.is_empty()) {
        let sh = compute_view_of(&groups[s], "the shared group")?;
        for &i in uses {
            v.push(sh.range(groups[s].layout.slots[i].range())?);
        }
    }
    Ok(Params::new(v))
}

/// Parameter and gradient views for a unit's backward.
fn unit_params_and_grads<'a>(
    groups: &'a mut [Group],
    unit: usize,
    uses: &[usize],
    shared: Option<usize>,
) -> Result<(Params<'a>, Grads<'a>)> {
    let (head, tail) = groups.split_at_mut(shared.unwrap_or(groups.len()).max(unit + 1));
    let Group {
        layout,
        params,
        work,
        micro,
        ..
    } = &mut head[unit];
    let own_params = compute_view(params, work)
        .ok_or_else(|| Error::Invalid("unit parameters not gathered".into()))?;
    let own_micro = micro
        .as_mut()
        .ok_or_else(|| Error::Invalid("no gradient buffer".into()))?;
    let mut p = layout
        .slots
        .iter()
        .map(|s| own_params.range(s.range()))
        .collect::<Result<Vec<View<'_>>>>()?;
    let mut g = split_slots(own_micro.view_mut(), layout.slots.iter().map(|s| s.range()))?;
    if let (Some(_), false) = (shared, uses.is_empty()) {
        let Group {
            layout,
            params,
            work,
            micro,
            ..
        } = &mut tail[0];
        let sp = compute_view(params, work)
            .ok_or_else(|| Error::Invalid("shared parameters not gathered".into()))?;
        for &i in uses {
            p.push(sp.range(layout.slots[i].range())?);
        }
        let sm = micro
            .as_mut()
            .ok_or_else(|| Error::Invalid("no shared gradient buffer".into()))?;
        let all = split_slots(sm.view_mut(), layout.slots.iter().map(|s| s.range()))?;
        let mut picked: Vec<Option<ViewMut<'_>>> = all.into_iter().map(Some).collect();
        for &i in uses {
            g.push(picked[i].take().ok_or_else(|| {
                Error::Invalid(format!("shared parameter {i} used twice by one unit"))
            })?);
        }
    }
    Ok((Params::new(p), Grads::new(g)))
}

/// Splits a flat buffer into disjoint mutable views for consecutive, ordered ranges.
fn split_slots<'a>(
    buf: ViewMut<'a>,
    ranges: impl Iterator<Item = std::ops::Range<usize>>,
) -> Result<Vec<ViewMut<'a>>> {
    let mut rest = buf;
    let mut consumed = 0;
    let mut out = Vec::new();
    for r in ranges {
        let (_, tail) = rest.split_at(r.start - consumed)?;
        let (slot, tail) = tail.split_at(r.len())?;
        out.push(slot);
        rest = tail;
        consumed = r.end;
    }
    Ok(out)
}
