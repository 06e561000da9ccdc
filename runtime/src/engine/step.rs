//! The accumulation boundary: overflow check, global gradient norm, loss scaling, clipping,
//! the optimizer update and re-publishing parameters; and `train_batch`, the common loop.

use std::time::Instant;

use super::core::Engine;
use super::ledger::Location;
use super::offload_copies::Inbound;
use super::optimizer::StepValues;
use super::optimizer_overlap::Overlapped;
use super::report::{StepReport, Timings};
use super::topology::shard_comm;
use crate::comm::{BufMut, ReduceOp};
use crate::nn::Batch;
use crate::{Error, Result};

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
        if self.micro != 0 {
            return Err(Error::Invalid(
                "train_batch called in the middle of a manual accumulation".into(),
            ));
        }
        self.activity_mark = self.be.activity();
        let local: u64 = micro_batches.iter().map(|b| b.valid_targets() as u64).sum();
        let global = self.sum_across_ranks(local as f64)? as u64;
        let grad = (self.scaler.scale() / global.max(1) as f64) as f32;
        for (i, b) in micro_batches.iter().enumerate() {
            let ids = crate::nn::BatchIds::new(&*self.be, b)?;
            // The head's backward runs with its forward: the gradient is known already.
            let loss = self.forward_pass_fused((b, &ids), grad)?;
            self.losses.push(loss);
            self.tokens += b.valid_targets() as u64;
            if i + 1 == gas {
                // The step follows this backward at once: its groups may step while it runs.
                self.arm_optimizer_lane();
            }
            if let Err(e) = self.backward_pass((b, &ids), grad) {
                // Lent groups come home before the error leaves the engine.
                if let Err(lost) = self.disarm_optimizer_lane() {
                    tracing::error!("after a failed backward: {lost}");
                }
                return Err(e);
            }
            self.micro += 1;
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
        let lane = self.join_optimizer_lane()?;
        // The micro-steps' losses and the owned gradients' sums of squares leave the device
        // here, together: the step's one wait for it. One pass over the gradients serves both
        // the overflow check and the norm.
        let known = lane.as_ref().map(|l| l.sumsq.as_slice());
        let (local, local_sumsq) = self.local_status(known)?;
        let loss_sum = self.sum_across_ranks(local)?;
        let tokens = self.sum_across_ranks(self.tokens as f64)? as u64;
        let overflow = self.any_overflow(!local_sumsq.is_finite())?;
        let scale = self.scaler.scale();
        let norm = if overflow {
            f64::NAN
        } else {
            self.global_norm(local_sumsq)? / scale
        };
        let decision = self.scaler.update(overflow)?;
        let lr = self.schedule.lr_at(self.steps);
        if !decision.skip_step {
            let sv = self.step_values((self.clip_coef(norm) / scale) as f32);
            self.apply_update(&sv, lane)?;
        } else {
            self.settle_overlap(None, lane)?;
        }
        for g in &mut self.groups {
            g.grad.fill_zero()?;
        }
        self.steps += 1;
        self.micro = 0;
        let flops_profile = self
            .observers
            .step_end(self.steps, &*self.be, &self.timings)?;
        let report = StepReport {
            step: self.steps,
            loss: loss_sum / tokens.max(1) as f64,
            lr,
            loss_scale: decision.scale_used,
            skipped: decision.skip_step,
            grad_norm: norm,
            tokens,
            timings: std::mem::take(&mut self.timings),
            memory: self.ledger.report(),
            device_memory: self.be.memory_stats(),
            swap: self.step_traffic(),
            cross_group_bytes: self.take_cross_group_bytes(),
            reduced_bytes: std::mem::take(&mut self.reduced_bytes),
            flops_profile,
            device_activity: self.step_activity(),
        };

        self.tokens = 0;
        self.observers.step(&report)?;
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
        match (std::mem::replace(&mut self.activity_mark, now), now) {
            (Some(then), Some(now)) => Some(now - then),
            _ => None,
        }
    }

    /// The clipping coefficient for a global norm (1 without clipping).
    fn clip_coef(&self, norm: f64) -> f64 {
        let clip = self.cfg.gradient_clipping;
        if clip > 0.0 && norm > clip {
            clip / (norm + 1e-6)
        } else {
            1.0
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
        let t = Instant::now();
        let tile = self.cfg.zero.sub_group_size.max(1);
        let mut writing = std::collections::VecDeque::new();
        let trace = self.trace.clone();
        let todo: Vec<usize> = (0..self.groups.len()).filter(|&g| !done[g]).collect();
        // Group g+1's gradient goes down on the copy stream while the host steps group g.
        let mut next = match todo.first() {
            Some(&g) => self.optimizer.fetch(&self.groups[g], &*self.be)?,
            None => Inbound::default(),
        };
        for (i, &gi) in todo.iter().enumerate() {
            self.swap_in_for_step(gi)?;
            let inbound = std::mem::take(&mut next);
            if let Some(&after) = todo.get(i + 1) {
                next = self.optimizer.fetch(&self.groups[after], &*self.be)?;
            }
            let (g, nvme) = (&mut self.groups[gi], self.nvme.as_deref());
            trace.span("compute", "step", gi, || {
                self.optimizer
                    .step_group(g, sv, tile, nvme, &*self.be, inbound)
            })?;
            self.swap_out_after_step(gi, &mut writing)?;
        }
        while !writing.is_empty() {
            self.finish_swap_write(&mut writing)?;
        }
        self.timings.optimizer += t.elapsed().as_secs_f64();
        Ok(())
    }

    /// Makes every rank's parameters current after the update (stages 1-2 all-gather).
    fn publish(&mut self) -> Result<()> {
        let t = Instant::now();
        let bucket = self.cfg.zero.allgather_bucket_size;
        let shards = shard_comm(self.comm.as_ref(), &self.hybrid);
        for g in &mut self.groups {
            // The all-gather reads the updated parameters on the device.
            if g.layout.world_size > 1 {
                g.landing.await_on(&*self.be)?;
            }
            self.stage.publish(g, shards, bucket, &mut self.ledger)?;
        }
        self.hpz_stale();
        self.ledger.check_limit()?;
        self.timings.gather += t.elapsed().as_secs_f64();
        Ok(())
    }

    /// Sum of a scalar over ranks (collective), exact for integers below 2^48: split into two
    /// f32 parts whose rank-order sums stay exact.
    pub fn sum_across_ranks(&self, x: f64) -> Result<f64> {
        let hi = (x / 16_777_216.0).floor();
        let lo = x - hi * 16_777_216.0;
        let mut v = [hi as f32, lo as f32];
        self.comm.all_reduce(BufMut::F32(&mut v), ReduceOp::Sum)?;
        Ok(v[0] as f64 * 16_777_216.0 + v[1] as f64)
    }

    /// Whether any rank's owned gradients contain Inf or NaN, given whether this rank's do.
    fn any_overflow(&self, local: bool) -> Result<bool> {
        let mut v = [if local { 1.0f32 } else { 0.0 }];
        self.comm.all_reduce(BufMut::F32(&mut v), ReduceOp::Max)?;
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
        let losses = std::mem::take(&mut self.losses);
        let mut views = Vec::new();
        for (i, g) in self.groups.iter().enumerate() {
            if known(i).is_some() {
                continue;
            }
            let r = g.layout.shard_range(rank);
            views.push(
                g.grad
                    .view()
                    .range(r.start - g.grad_offset..r.end - g.grad_offset)?,
            );
        }
        let loss_views: Vec<_> = losses.iter().map(|l| l.view()).collect();
        let st = self.be.step_status(&loss_views, &views)?;
        let loss = st.losses.iter().fold(0.0f64, |acc, &l| acc + f64::from(l));
        let mut read = st.sum_squares.into_iter();
        // -0.0 is what `Iterator::sum` starts from: the same bits for an all-zero gradient.
        let mut sumsq = -0.0f64;
        for i in 0..self.groups.len() {
            sumsq += match known(i) {
                Some(s) => s,
                None => read.next().unwrap_or_default(),
            };
        }
        Ok((loss, sumsq))
    }

    /// The global L2 norm from each rank's [`Self::local_sum_squares`]: one copy of the
    /// sharded gradient, summed over the shard group in rank order.
    fn global_norm(&self, local: f64) -> Result<f64> {
        let mut v = [local as f32];
        // One copy of the sharded gradient: the shard group's sum (the world's, without
        // hybrid sharding).
        self.one_copy_comm()
            .all_reduce(BufMut::F32(&mut v), ReduceOp::Sum)?;
        Ok((v[0] as f64).sqrt())
    }

    /// Maximum of a value over ranks (collective; f32 precision, for reports).
    pub fn max_across_ranks(&self, x: f64) -> Result<f64> {
        let mut v = [x as f32];
        self.comm.all_reduce(BufMut::F32(&mut v), ReduceOp::Max)?;
        Ok(v[0] as f64)
    }

    /// Peak device bytes on this rank so far.
    pub fn peak_device_bytes(&self) -> u64 {
        self.ledger.peak_total(Location::Device)
    }
}
