//! The optimizer step overlapped with backward (the optimizer lane). At the accumulation
//! boundary of `train_batch`, each group is lent to the optimizer lane as soon as its
//! gradient is final (reduced and accumulated: a unit's group right after its backward, the
//! shared group after its first user, which backward reaches last) and stepped there while
//! backward goes on with earlier units; [`Engine::step`] takes every group back before it
//! reads gradients again. The update is the one the step would run, on the same buffers with
//! the same values, so the parameters are bitwise those of the non-overlapped order.
//!
//! It needs the step's values before backward ends, so it is on only when nothing global
//! decides them: no gradient clipping (the coefficient needs the global norm) and no fp16
//! dynamic loss scale (it decides after backward whether to skip); the schedule's learning
//! rate and momentum of step `k` depend on `k` alone.

use std::time::Instant;

use ferrozero_config::resolved::{LossScaling, OffloadTarget, Precision, ResolvedConfig};

use super::core::Engine;
use super::group::{Group, ParamStore};
use super::lane::{Lane, Ticket};
use super::optimizer::StepValues;
use crate::backend::Stream;
use crate::{Error, Result};

/// Whether the optimizer step overlaps backward, and why not when it does not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OptimizerOverlap {
    /// Each group's step starts on the optimizer lane as soon as its gradient is final.
    On,
    /// The step runs after backward; the reason names what keeps it there.
    Off(String),
}

impl OptimizerOverlap {
    /// The decision for a config. The trigger is optimizer state offloaded to the host or
    /// NVMe (where the compute device would otherwise wait for the CPU step) with
    /// `overlap_comm` on (the overlap switch DeepSpeed users already set).
    pub fn decide(cfg: &ResolvedConfig) -> Self {
        let off = |why: &str| OptimizerOverlap::Off(why.to_string());
        if cfg.zero.offload_optimizer.target == OffloadTarget::None {
            return off("the optimizer state is not offloaded (offload_optimizer.device = none)");
        }
        if !cfg.zero.overlap_comm {
            return off("overlap_comm is off");
        }
        if cfg.gradient_clipping > 0.0 {
            return OptimizerOverlap::Off(format!(
                "gradient_clipping={:?} needs the global norm first",
                cfg.gradient_clipping
            ));
        }
        if let Precision::Fp16(LossScaling::Dynamic { .. }) = cfg.precision {
            return off(
                "fp16's dynamic loss scale decides after backward whether to skip the step",
            );
        }
        if let OffloadTarget::Nvme(_) = cfg.zero.offload_param.target {
            return off(
                "offload_param.device = nvme swaps parameter shards around the step on the \
                 engine's thread",
            );
        }
        OptimizerOverlap::On
    }

    /// The run's one log line about it, when the config offloads the optimizer state (where
    /// a user would look for the overlap); silent otherwise.
    pub(super) fn log(&self, cfg: &ResolvedConfig) {
        if cfg.zero.offload_optimizer.target == OffloadTarget::None {
            return;
        }
        match self {
            OptimizerOverlap::On => tracing::info!(
                "optimizer overlap on: each group's step starts on the optimizer lane when its \
                 gradient is final"
            ),
            OptimizerOverlap::Off(why) => tracing::info!("optimizer overlap off: {why}"),
        }
    }
}

/// A group on the optimizer lane: it comes back with its update's result, failed or not.
type Lent = Ticket<(Group, Result<()>)>;

/// The optimizer lane and the step in flight on it.
pub(super) struct OptimizerLane {
    lane: Lane,
    /// The values of the step that the current backward ends; `None` between steps.
    armed: Option<StepValues>,
    /// Groups on the lane, in submission order; each comes back with its update's result.
    /// Between arming and joining, these are exactly the groups the armed step has lent.
    lent: Vec<(usize, Lent)>,
}

impl OptimizerLane {
    /// The optimizer lane of rank `rank`.
    pub(super) fn new(rank: usize) -> Result<Self> {
        Ok(Self {
            lane: Lane::new(&format!("fz-optim-{rank}"))?,
            armed: None,
            lent: Vec::new(),
        })
    }
}

impl Engine {
    /// The values of optimizer step `self.steps`, gradients multiplied by `grad_scale`.
    pub(super) fn step_values(&self, grad_scale: f32) -> StepValues {
        let k = self.steps;
        StepValues {
            step: k + 1,
            lr: self.schedule.lr_at(k),
            beta1: self.schedule.momentum_at(k),
            grad_scale,
        }
    }

    /// Arms the optimizer lane for the backward that ends this accumulation (only `train_batch`
    /// does: it takes the step right after, so no later micro-step can add to a gradient the
    /// lane already used). Without clipping the coefficient is 1, as the step computes it.
    pub(super) fn arm_optimizer_lane(&mut self) {
        if self.optimizer_lane.is_none() {
            return;
        }
        let sv = self.step_values((1.0 / self.scaler.scale()) as f32);
        if let Some(w) = &mut self.optimizer_lane {
            w.armed = Some(sv);
        }
    }

    /// Called when group `g`'s gradient is final: lends the group to the optimizer lane when
    /// the optimizer lane is armed, leaving a stand-in in its place.
    pub(super) fn lend_for_step(&mut self, g: usize) -> Result<()> {
        let Some(w) = self.optimizer_lane.as_mut() else {
            return Ok(());
        };
        let Some(sv) = w.armed else {
            return Ok(());
        };
        let gathered = matches!(
            self.groups[g].params,
            ParamStore::Partitioned {
                gathered: Some(_),
                ..
            }
        );
        if w.lent.iter().any(|(x, _)| *x == g) || gathered || self.groups[g].work.is_some() {
            return Err(Error::Invalid(format!(
                "group {g} reached the optimizer lane twice or still gathered"
            )));
        }
        // The gradient's last addition may still be running on the device's compute stream:
        // the lane waits for this event, the engine's thread goes on with backward.
        let ready = self.be.record(Stream::Compute)?;
        let stand_in = self.groups[g].stand_in();
        let mut group = std::mem::replace(&mut self.groups[g], stand_in);
        let (opt, be, trace) = (self.optimizer.clone(), self.be.clone(), self.trace.clone());
        let (tile, nvme) = (self.cfg.zero.sub_group_size.max(1), self.nvme.clone());
        let t = w.lane.submit("optimizer step", move || {
            let r = trace.span("optimizer", "step", g, || {
                ready.synchronize()?;
                opt.step_group(&mut group, &sv, tile, nvme.as_deref(), &*be)
            });
            Ok((group, r))
        });
        w.lent.push((g, t));
        Ok(())
    }

    /// Ends the armed step's overlap: takes every lent group back and steps, here, any group
    /// backward did not lend. Returns the values the lane used, or `None` when this step was
    /// not armed (the step then runs after backward as usual).
    pub(super) fn join_optimizer_lane(&mut self) -> Result<Option<StepValues>> {
        let Some(sv) = self.optimizer_lane.as_mut().and_then(|w| w.armed.take()) else {
            return Ok(None);
        };
        let mut stepped = vec![false; self.groups.len()];
        for (g, _) in self.optimizer_lane.iter().flat_map(|w| &w.lent) {
            stepped[*g] = true;
        }
        let t = Instant::now();
        let back = self.take_back_lent();
        self.timings.optimizer += t.elapsed().as_secs_f64();
        back?;
        let tile = self.cfg.zero.sub_group_size.max(1);
        for g in (0..self.groups.len()).filter(|&g| !stepped[g]) {
            let (group, nvme) = (&mut self.groups[g], self.nvme.as_deref());
            self.optimizer
                .step_group(group, &sv, tile, nvme, &*self.be)?;
        }
        Ok(Some(sv))
    }

    /// Abandons an armed step after its backward failed: lent groups come back (those the
    /// lane already stepped stay stepped: the error stops the run), no other group is stepped.
    pub(super) fn disarm_optimizer_lane(&mut self) -> Result<()> {
        if let Some(w) = self.optimizer_lane.as_mut() {
            w.armed = None;
        }
        self.take_back_lent()
    }

    /// Waits for every lent group, in submission order, and puts it back; the first error
    /// (a failed update, or a lane that stopped and lost its group) comes after all others
    /// were taken back.
    fn take_back_lent(&mut self) -> Result<()> {
        let lent = match self.optimizer_lane.as_mut() {
            Some(w) => std::mem::take(&mut w.lent),
            None => return Ok(()),
        };
        let mut first = Ok(());
        for (g, ticket) in lent {
            let r = ticket.wait().and_then(|(group, r)| {
                self.groups[g] = group;
                r
            });
            first = first.and(r);
        }
        first
    }
}

/// The error for gradients that overflowed in a step the optimizer lane already applied: the
/// non-overlapped order skips such a step, which an applied update cannot undo bit for bit.
pub(super) fn overlapped_overflow(step: u64) -> Error {
    Error::Training(format!(
        "step {step}: the gradients hold Inf or NaN, but the optimizer overlapped with backward \
         had already updated the parameters (offload_optimizer with overlap_comm and no \
         gradient clipping); the non-overlapped order would have skipped this step. Resume \
         from the last checkpoint with gradient_clipping > 0 or overlap_comm = false, which \
         step after backward and skip overflowing steps"
    ))
}
