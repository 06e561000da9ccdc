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

use ferrozero_config::resolved::{
    LossScaling, OffloadTarget, OptimizerConfig, Precision, ResolvedConfig,
};

use super::group::{Group, ParamStore};
use super::lane::{Lane, Ticket};
use super::ledger::Ledger;
use super::nvme::NvmeOffload;
use super::optimizer::{Optimizer, StepValues};
use super::trace::Trace;
use crate::backend::Backend;
use crate::nn::Model;
use crate::{Error, Result};

pub use host::{overlap_on_host, HostNeed};
pub(super) use snapshot::snapshot_plan;
use snapshot::Snapshot;
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
        if let OptimizerConfig::Lamb { .. } = cfg.optimizer {
            return off(
                "optimizer.type = Lamb: each tensor's trust ratio needs every rank's partial \
                 norms of it, so its step follows backward",
            );
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

/// The snapshots of a run, by the plan the lane makes: what an estimate reports and a
/// bounded speculation is planned from.
pub(in crate::engine) struct SnapshotFigures {
    /// Each group's snapshot bytes were it snapshotted, in the engine's group order.
    pub groups: Vec<u64>,
    /// The bytes of the snapshots the overlap takes (0 unless it is speculative).
    pub taken: u64,
    /// Of `taken`, those held in the device's page-locked staging memory.
    pub taken_locked: u64,
}

/// The [`SnapshotFigures`] of `groups` under `overlap` (`shared`: the tied group's index).
pub(in crate::engine) fn snapshot_figures(
    overlap: &OptimizerOverlap,
    groups: &[Group],
    shared: Option<usize>,
) -> SnapshotFigures {
    let bytes: Vec<u64> = groups.iter().map(Snapshot::bytes_of).collect();
    let plan = match overlap {
        OptimizerOverlap::Speculative(_, budget) => snapshot_plan(&bytes, shared, *budget),
        _ => vec![false; bytes.len()],
    };
    let taken = || groups.iter().zip(&plan).filter(|(_, &p)| p).map(|(g, _)| g);
    SnapshotFigures {
        taken: taken().map(Snapshot::bytes_of).sum(),
        taken_locked: taken().map(Snapshot::locked_bytes_of).sum(),
        groups: bytes,
    }
}

/// A group on the optimizer lane: it comes back with its snapshot and what the lane did.
type Lent = Ticket<(Group, Option<Snapshot>, Result<Outcome>)>;

/// The step the current backward ends.
struct Armed {
    sv: StepValues,
    watch: Arc<Mutex<Watch>>,
}

/// The optimizer lane: off (the step follows backward), or the lane and the step in flight
/// on it.
pub(super) enum OptimizerLane {
    /// The optimizer step does not overlap backward.
    Off,
    /// The lane.
    On(LaneState),
}

/// The optimizer lane and the step in flight on it.
pub(super) struct LaneState {
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

/// What a lent group's job needs from the engine besides the group.
pub(super) struct LendCtx<'a> {
    /// The rank in the shard group (which range of the gradient the norm sums).
    pub(super) rank: usize,
    /// The update rule.
    pub(super) opt: &'a Optimizer,
    /// The device.
    pub(super) be: &'a Arc<dyn Backend>,
    /// The recorded schedule.
    pub(super) trace: &'a Trace,
    /// Elements per tile of the update (`sub_group_size`).
    pub(super) tile: usize,
    /// The NVMe store of the optimizer state, if it lives there.
    pub(super) nvme: Option<&'a Arc<NvmeOffload>>,
}

impl OptimizerLane {
    /// The optimizer lane of rank `rank` for `overlap` (off when it is), with snapshots
    /// of the planned `groups` when it is speculative; `shared` is the tied group's index.
    pub(super) fn for_overlap(
        overlap: &OptimizerOverlap,
        rank: usize,
        (groups, shared): (&[Group], Option<usize>),
        ledger: &mut Ledger,
    ) -> Result<Self> {
        let planned = match overlap {
            OptimizerOverlap::Off(_) => return Ok(OptimizerLane::Off),
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
        Ok(OptimizerLane::On(LaneState {
            lane: Lane::new(&format!("fz-optim-{rank}"))?,
            armed: None,
            lent: Vec::new(),
            planned,
            snapshots,
        }))
    }

    /// Whether the lane's steps are saved first and can be undone.
    fn speculative(&self) -> bool {
        matches!(self, OptimizerLane::On(w) if w.speculative())
    }

    /// Arms the write-behind for the backward that ends this accumulation, to step with
    /// `sv` (only `train_batch` does: it takes the step right after, so no later micro-step
    /// can add to a gradient the lane already used). The lane assumes clipping coefficient 1,
    /// as the step computes it when clipping does not bind (`clip`, at loss scale `scale`).
    pub(super) fn arm(&mut self, sv: StepValues, clip: f64, scale: f64) {
        if let OptimizerLane::On(w) = self {
            let watch = Arc::new(Mutex::new(Watch::new(clip, scale)));
            w.armed = Some(Armed { sv, watch });
        }
    }

    /// Called when group `g` of `groups` has its final gradient: lends the group to the
    /// lane when the write-behind is armed, leaving a stand-in in its place.
    pub(super) fn lend(
        &mut self,
        (g, groups): (usize, &mut [Group]),
        ctx: LendCtx<'_>,
    ) -> Result<()> {
        let OptimizerLane::On(w) = self else {
            return Ok(());
        };
        let Some(armed) = &w.armed else {
            return Ok(());
        };
        let gathered = matches!(
            groups[g].params,
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
            || groups[g].work.is_some()
            || (w.speculative() && snap.is_none())
        {
            return Err(Error::Invalid(format!(
                "group {g} reached the optimizer lane twice or still gathered"
            )));
        }
        // The gradient's last addition may still be running on the device's compute stream:
        // its download is queued behind it on the copy stream, the lane waits for that copy
        // alone and the engine's thread goes on with backward.
        let inbound = ctx.opt.fetch(&groups[g], &**ctx.be)?;
        let stand_in = groups[g].stand_in();
        let group = std::mem::replace(&mut groups[g], stand_in);
        let job = speculate::LaneStep {
            g,
            rank: ctx.rank,
            sv: armed.sv,
            watch: armed.watch.clone(),
            opt: ctx.opt.clone(),
            be: ctx.be.clone(),
            trace: ctx.trace.clone(),
            tile: ctx.tile,
            nvme: ctx.nvme.cloned(),
        };
        let t = w
            .lane
            .submit("optimizer step", move || Ok(job.run(group, snap, inbound)));
        w.lent.push((g, t));
        Ok(())
    }

    /// Ends the armed step's overlap: takes every lent group back into `groups` (the wait
    /// added to `waited`). Returns what the lane did (the values it stepped with, which
    /// groups it stepped, each lent group's sum of squares), or `None` when this step was
    /// not armed.
    pub(super) fn join(
        &mut self,
        groups: &mut [Group],
        waited: &mut f64,
    ) -> Result<Option<Overlapped>> {
        let OptimizerLane::On(w) = self else {
            return Ok(None);
        };
        let Some(armed) = w.armed.take() else {
            return Ok(None);
        };
        let speculative = w.speculative();
        let t = Instant::now();
        let back = self.take_back(groups);
        *waited += t.elapsed().as_secs_f64();
        let n = groups.len();
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

    /// Abandons an armed step after its backward failed: lent groups come back into
    /// `groups`; returns which groups a speculative step stepped (to undo: a step that was not
    /// speculative stays applied, the error stops the run).
    pub(super) fn disarm(&mut self, groups: &mut [Group]) -> Result<Option<Vec<bool>>> {
        if let OptimizerLane::On(w) = self {
            w.armed = None;
        }
        let back = self.take_back(groups)?;
        if !self.speculative() {
            return Ok(None);
        }
        let mut stepped = vec![false; groups.len()];
        for (g, o) in back {
            stepped[g] = o.stepped;
        }
        Ok(Some(stepped))
    }

    /// Waits for every lent group, in submission order, and puts it (and its snapshot) back;
    /// the first error (a failed update, or a lane that stopped and lost its group) comes
    /// after all others were taken back.
    fn take_back(&mut self, groups: &mut [Group]) -> Result<Vec<(usize, Outcome)>> {
        let OptimizerLane::On(w) = self else {
            return Ok(Vec::new());
        };
        let lent = std::mem::take(&mut w.lent);
        let mut first = Ok(());
        let mut done = Vec::with_capacity(lent.len());
        for (g, ticket) in lent {
            let r = ticket.wait().and_then(|(group, snap, r)| {
                groups[g] = group;
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

impl LaneState {
    fn speculative(&self) -> bool {
        !self.planned.is_empty()
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
