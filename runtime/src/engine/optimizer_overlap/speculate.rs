//! The lane's side of a speculative step and its undoing.
//!
//! The lane steps each group with clipping coefficient 1 as soon as its gradient is final,
//! after saving the group's optimizer values ([`Snapshot`]). After backward the step learns
//! the global norm and whether any rank overflowed: when its values equal the lane's, the
//! speculation stands and only groups the lane did not step are stepped; when clipping binds
//! or the step is skipped, every stepped group's values are written back from its snapshot
//! and the step runs (or is skipped) exactly as without overlap.
//!
//! The lane also stops speculating as soon as this rank's own gradients prove that the
//! speculation must fail: an Inf or NaN (the step will be skipped), or a partial sum of
//! squares whose norm alone exceeds the clipping threshold (the global norm is at least as
//! large). Groups after that point are not stepped or saved, so a binding step wastes only
//! the lane's work up to the point where the bound was crossed. Stopping never changes a bit:
//! groups the lane leaves alone are stepped after backward with the step's real values.

use std::sync::{Arc, Mutex};

use super::snapshot::Snapshot;
use crate::backend::Backend;
use crate::engine::group::Group;
use crate::engine::nvme::NvmeOffload;
use crate::engine::offload_copies::Inbound;
use crate::engine::optimizer::{Optimizer, StepValues};
use crate::engine::trace::Trace;
use crate::{Error, Result};

/// Relative margin on the clipping threshold before the lane stops speculating: far above the
/// rounding between the lane's partial sum (in lending order, f64) and the step's norm (group
/// order, then f32 across ranks), so a stop is only ever taken when clipping surely binds.
const STOP_MARGIN: f64 = 1e-4;

/// What the lane knows of the step while backward runs: this rank's sum of squares so far.
#[derive(Debug)]
pub(super) struct Watch {
    /// The (loss-scaled) sum of squares past which clipping surely binds; `None` without
    /// clipping.
    limit: Option<f64>,
    partial: f64,
    stopped: bool,
}

impl Watch {
    /// The watch of a step with clipping threshold `clip` (0: none) and loss scale `scale`.
    pub(super) fn new(clip: f64, scale: f64) -> Self {
        let limit = (clip > 0.0).then(|| (clip * (1.0 + STOP_MARGIN) * scale).powi(2));
        Self {
            limit,
            partial: 0.0,
            stopped: false,
        }
    }

    /// Adds a group's sum of squares; whether the lane should still step it.
    fn admit(&mut self, sumsq: f64) -> bool {
        if !self.stopped {
            self.partial += sumsq;
            let binds = self.limit.is_some_and(|l| self.partial > l);
            self.stopped = !self.partial.is_finite() || binds;
        }
        !self.stopped
    }
}

/// What the lane did with one group.
#[derive(Debug, Clone, Copy)]
pub(super) struct Outcome {
    /// The group's owned gradient's sum of squares, as the step's norm computes it.
    pub(super) sumsq: f64,
    /// Whether the lane updated the group.
    pub(super) stepped: bool,
}

/// One group's job on the optimizer lane.
pub(super) struct LaneStep {
    pub(super) g: usize,
    /// The rank in the shard group (which range of the gradient the norm sums).
    pub(super) rank: usize,
    pub(super) sv: StepValues,
    pub(super) watch: Arc<Mutex<Watch>>,
    pub(super) opt: Optimizer,
    pub(super) be: Arc<dyn Backend>,
    pub(super) trace: Trace,
    pub(super) tile: usize,
    pub(super) nvme: Option<Arc<NvmeOffload>>,
}

impl LaneStep {
    /// Sums the group's squared gradient, then saves and steps it unless the watch says
    /// stop; the group and its snapshot come back whatever happened.
    pub(super) fn run(
        self,
        mut group: Group,
        mut snap: Option<Snapshot>,
        inbound: Inbound,
    ) -> (Group, Option<Snapshot>, Result<Outcome>) {
        let r = self.step(&mut group, snap.as_mut(), inbound);
        (group, snap, r)
    }

    fn step(
        &self,
        group: &mut Group,
        snap: Option<&mut Snapshot>,
        inbound: Inbound,
    ) -> Result<Outcome> {
        let r = group.layout.shard_range(self.rank);
        let base = group.grad_offset;
        // Through the backend, as the step's own status: the device's order of additions
        // wherever the gradient accumulated, so the lane's term is the step's bits.
        let view = group.grad_view(r.start - base..r.end - base)?;
        let sumsq = self.be.step_status(&[], &[view])?.sum_squares[0];
        let go = self.watch.lock().is_ok_and(|mut w| w.admit(sumsq));
        if !go {
            return Ok(Outcome {
                sumsq,
                stepped: false,
            });
        }
        self.trace.span("optimizer", "step", self.g, || {
            if let Some(s) = snap {
                s.save(group, &*self.be)?;
            }
            let nvme = self.nvme.as_deref();
            self.opt
                .step_group(group, &self.sv, self.tile, nvme, &*self.be, inbound)
        })?;
        Ok(Outcome {
            sumsq,
            stepped: true,
        })
    }
}

/// What the optimizer lane did during the backward that ended a step.
#[derive(Debug)]
pub(in crate::engine) struct Overlapped {
    /// The values it stepped with.
    pub(in crate::engine) sv: StepValues,
    /// Which groups it stepped.
    pub(in crate::engine) stepped: Vec<bool>,
    /// Each lent group's owned sum of squares (the norm's term for that group).
    pub(in crate::engine) sumsq: Vec<Option<f64>>,
    /// Whether its steps were saved first and can be undone.
    pub(in crate::engine) speculative: bool,
}

impl super::OptimizerLane {
    /// Writes every `stepped` group's saved optimizer values back into `groups`.
    pub(in crate::engine) fn roll_back(
        &mut self,
        (groups, stepped): (&mut [Group], &[bool]),
        be: &dyn Backend,
        trace: &Trace,
    ) -> Result<()> {
        let super::OptimizerLane::On(w) = self else {
            return Ok(());
        };
        for g in (0..groups.len()).filter(|&g| stepped[g]) {
            let snap = w
                .snapshots
                .get_mut(g)
                .and_then(Option::as_mut)
                .ok_or_else(|| {
                    Error::Invalid(format!(
                        "group {g} was stepped on the lane without a snapshot"
                    ))
                })?;
            let group = &mut groups[g];
            // The lane's uploads land before the saved values are written over them.
            group.landing.await_on(be)?;
            trace.span("compute", "rollback", g, || snap.restore(group, be))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::Watch;

    #[test]
    fn the_watch_stops_at_a_non_finite_sum_or_a_norm_past_the_threshold() {
        // Scale 4, threshold 1: stop once the scaled sum of squares passes (4 * 1.0001)^2.
        let mut w = Watch::new(1.0, 4.0);
        assert!(w.admit(10.0));
        assert!(w.admit(6.0));
        assert!(w.admit(0.0));
        assert!(!w.admit(0.01), "16.01 > 16.0032");
        assert!(!w.admit(0.0), "stays stopped");
        let mut nan = Watch::new(0.0, 1.0);
        assert!(nan.admit(1e30), "no clipping: no threshold");
        assert!(!nan.admit(f64::INFINITY));
        assert!(!nan.admit(1.0));
    }
}
