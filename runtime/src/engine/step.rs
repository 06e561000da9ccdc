//! The accumulation boundary: overflow check, global gradient norm, loss scaling, clipping,
//! the optimizer update and re-publishing parameters; and `train_batch`, the common loop.

use std::time::Instant;

use super::core::Engine;
use super::ledger::Location;
use super::optimizer::StepValues;
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
        let local: u64 = micro_batches.iter().map(|b| b.valid_targets() as u64).sum();
        let global = self.sum_across_ranks(local as f64)? as u64;
        let grad = (self.scaler.scale() / global.max(1) as f64) as f32;
        for b in micro_batches {
            let ids = crate::nn::BatchIds::new(&*self.be, b)?;
            let loss = self.forward_pass((b, &ids), true)?;
            self.losses.push(loss);
            self.tokens += b.valid_targets() as u64;
            self.backward_pass((b, &ids), grad)?;
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
        // The micro-steps' losses leave the device here, once per step, summed in order.
        let mut local = 0.0f64;
        for l in std::mem::take(&mut self.losses) {
            local += f64::from(l.to_vec_f32()?[0]);
        }
        let loss_sum = self.sum_across_ranks(local)?;
        let tokens = self.sum_across_ranks(self.tokens as f64)? as u64;
        let overflow = self.any_overflow()?;
        let scale = self.scaler.scale();
        let norm = if overflow {
            f64::NAN
        } else {
            self.global_norm()? / scale
        };
        let decision = self.scaler.update(overflow)?;
        let k = self.steps;
        let lr = self.schedule.lr_at(k);
        if !decision.skip_step {
            let clip = self.cfg.gradient_clipping;
            let coef = if clip > 0.0 && norm > clip {
                clip / (norm + 1e-6)
            } else {
                1.0
            };
            let sv = StepValues {
                step: k + 1,
                lr,
                beta1: self.schedule.momentum_at(k),
                grad_scale: (coef / scale) as f32,
            };
            self.apply_update(&sv)?;
        }
        for g in &mut self.groups {
            g.grad.fill_zero()?;
        }
        self.steps += 1;
        self.micro = 0;
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
        };

        self.tokens = 0;
        if !self.cfg.wall_clock_breakdown {
            return Ok(Some(StepReport {
                timings: Timings::default(),
                ..report
            }));
        }
        Ok(Some(report))
    }

    fn apply_update(&mut self, sv: &StepValues) -> Result<()> {
        let t = Instant::now();
        let tile = self.cfg.zero.sub_group_size.max(1);
        let mut writing = std::collections::VecDeque::new();
        for gi in 0..self.groups.len() {
            self.swap_in_for_step(gi)?;
            self.optimizer.step_group(
                &mut self.groups[gi],
                sv,
                tile,
                self.nvme.as_ref(),
                &*self.be,
            )?;
            self.swap_out_after_step(gi, &mut writing)?;
        }
        while !writing.is_empty() {
            self.finish_swap_write(&mut writing)?;
        }
        self.timings.optimizer += t.elapsed().as_secs_f64();
        let t = Instant::now();
        let bucket = self.cfg.zero.allgather_bucket_size;
        let shards = shard_comm(self.comm.as_ref(), &self.hybrid);
        for g in &mut self.groups {
            self.stage.publish(g, shards, bucket, &mut self.ledger)?;
        }
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

    /// Whether any rank's owned gradients contain Inf or NaN.
    fn any_overflow(&self) -> Result<bool> {
        let rank = self.shard_rank();
        let mut local = false;
        for g in &self.groups {
            let r = g.layout.shard_range(rank);
            if g.grad
                .has_non_finite(r.start - g.grad_offset..r.end - g.grad_offset)?
            {
                local = true;
                break;
            }
        }
        let mut v = [if local { 1.0f32 } else { 0.0 }];
        self.comm.all_reduce(BufMut::F32(&mut v), ReduceOp::Max)?;
        Ok(v[0] > 0.0)
    }

    /// The global L2 norm of the (still loss-scaled) gradients. Every stage sums the same
    /// elements in the same order: each rank its shard range, groups in order, then ranks in
    /// rank order, so the norm is bitwise equal across stages.
    fn global_norm(&self) -> Result<f64> {
        let rank = self.shard_rank();
        let mut scratch = Vec::new();
        // -0.0 is what `Iterator::sum` starts from: the same bits for an all-zero gradient.
        let mut local = -0.0f64;
        for g in &self.groups {
            let r = g.layout.shard_range(rank);
            local += g
                .grad
                .sum_squares(r.start - g.grad_offset..r.end - g.grad_offset, &mut scratch)?;
        }
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
