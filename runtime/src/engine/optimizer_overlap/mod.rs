//! The optimizer step overlapped with backward (gradient write-behind). At the accumulation
//! boundary of `train_batch`, each group is lent to the optimizer lane as soon as its
//! gradient is final (reduced and accumulated: a unit's group right after its backward, the
//! shared group after its first user, which backward reaches last) and stepped there while
//! backward goes on with earlier units; [`Engine::step`] takes every group back before it
//! reads gradients again. The lane also sums each group's squared gradient as it arrives, the
//! term the step's norm would compute, so the step does not read the gradients a second time.
//!
//! The lane steps with the values the step takes when nothing global intervenes: clipping
//! coefficient 1 and no overflow. When nothing global can decide otherwise (no clipping, no
//! fp16 dynamic scale) that is exact ([`OptimizerOverlap::On`]); otherwise the step is a
//! speculation ([`OptimizerOverlap::Speculative`], `speculate.rs`): each group's optimizer
//! values are saved before its update and written back bit for bit when clipping binds or
//! the step overflows, and the step then runs after backward as without overlap. The
//! schedule's learning rate and momentum of step `k` depend on `k` alone.

mod host;
mod snapshot;
mod speculate;

use std::sync::{Arc, Mutex};
use std::time::Instant;

use ferrozero_config::resolved::{LossScaling, OffloadTarget, Precision, ResolvedConfig};

use super::core::Engine;
use super::group::{Group, ParamStore};
use super::lane::{Lane, Ticket};
use super::ledger::Ledger;
use super::optimizer::StepValues;
use crate::nn::Model;
use crate::{Error, Result};

pub use host::{overlap_on_host, HostNeed};
use snapshot::Snapshot;
pub(super) use snapshot::{snapshot_bytes, snapshot_plan};
pub(super) use speculate::Overlapped;
use speculate::{Outcome, Watch};

/// Whether the optimizer step overlaps backward, and why not when it does not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OptimizerOverlap {
    /// Each group's step starts on the optimizer lane as soon as its gradient is final.
    On,
    /// As `On`, but a global value (named first) may still change the step after backward:
    /// each lent group's optimizer values are saved first and restored exactly when it does.
    /// Second: the snapshot bytes this rank may hold (`None`: every group's); within a bound
    /// only the groups backward finishes first are lent ([`snapshot_plan`]), the others are
    /// stepped after backward with the values the step decides.
    Speculative(String, Option<u64>),
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
        if let OffloadTarget::Nvme(_) = cfg.zero.offload_param.target {
            return off(
                "offload_param.device = nvme swaps parameter shards around the step on the \
                 engine's thread",
            );
        }
        let global = if cfg.gradient_clipping > 0.0 {
            format!(
                "gradient_clipping={:?} needs the global norm",
                cfg.gradient_clipping
            )
        } else if let Precision::Fp16(LossScaling::Dynamic { .. }) = cfg.precision {
            "fp16's dynamic loss scale decides after backward whether to skip the step".into()
        } else {
            return OptimizerOverlap::On;
        };
        if let OffloadTarget::Nvme(_) = cfg.zero.offload_optimizer.target {
            return OptimizerOverlap::Off(format!(
                "{global}, and optimizer state on NVMe is not snapshotted for a rollback"
            ));
        }
        OptimizerOverlap::Speculative(global, None)
    }

    /// Its name in `ferrozero estimate`'s report: `on`, `speculative` or `off`.
    pub fn name(&self) -> &'static str {
        match self {
            OptimizerOverlap::On => "on",
            OptimizerOverlap::Speculative(..) => "speculative",
            OptimizerOverlap::Off(_) => "off",
        }
    }

    /// Why it is as it is, in one line.
    pub fn reason(&self) -> String {
        match self {
            OptimizerOverlap::On => "nothing global changes the step after backward".into(),
            OptimizerOverlap::Speculative(why, _) | OptimizerOverlap::Off(why) => why.clone(),
        }
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
            OptimizerOverlap::Speculative(..) => tracing::info!(
                "optimizer overlap on, speculative ({}): each lent group's values are saved \
                 before its step and restored when clipping binds or the step overflows",
                self.reason()
            ),
            OptimizerOverlap::Off(why) => tracing::info!("optimizer overlap off: {why}"),
        }
    }
}

/// The index of `model`'s shared group (its tied parameters), which the engine places after
/// every unit's: backward makes it final last.
pub fn shared_group(model: &Model) -> Option<usize> {
    (!model.shared.is_empty()).then_some(model.units.len())
}

/// A group on the optimizer lane: it comes back with its snapshot and what the lane did.
type Lent = Ticket<(Group, Option<Snapshot>, Result<Outcome>)>;

/// The step the current backward ends.
struct Armed {
    sv: StepValues,
    watch: Arc<Mutex<Watch>>,
}

/// The optimizer lane and the step in flight on it.
pub(super) struct OptimizerLane {
    lane: Lane,
    /// The step that the current backward ends; `None` between steps.
    armed: Option<Armed>,
    /// Groups on the lane, in submission order. Between arming and joining, these are
    /// exactly the groups the armed step has lent.
    lent: Vec<(usize, Lent)>,
    /// When the overlap is speculative, which groups are lent (and snapshotted); empty
    /// otherwise, when every group is lent.
    planned: Vec<bool>,
    /// One snapshot per planned group when the overlap is speculative; a lent group's
    /// travels with it.
    snapshots: Vec<Option<Snapshot>>,
}

impl OptimizerLane {
    /// The optimizer lane of rank `rank` for `overlap` (none when it is off), with snapshots
    /// of the planned `groups` when it is speculative; `shared` is the tied group's index.
    pub(super) fn for_overlap(
        overlap: &OptimizerOverlap,
        rank: usize,
        (groups, shared): (&[Group], Option<usize>),
        ledger: &mut Ledger,
    ) -> Result<Option<Self>> {
        let planned = match overlap {
            OptimizerOverlap::Off(_) => return Ok(None),
            OptimizerOverlap::On => Vec::new(),
            OptimizerOverlap::Speculative(_, budget) => {
                let bytes: Vec<u64> = groups.iter().map(Snapshot::bytes_of).collect();
                snapshot_plan(&bytes, shared, *budget)
            }
        };
        let snapshots = groups
            .iter()
            .zip(&planned)
            .map(|(g, &p)| p.then(|| Snapshot::for_group(g, ledger)))
            .collect();
        Ok(Some(Self {
            lane: Lane::new(&format!("fz-optim-{rank}"))?,
            armed: None,
            lent: Vec::new(),
            planned,
            snapshots,
        }))
    }

    fn speculative(&self) -> bool {
        !self.planned.is_empty()
    }
}

impl Engine {
    /// The values of optimizer step `self.opt.steps`, gradients multiplied by `grad_scale`.
    pub(super) fn step_values(&self, grad_scale: f32) -> StepValues {
        let k = self.opt.steps;
        StepValues {
            step: k + 1,
            lr: self.opt.schedule.lr_at(k),
            beta1: self.opt.schedule.momentum_at(k),
            grad_scale,
        }
    }

    /// Arms the write-behind for the backward that ends this accumulation (only `train_batch`
    /// does: it takes the step right after, so no later micro-step can add to a gradient the
    /// lane already used). The lane assumes clipping coefficient 1, as the step computes it
    /// when clipping does not bind.
    pub(super) fn arm_optimizer_lane(&mut self) {
        if self.opt.lane.is_none() {
            return;
        }
        let scale = self.opt.scaler.scale();
        let sv = self.step_values((1.0 / scale) as f32);
        let watch = Watch::new(self.cfg.gradient_clipping, scale);
        if let Some(w) = &mut self.opt.lane {
            let watch = Arc::new(Mutex::new(watch));
            w.armed = Some(Armed { sv, watch });
        }
    }

    /// Called when group `g`'s gradient is final: lends the group to the optimizer lane when
    /// the write-behind is armed, leaving a stand-in in its place.
    pub(super) fn lend_for_step(&mut self, g: usize) -> Result<()> {
        let rank = self.shard_rank();
        let Some(w) = self.opt.lane.as_mut() else {
            return Ok(());
        };
        let Some(armed) = &w.armed else {
            return Ok(());
        };
        let gathered = matches!(
            self.groups[g].params,
            ParamStore::Partitioned {
                gathered: Some(_),
                ..
            }
        );
        // Beyond the snapshots' bound a group waits for the step after backward.
        if w.speculative() && !w.planned.get(g).copied().unwrap_or(false) {
            return Ok(());
        }
        let snap = w.snapshots.get_mut(g).and_then(Option::take);
        if w.lent.iter().any(|(x, _)| *x == g)
            || gathered
            || self.groups[g].work.is_some()
            || (w.speculative() && snap.is_none())
        {
            return Err(Error::Invalid(format!(
                "group {g} reached the optimizer lane twice or still gathered"
            )));
        }
        // The gradient's last addition may still be running on the device's compute stream:
        // its download is queued behind it on the copy stream, the lane waits for that copy
        // alone and the engine's thread goes on with backward.
        let inbound = self.opt.optimizer.fetch(&self.groups[g], &*self.be)?;
        let stand_in = self.groups[g].stand_in();
        let group = std::mem::replace(&mut self.groups[g], stand_in);
        let job = speculate::LaneStep {
            g,
            rank,
            sv: armed.sv,
            watch: armed.watch.clone(),
            opt: self.opt.optimizer.clone(),
            be: self.be.clone(),
            trace: self.obs.trace.clone(),
            tile: self.cfg.zero.sub_group_size.max(1),
            nvme: self.opt.nvme.clone(),
        };
        let t = w
            .lane
            .submit("optimizer step", move || Ok(job.run(group, snap, inbound)));
        w.lent.push((g, t));
        Ok(())
    }

    /// Ends the armed step's overlap: takes every lent group back. Returns what the lane did
    /// (the values it stepped with, which groups it stepped, each lent group's sum of
    /// squares), or `None` when this step was not armed.
    pub(super) fn join_optimizer_lane(&mut self) -> Result<Option<Overlapped>> {
        let Some(w) = self.opt.lane.as_mut() else {
            return Ok(None);
        };
        let Some(armed) = w.armed.take() else {
            return Ok(None);
        };
        let speculative = w.speculative();
        let t = Instant::now();
        let back = self.take_back_lent();
        self.obs.timings.optimizer += t.elapsed().as_secs_f64();
        let n = self.groups.len();
        let mut lane = Overlapped {
            sv: armed.sv,
            stepped: vec![false; n],
            sumsq: vec![None; n],
            speculative,
        };
        for (g, o) in back? {
            lane.stepped[g] = o.stepped;
            lane.sumsq[g] = Some(o.sumsq);
        }
        Ok(Some(lane))
    }

    /// Abandons an armed step after its backward failed: lent groups come back, and a
    /// speculative step is undone (a step that was not speculative stays applied: the error
    /// stops the run).
    pub(super) fn disarm_optimizer_lane(&mut self) -> Result<()> {
        if let Some(w) = self.opt.lane.as_mut() {
            w.armed = None;
        }
        let back = self.take_back_lent()?;
        if self
            .opt
            .lane
            .as_ref()
            .is_some_and(OptimizerLane::speculative)
        {
            let mut stepped = vec![false; self.groups.len()];
            for (g, o) in back {
                stepped[g] = o.stepped;
            }
            self.roll_back(&stepped)?;
        }
        Ok(())
    }

    /// Waits for every lent group, in submission order, and puts it (and its snapshot) back;
    /// the first error (a failed update, or a lane that stopped and lost its group) comes
    /// after all others were taken back.
    fn take_back_lent(&mut self) -> Result<Vec<(usize, Outcome)>> {
        let Some(w) = self.opt.lane.as_mut() else {
            return Ok(Vec::new());
        };
        let lent = std::mem::take(&mut w.lent);
        let mut first = Ok(());
        let mut done = Vec::with_capacity(lent.len());
        for (g, ticket) in lent {
            let r = ticket.wait().and_then(|(group, snap, r)| {
                self.groups[g] = group;
                if let Some(s) = snap {
                    w.snapshots[g] = Some(s);
                }
                r
            });
            match r {
                Ok(o) => done.push((g, o)),
                Err(e) => first = first.and(Err(e)),
            }
        }
        first.map(|()| done)
    }
}

/// The error for gradients that overflowed in a step the optimizer lane already applied
/// without a snapshot: the non-overlapped order skips such a step, which an applied update
/// cannot undo bit for bit.
pub(super) fn overlapped_overflow(step: u64) -> Error {
    Error::Training(format!(
        "step {step}: the gradients hold Inf or NaN, but the optimizer overlapped with backward \
         had already updated the parameters (offload_optimizer with overlap_comm and no \
         gradient clipping); the non-overlapped order would have skipped this step. Resume \
         from the last checkpoint with gradient_clipping > 0 or overlap_comm = false, which \
         skip overflowing steps exactly"
    ))
}
