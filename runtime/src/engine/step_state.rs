//! The step's state: the optimizer and what shapes its update (schedule, loss scale), where
//! its state lives (NVMe), whether it overlaps backward, and how many steps were taken.

use super::loss_scale::LossScaler;
use super::nvme::OptimizerStore;
use super::optimizer::{Optimizer, StepValues};
use super::optimizer_overlap::{OptimizerLane, OptimizerOverlap};
use super::schedule::Schedule;

/// The optimizer step's state across steps.
pub(super) struct StepState {
    /// The update rule.
    pub(super) optimizer: Optimizer,
    /// The learning rate (and momentum) schedule.
    pub(super) schedule: Schedule,
    /// fp16's loss scale (static or dynamic), or none.
    pub(super) scaler: LossScaler,
    /// Whether the optimizer step overlaps backward (and why not).
    pub(super) overlap: OptimizerOverlap,
    /// The optimizer lane, or off.
    pub(super) lane: OptimizerLane,
    /// The optimizer state's NVMe store, or memory.
    pub(super) nvme: OptimizerStore,
    /// Optimizer steps taken (skipped ones included).
    pub(super) steps: u64,
}

impl StepState {
    /// The values of optimizer step `steps`, gradients multiplied by `grad_scale`.
    pub(super) fn values(&self, grad_scale: f32) -> StepValues {
        let k = self.steps;
        StepValues {
            step: k + 1,
            lr: self.schedule.lr_at(k),
            beta1: self.schedule.momentum_at(k),
            grad_scale,
        }
    }
}
