//! The accumulation boundary: overflow check, global gradient norm, loss scaling, clipping,
//! the optimizer update and re-publishing parameters; and `train_batch`, the common loop.

use std::time::Instant;

use super::core::Engine;
use super::lamb;
use super::ledger::Location;
use super::offload_copies::Inbound;
use super::optimizer::{Optimizer, StepValues};
use super::optimizer_overlap::Overlapped;
use super::report::{StepReport, Timings};
use crate::backend::ClipRule;
use crate::comm::{BufMut, ReduceOp};
use crate::nn::Batch;
use crate::{Error, Result};
use ferrozero_offload::optim::LambHyper;

impl Engine {
    /// One optimizer step over every micro-batch of this rank's share of the global batch
    /// (`gradient_accumulation_steps` of them). The loss is the mean over every target
    /// token of the global batch, as the reference implementations define it.
    pub fn train_batch(&mut self, micro_batches: &[Batch]) -> Result<StepReport> {
        let gas = self.cfg.gradient_accumulation_steps;
        if micro_batches.len() != gas {
            return Err(Error::Invalid(format!(
                "train_batch got {} micro-batches; gradient_accumulation_steps is {gas}",
                micro_batches.len()
            )));
        }
        if self.acts.micro != 0 {
            return Err(Error::Invalid(
                "train_batch called in the middle of a manual accumulation".into(),
            ));
        }
        self.obs.activity_mark = self.be.activity();
        let local: u64 = micro_batches.iter().map(|b| b.valid_targets() as u64).sum();
        let global = self.sum_across_ranks(local as f64)? as u64;
        let grad = (self.opt.scaler.scale() / global.max(1) as f64) as f32;
        for (i, b) in micro_batches.iter().enumerate() {
            let ids = crate::nn::BatchIds::new(&*self.be, b)?;
            // The head's backward runs with its forward: the gradient is known already.
            let loss = self.forward_pass_fused((b, &ids), grad)?;
            self.acts.losses.push(loss);
            self.acts.tokens += b.valid_targets() as u64;
            if i + 1 == gas {
                // The step follows this backward at once: its groups may step while it runs.
                let scale = self.opt.scaler.scale();
                let sv = self.opt.values((1.0 / scale) as f32);
                (self.opt.lane).arm(sv, self.cfg.gradient_clipping, scale);
            }
            if let Err(e) = self.backward_pass((b, &ids), grad) {
                // Lent groups come home before the error leaves the engine.
                if let Err(lost) = self.disarm_optimizer_lane() {
                    tracing::error!("after a failed backward: {lost}");
                }
                return Err(e);
            }
            self.acts.micro += 1;
        }
        self.step()?
            .ok_or_else(|| Error::Invalid("no step at the accumulation boundary".into()))
    }

    /// Takes the optimizer step if this is an accumulation boundary; `None` otherwise.
    pub fn step(&mut self) -> Result<Option<StepReport>> {
        if !self.is_gradient_accumulation_boundary() {
            return Ok(None);
        }
        // The optimizer lane gives every group back first, so no error below leaves a group
        // lent.
        let waited = &mut self.obs.timings.optimizer;
        let lane = self.opt.lane.join(&mut self.groups, waited)?;
        let clip = ClipRule {
            loss_scale: self.opt.scaler.scale(),
            clipping: self.cfg.gradient_clipping,
        };
        // The micro-steps' losses and the owned gradients' sums of squares leave the device
        // together: the step's one wait for it. At one rank with the optimizer state on the
        // device, after the update the device decided and applied itself; otherwise before,
        // for the host to decide. One pass over the gradients serves both the overflow check
        // and the norm.
        let (local, local_sumsq, applied) = if lane.is_none() && self.whole_step_applies() {
            let (l, s, gs) = self.whole_step(clip)?;
            (l, s, Some(gs))
        } else {
            let known = lane.as_ref().map(|l| l.sumsq.as_slice());
            let (l, s) = self.local_status(known)?;
            (l, s, None)
        };
        let loss_sum = self.sum_across_ranks(local)?;
        let tokens = self.sum_across_ranks(self.acts.tokens as f64)? as u64;
        let overflow = self.any_overflow(!local_sumsq.is_finite())?;
        let norm = if overflow {
            f64::NAN
        } else {
            self.global_norm(local_sumsq, &clip)?
        };
        let decision = self.opt.scaler.update(overflow)?;
        let lr = self.opt.schedule.lr_at(self.opt.steps);
        let grad_scale = clip.grad_scale(norm);
        match applied {
            Some(device) => self.settle_whole_step(device, decision.skip_step, grad_scale)?,
            None if !decision.skip_step => {
                let sv = self.opt.values(grad_scale);
                self.apply_update(&sv, lane)?;
            }
            None => {
                self.settle_overlap(None, lane)?;
            }
        }
        for g in &mut self.groups {
            g.clear_grad(&*self.be, &mut self.ledger)?;
        }
        self.opt.steps += 1;
        self.acts.micro = 0;
        let flops_profile = self.obs.step_end(self.opt.steps, &*self.be)?;
        let hpz_crossed = self.params.hpz.take_crossed();
        let report = StepReport {
            step: self.opt.steps,
            loss: loss_sum / tokens.max(1) as f64,
            lr,
            loss_scale: decision.scale_used,
            skipped: decision.skip_step,
            grad_norm: norm,
            tokens,
            timings: std::mem::take(&mut self.obs.timings),
            memory: self.ledger.report(),
            device_memory: self.be.memory_stats(),
            swap: self.step_traffic(),
            cross_group_bytes: self.comm.take_cross_group_bytes(hpz_crossed),
            reduced_bytes: std::mem::take(&mut self.grads.reduced_bytes),
            flops_profile,
            device_activity: self.step_activity(),
        };

        self.acts.tokens = 0;
        self.obs.step(&report)?;
        if !self.cfg.wall_clock_breakdown {
            return Ok(Some(StepReport {
                timings: Timings::default(),
                ..report
            }));
        }
        Ok(Some(report))
    }

    /// The device's counts since the step began; the mark moves to now, so a step driven by
    /// `forward`/`backward`/`step` counts from the previous step's end.
    fn step_activity(&mut self) -> Option<crate::backend::DeviceActivity> {
        let now = self.be.activity();
        match (std::mem::replace(&mut self.obs.activity_mark, now), now) {
            (Some(then), Some(now)) => Some(now - then),
            _ => None,
        }
    }

    /// Updates every group with `sv` (except those the optimizer lane stepped with the same
    /// values; its speculation is undone when they differ) and publishes the result.
    fn apply_update(&mut self, sv: &StepValues, lane: Option<Overlapped>) -> Result<()> {
        let done = self.settle_overlap(Some(sv), lane)?;
        self.update_groups(sv, &done)?;
        self.publish()
    }

    /// The update of every group not `done`, in order, on this thread.
    fn update_groups(&mut self, sv: &StepValues, done: &[bool]) -> Result<()> {
        if let Some(hp) = self.opt.optimizer.lamb_hyper(sv) {
            return self.update_lamb(&hp, sv, done);
        }
        let t = Instant::now();
        let tile = self.cfg.zero.sub_group_size.max(1);
        if self.state_on_device() {
            // Every group's owned range at once: one launch on a device.
            let rule = self.opt.optimizer.rule(sv)?;
            let mut tensors = Vec::new();
            for (_, g) in self
                .groups
                .iter_mut()
                .enumerate()
                .filter(|(i, g)| !done[*i] && !g.frozen)
            {
                let owned = g.owned.clone();
                tensors.extend(Optimizer::step_tensors(g, tile, owned)?.1);
            }
            self.be
                .optimizer_update_all(&rule, sv.step, sv.grad_scale, tensors)?;
            self.obs.timings.optimizer += t.elapsed().as_secs_f64();
            return Ok(());
        }
        let mut writing = std::collections::VecDeque::new();
        let trace = self.obs.trace.clone();
        let todo: Vec<usize> = (0..self.groups.len())
            .filter(|&g| !done[g] && !self.groups[g].frozen)
            .collect();
        // Group g+1's gradient goes down on the copy stream while the host steps group g.
        let mut next = match todo.first() {
            Some(&g) => self.opt.optimizer.fetch(&self.groups[g], &*self.be)?,
            None => Inbound::default(),
        };
        for (i, &gi) in todo.iter().enumerate() {
            self.params
                .swap
                .in_for_step(&mut self.groups[gi], &mut self.ledger)?;
            let inbound = std::mem::take(&mut next);
            if let Some(&after) = todo.get(i + 1) {
                next = self.opt.optimizer.fetch(&self.groups[after], &*self.be)?;
            }
            let (g, nvme) = (&mut self.groups[gi], self.opt.nvme.get());
            trace.span("compute", "step", gi, || {
                self.opt
                    .optimizer
                    .step_group(g, sv, tile, nvme, &*self.be, inbound)
            })?;
            let at = (gi, &mut self.groups[..]);
            (self.params.swap).out_after_step(at, &mut writing, &mut self.ledger)?;
        }
        while !writing.is_empty() {
            (self.params.swap).finish_write(&mut self.groups, &mut writing, &mut self.ledger)?;
        }
        self.obs.timings.optimizer += t.elapsed().as_secs_f64();
        Ok(())
    }

    /// LAMB's step of every group (`lamb.rs`): the moments and each run's partial norms,
    /// the partials completed across the shard group, then the update with each tensor's
    /// trust ratio; on the compute device, or on the host when the state is offloaded.
    fn update_lamb(&mut self, hp: &LambHyper, sv: &StepValues, done: &[bool]) -> Result<()> {
        let t = Instant::now();
        if done.iter().any(|&d| d) {
            return Err(Error::Invalid(
                "LAMB's step does not overlap backward, yet a group came back stepped".into(),
            ));
        }
        let at = match self.state_on_device() {
            true => lamb::Placement::InPlace(&*self.be),
            false => lamb::Placement::Offloaded(&*self.be, self.opt.optimizer.uploads()),
        };
        // Frozen groups have no state and take no step.
        let mut tables = Vec::with_capacity(self.groups.len());
        for g in self.groups.iter_mut().filter(|g| !g.frozen) {
            tables.push(lamb::moments(g, (hp, sv.grad_scale), &at)?);
        }
        let sharded = (self.groups.iter())
            .filter(|g| !g.frozen)
            .any(|g| g.owned != (0..g.layout.padded()));
        lamb::combine(&mut tables, sharded, self.comm.one_copy())?;
        let trained = self.groups.iter_mut().filter(|g| !g.frozen);
        for (g, table) in trained.zip(&tables) {
            lamb::apply(g, (hp, sv.step), table, &at)?;
        }
        self.obs.timings.optimizer += t.elapsed().as_secs_f64();
        Ok(())
    }

    /// Makes every rank's parameters current after the update (stages 1-2 all-gather).
    fn publish(&mut self) -> Result<()> {
        let t = Instant::now();
        let bucket = self.cfg.zero.allgather_bucket_size;
        let shards = self.comm.shards();
        for g in self.groups.iter_mut().filter(|g| !g.frozen) {
            // The all-gather reads the updated parameters on the device.
            if g.layout.world_size > 1 {
                g.landing.await_on(&*self.be)?;
            }
            self.params
                .stage
                .publish(g, shards, bucket, &mut self.ledger)?;
        }
        self.params.hpz.stale();
        self.ledger.check_limit()?;
        self.obs.timings.gather += t.elapsed().as_secs_f64();
        Ok(())
    }

    /// Sum of a scalar over ranks (collective), exact for integers below 2^48: split into two
    /// f32 parts whose rank-order sums stay exact.
    pub fn sum_across_ranks(&self, x: f64) -> Result<f64> {
        let hi = (x / 16_777_216.0).floor();
        let lo = x - hi * 16_777_216.0;
        let mut v = [hi as f32, lo as f32];
        self.comm
            .world
            .all_reduce(BufMut::F32(&mut v), ReduceOp::Sum)?;
        Ok(v[0] as f64 * 16_777_216.0 + v[1] as f64)
    }

    /// Whether any rank's owned gradients contain Inf or NaN, given whether this rank's do.
    fn any_overflow(&self, local: bool) -> Result<bool> {
        let mut v = [if local { 1.0f32 } else { 0.0 }];
        self.comm
            .world
            .all_reduce(BufMut::F32(&mut v), ReduceOp::Max)?;
        Ok(v[0] > 0.0)
    }

    /// This rank's loss sum (the micro-steps' losses added in order in f64) and the sum of
    /// squares of its owned (still loss-scaled) gradients: each group's shard range in group
    /// order, each range in the storage's fixed blocked order. Every stage sums the same
    /// elements in the same order, so it is bitwise equal across stages; it is finite exactly
    /// when every element is (squares of finite values are exact in f64 and their sum cannot
    /// overflow), which makes it the overflow check too. A group's term the optimizer lane
    /// already computed (`known`) is taken as it is: the same bits. The losses are consumed.
    fn local_status(&mut self, known: Option<&[Option<f64>]>) -> Result<(f64, f64)> {
        let rank = self.shard_rank();
        let known = |i: usize| known.and_then(|k| k.get(i).copied().flatten());
        let losses = std::mem::take(&mut self.acts.losses);
        let mut views = Vec::new();
        // Frozen groups have no gradient: they add no term.
        let trains = |i: usize| !self.groups[i].frozen;
        for (i, g) in self.groups.iter().enumerate() {
            if known(i).is_some() || g.frozen {
                continue;
            }
            let r = g.layout.shard_range(rank);
            views.push(g.grad_view(r.start - g.grad_offset..r.end - g.grad_offset)?);
        }
        let loss_views: Vec<_> = losses.iter().map(|l| l.view()).collect();
        let st = self.be.step_status(&loss_views, &views)?;
        let mut read = st.sum_squares.into_iter();
        let sums = (0..self.groups.len())
            .filter(|&i| trains(i))
            .map(|i| match known(i) {
                Some(s) => s,
                None => read.next().unwrap_or_default(),
            });
        Ok((loss_sum(&st.losses), ClipRule::total(sums)))
    }

    /// The global L2 norm (unscaled by `clip`'s loss scale) from each rank's sum of squares:
    /// one copy of the sharded gradient, summed over the shard group in rank order. Several
    /// ranks sum here, on the host, after the status download; one rank's sum is its own.
    fn global_norm(&self, local: f64, clip: &ClipRule) -> Result<f64> {
        let mut v = [local as f32];
        // One copy of the sharded gradient: the shard group's sum (the world's, without
        // hybrid sharding).
        self.comm
            .one_copy()
            .all_reduce(BufMut::F32(&mut v), ReduceOp::Sum)?;
        Ok(clip.norm(v[0]))
    }

    /// Maximum of a value over ranks (collective; f32 precision, for reports).
    pub fn max_across_ranks(&self, x: f64) -> Result<f64> {
        let mut v = [x as f32];
        self.comm
            .world
            .all_reduce(BufMut::F32(&mut v), ReduceOp::Max)?;
        Ok(v[0] as f64)
    }

    /// Peak device bytes on this rank so far.
    pub fn peak_device_bytes(&self) -> u64 {
        self.ledger.peak_total(Location::Device)
    }
}

/// A rank's loss sum: the micro-steps' losses added in order in f64.
fn loss_sum(losses: &[f32]) -> f64 {
    losses.iter().fold(0.0f64, |acc, &l| acc + f64::from(l))
}

impl Engine {
    /// Whether the step runs whole on the compute device (`OptimizerOps::whole_step`): one
    /// rank (no norm or overflow to agree on with others) and the optimizer state and the
    /// parameters placed on the compute device (neither offloaded to host memory nor to
    /// NVMe), and an element-wise optimizer (not LAMB's per-tensor passes). The optimizer
    /// lane, when armed, is checked by the caller.
    fn whole_step_applies(&self) -> bool {
        let per_tensor = self.opt.optimizer.per_tensor();
        self.comm.world.world_size() == 1 && self.state_on_device() && !per_tensor
    }

    /// Whether the optimizer state and the parameters are placed on the compute device, so
    /// one call updates every group where it lives.
    fn state_on_device(&self) -> bool {
        use super::build::{optimizer_location, param_location};
        optimizer_location(&self.cfg) == Location::Device
            && param_location(&self.cfg) == Location::Device
    }

    /// The whole step on the device: every group's norm range and update handed over at once;
    /// the device decides the gradient scale (or the skip) from the sums of squares, updates,
    /// and the status comes back after. This rank's loss sum, sum of squares, and the scale
    /// the device applied (NaN: skipped).
    fn whole_step(&mut self, clip: ClipRule) -> Result<(f64, f64, f32)> {
        let t = Instant::now();
        let rank = self.shard_rank();
        // The scale is the device's to decide; the rule reads the schedule's values only.
        let sv = self.opt.values(f32::NAN);
        let rule = self.opt.optimizer.rule(&sv)?;
        let losses = std::mem::take(&mut self.acts.losses);
        let loss_views: Vec<_> = losses.iter().map(|l| l.view()).collect();
        let (mut norms, mut tensors) = (Vec::new(), Vec::new());
        let tile = self.cfg.zero.sub_group_size.max(1);
        // A group with no gradient of its own (a Llama's embedding unit whose table the tied
        // head owns) adds no term: its empty stand-in lives on the host.
        for g in self.groups.iter_mut().filter(|g| g.grad_len > 0) {
            let r = g.layout.shard_range(rank);
            let (n, t) = Optimizer::step_tensors(g, tile, r)?;
            norms.push(n);
            tensors.extend(t);
        }
        let st = self
            .be
            .whole_step((&rule, sv.step, clip), &loss_views, &norms, tensors)?;
        self.obs.timings.optimizer += t.elapsed().as_secs_f64();
        let applied = st.grad_scale.ok_or_else(|| {
            Error::Invalid("the whole step came back without the scale it applied".into())
        })?;
        let sumsq = ClipRule::total(st.sum_squares.iter().copied());
        Ok((loss_sum(&st.losses), sumsq, applied))
    }

    /// After a whole step: the scale the device applied must be the host's (its arithmetic,
    /// on the same sums), NaN exactly when the scaler skips; then the update is published.
    fn settle_whole_step(&mut self, device: f32, skip: bool, host: f32) -> Result<()> {
        let agree = match skip {
            true => device.is_nan(),
            false => device.to_bits() == host.to_bits(),
        };
        if !agree {
            return Err(Error::Invalid(format!(
                "step {}: the device applied gradient scale {device:e}, the host decided \
                 {host:e} (skipped: {skip})",
                self.opt.steps + 1
            )));
        }
        match skip {
            true => Ok(()),
            false => self.publish(),
        }
    }

    /// Bytes this rank has moved to and from NVMe since it was built (both stores).
    pub fn swap_traffic(&self) -> ferrozero_offload::store::Traffic {
        let opt = self.opt.nvme.shared().map(|n| n.store.bytes_moved());
        let par = self.params.swap.store().map(|s| s.store.bytes_moved());
        opt.unwrap_or_default() + par.unwrap_or_default()
    }

    /// NVMe traffic since the last call (the last step).
    pub(super) fn step_traffic(&mut self) -> super::report::SwapTraffic {
        let now = self.swap_traffic();
        let d = now - std::mem::replace(&mut self.obs.traffic_mark, now);
        super::report::SwapTraffic {
            read_bytes: d.read,
            written_bytes: d.written,
        }
    }
}

impl Engine {
    /// Which groups still need the update with the step's values `sv` (and `None` when
    /// the step is skipped), after undoing the lane's work when it does not stand.
    fn settle_overlap(
        &mut self,
        sv: Option<&StepValues>,
        lane: Option<Overlapped>,
    ) -> Result<Vec<bool>> {
        let n = self.groups.len();
        let Some(lane) = lane else {
            return Ok(vec![false; n]);
        };
        if sv == Some(&lane.sv) {
            return Ok(lane.stepped);
        }
        if !lane.stepped.iter().any(|&s| s) {
            return Ok(vec![false; n]);
        }
        match (lane.speculative, sv) {
            (true, _) => {
                self.roll_back(&lane.stepped)?;
                Ok(vec![false; n])
            }
            (false, None) => Err(super::optimizer_overlap::overlapped_overflow(
                self.opt.steps + 1,
            )),
            (false, Some(sv)) => Err(Error::Invalid(format!(
                "the optimizer lane stepped with {:?} but the step's values are {sv:?}",
                lane.sv
            ))),
        }
    }

    /// Abandons an armed step after its backward failed: lent groups come back, and a
    /// speculative step is undone (a step that was not speculative stays applied: the error
    /// stops the run).
    fn disarm_optimizer_lane(&mut self) -> Result<()> {
        match self.opt.lane.disarm(&mut self.groups)? {
            Some(stepped) => self.roll_back(&stepped),
            None => Ok(()),
        }
    }

    /// Writes every `stepped` group's saved optimizer values back.
    fn roll_back(&mut self, stepped: &[bool]) -> Result<()> {
        let t = Instant::now();
        let (be, trace) = (&*self.be, &self.obs.trace);
        (self.opt.lane).roll_back((&mut self.groups, stepped), be, trace)?;
        self.obs.timings.optimizer += t.elapsed().as_secs_f64();
        Ok(())
    }
}
