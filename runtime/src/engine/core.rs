//! The engine: owns the model's parameter groups and runs forward, backward and the
//! optimizer step through the stage's strategy.

use std::sync::Arc;
use std::time::Instant;

use ferrozero_config::resolved::ResolvedConfig;

use super::build::{optimizer_location, GroupPlan};
use super::group::Group;
use super::ledger::{Category, Ledger, Location};
use super::loss_scale::LossScaler;
use super::nvme::NvmeOffload;
use super::optimizer::Optimizer;
use super::optimizer_overlap::{OptimizerLane, OptimizerOverlap};
use super::overlap::CommOverlap;
use super::param_swap::ParamSwap;
use super::report::Timings;
use super::rules;
use super::schedule::Schedule;
use super::stage::{self, Stage};
use super::topology::{check_backend, open_hybrid, shard_comm};
use super::trace::{Span, Trace};
use crate::backend::Backend;
use crate::comm::Communicator;
use crate::nn::{Batch, BatchIds, Model, Saved};
use crate::tensor::Tensor;
use crate::{Error, Result};

/// A ZeRO training engine for one rank.
pub struct Engine {
    pub(super) cfg: ResolvedConfig,
    pub(super) model: Model,
    pub(super) comm: Box<dyn Communicator>,
    /// The shard-group communicator when hybrid sharding splits the world (see `topology`).
    pub(super) hybrid: Option<crate::comm::hybrid::HybridComm>,
    /// ZeRO++ hpZ's secondary parameter partition and group (see `hpz`).
    pub(super) hpz: Option<super::hpz::Hpz>,
    /// Cross-group payload bytes at the end of the last step (reports carry the difference).
    pub(super) cross_mark: u64,
    /// The device's counts when the current step began (reports carry the difference).
    pub(super) activity_mark: Option<crate::backend::DeviceActivity>,
    /// Gradient bytes handed to reductions since the last step report.
    pub(super) reduced_bytes: u64,
    /// The device the units compute on.
    pub(super) be: Arc<dyn Backend>,
    pub(super) stage: Box<dyn Stage>,
    /// Stage 3 at one rank: shards copied to the device without a collective (before
    /// `groups`, so copies still reading the shards finish before the shards are freed).
    pub(super) param_uploads: super::param_upload::ParamUploads,
    /// One group per unit, then the shared group (if the model has shared parameters).
    pub(super) groups: Vec<Group>,
    pub(super) optimizer: Optimizer,
    pub(super) schedule: Schedule,
    pub(super) scaler: LossScaler,
    pub(super) ledger: Ledger,
    pub(super) saved: Vec<Saved>,
    pub(super) saved_bytes: Vec<u64>,
    /// The input gradient of the last unit's fused forward and backward (`fused.rs`), until
    /// `backward_pass` starts from it.
    pub(super) head_grad: Option<Tensor>,
    /// Checkpointed units' inputs, until their recompute (`ckpt_offload.rs`).
    pub(super) checkpoints: super::ckpt_offload::Checkpoints,
    /// Optimizer steps taken (skipped ones included).
    pub(super) steps: u64,
    /// Micro-steps since the last optimizer step.
    pub(super) micro: usize,
    /// Each micro-step's loss sum, on the device until the step reads them (in order).
    pub(super) losses: Vec<Tensor>,
    pub(super) tokens: u64,
    /// The last forward's batch and its ids on the device, until backward.
    pub(super) last_batch: Option<(Batch, BatchIds)>,
    pub(super) timings: Timings,
    /// The communication worker when `overlap_comm` is on.
    pub(super) overlap: Option<CommOverlap>,
    /// Reduced gradients on their way to host accumulators (optimizer state off the device).
    pub(super) grad_downloads: super::grad_download::GradDownloads,
    /// The NVMe store when optimizer state lives there (shared with the optimizer lane).
    pub(super) nvme: Option<Arc<NvmeOffload>>,
    /// The NVMe store when stage-3 parameter shards live there.
    pub(super) param_swap: Option<ParamSwap>,
    /// NVMe traffic at the end of the last step (reports carry the difference).
    pub(super) traffic_mark: ferrozero_offload::store::Traffic,
    /// The model directory's `config.json` and tokenizer files, saved with each checkpoint.
    pub(super) model_files: crate::nn::weights::ModelFiles,
    /// Whether the optimizer step overlaps backward (and why not).
    pub(super) opt_overlap: OptimizerOverlap,
    /// The optimizer lane when it does.
    pub(super) optimizer_lane: Option<OptimizerLane>,
    /// The recorded schedule (off unless asked for).
    pub(super) trace: Trace,
    /// Monitors and the communication logger.
    pub(super) observers: super::observe::Observers,
}

impl Engine {
    /// Builds an engine for `model` on this rank of `comm` with a resolved config, computing
    /// on the config's `device` (activations in the precision's dtype where the device can).
    /// The backend is this rank's own, so `device_memory_limit` caps its allocator too.
    /// The optimizer overlap is the config's ([`OptimizerOverlap::decide`]); the builder's
    /// `build` also weighs the host's memory ([`OptimizerOverlap::decide_for_host`]).
    pub fn new(model: Model, cfg: ResolvedConfig, comm: Box<dyn Communicator>) -> Result<Self> {
        Self::with_overlap(model, cfg, comm, None)
    }

    /// As [`Engine::new`], with the optimizer overlap already decided when `overlap` is set
    /// (a caller that weighed the host itself, or a test of a bounded speculation).
    pub fn with_overlap(
        model: Model,
        cfg: ResolvedConfig,
        comm: Box<dyn Communicator>,
        overlap: Option<OptimizerOverlap>,
    ) -> Result<Self> {
        let act = super::build::storage_dtype(&cfg.precision);
        let be = crate::backend::open(cfg.device, act, comm.rank())?;
        if let Some(limit) = cfg.device_memory_limit {
            be.set_memory_limit(Some(limit))?;
        }
        Self::assemble(model, cfg, comm, be, overlap)
    }

    /// Builds an engine whose units compute on `be`. The caller's backend may be shared (ranks
    /// as threads on one device), so its allocator is left as it is; `device_memory_limit` is
    /// enforced per rank by the engine's ledger.
    pub fn with_backend(
        model: Model,
        cfg: ResolvedConfig,
        comm: Box<dyn Communicator>,
        be: Arc<dyn Backend>,
    ) -> Result<Self> {
        Self::assemble(model, cfg, comm, be, None)
    }

    /// As [`Engine::with_backend`], with the optimizer overlap `overlap` instead of the
    /// config's.
    pub fn with_backend_and_overlap(
        model: Model,
        cfg: ResolvedConfig,
        comm: Box<dyn Communicator>,
        be: Arc<dyn Backend>,
        overlap: OptimizerOverlap,
    ) -> Result<Self> {
        Self::assemble(model, cfg, comm, be, Some(overlap))
    }

    /// The engine, with the config's optimizer overlap unless `decided` is set.
    fn assemble(
        model: Model,
        cfg: ResolvedConfig,
        comm: Box<dyn Communicator>,
        be: Arc<dyn Backend>,
        decided: Option<OptimizerOverlap>,
    ) -> Result<Self> {
        let mut cfg = cfg;
        cfg.zero.sub_group_size = super::build::effective_sub_group_size(&cfg, &model);
        if cfg.world_size != comm.world_size() {
            return Err(Error::Config(format!(
                "config was resolved for world size {} but the communicator has {} ranks",
                cfg.world_size,
                comm.world_size()
            )));
        }
        let (mut observers, comm) = super::observe::Observers::open(&cfg, comm)?;
        let (be, model) = observers.instrument(be, model);
        check_backend(&cfg, comm.as_ref())?;
        let hybrid = open_hybrid(&cfg, comm.as_ref())?;
        let shards = shard_comm(comm.as_ref(), &hybrid);
        let stage = stage::for_stage(cfg.zero.stage);
        let optimizer = Optimizer::new(cfg.optimizer.clone());
        let mut ledger = Ledger::with_device_limit(cfg.device_memory_limit);
        let nvme = open_nvme(&cfg, &model, stage.as_ref(), shards, comm.rank())?;
        if let Some(n) = &nvme {
            ledger.alloc(Location::Host, Category::CommBuffers, n.pool_bytes());
        }
        let mut param_swap = open_param_swap(&cfg, comm.as_ref())?;
        let plan = GroupPlan {
            stage: stage.as_ref(),
            cfg: &cfg,
            world: shards.world_size(),
            rank: shards.rank(),
            moments: optimizer.moments(),
            nvme: nvme.as_ref(),
            be: &*be,
        };
        let mut specs: Vec<Vec<crate::nn::ParamSpec>> =
            model.units.iter().map(|u| u.module.param_specs()).collect();
        if !model.shared.is_empty() {
            specs.push(model.shared.clone());
        }
        let groups = specs
            .iter()
            .enumerate()
            .map(|(i, s)| plan.build(i, s, param_swap.as_mut(), &mut ledger))
            .collect::<Result<Vec<Group>>>()?;
        // The resident state alone may already exceed the cap: refuse at initialize.
        ledger.check_limit()?;
        let pinned: u64 = groups
            .iter()
            .filter_map(|g| g.pin.as_ref().map(|p| p.bytes()))
            .sum();
        ledger.lock_host(pinned as i64);
        let hpz = super::hpz::open(&cfg, comm.as_ref(), stage.params(), groups.len())?;
        let n = model.units.len();
        let scaler = LossScaler::from_config(match &cfg.precision {
            ferrozero_config::resolved::Precision::Fp16(s) => Some(s),
            _ => None,
        });
        let schedule = Schedule::new(&cfg.optimizer, cfg.scheduler.clone());
        let overlap = if cfg.zero.overlap_comm && comm.world_size() > 1 {
            Some(CommOverlap::new(shards)?)
        } else {
            None
        };
        tracing::debug!(opt_location = ?optimizer_location(&cfg), "engine built");
        let opt_overlap = decided.unwrap_or_else(|| OptimizerOverlap::decide(&cfg));
        opt_overlap.log(&cfg);
        let shared = super::optimizer_overlap::shared_group(&model);
        let optimizer_lane =
            OptimizerLane::for_overlap(&opt_overlap, comm.rank(), (&groups, shared), &mut ledger)?;
        let grad_downloads = super::grad_download::GradDownloads::new(&cfg);
        Ok(Self {
            cfg,
            model,
            comm,
            hybrid,
            hpz,
            cross_mark: 0,
            activity_mark: be.activity(),
            reduced_bytes: 0,
            be,
            stage,
            groups,
            optimizer,
            schedule,
            scaler,
            ledger,
            saved: (0..n).map(|_| None).collect(),
            saved_bytes: vec![0; n],
            head_grad: None,
            checkpoints: super::ckpt_offload::Checkpoints::new(n),
            steps: 0,
            micro: 0,
            losses: Vec::new(),
            tokens: 0,
            last_batch: None,
            timings: Timings::default(),
            overlap,
            grad_downloads,
            nvme: nvme.map(Arc::new),
            param_swap,
            param_uploads: Default::default(),
            traffic_mark: Default::default(),
            model_files: Default::default(),
            opt_overlap,
            optimizer_lane,
            trace: Trace::default(),
            observers,
        })
    }

    /// What the communication logger recorded (`comms_logger`), if it is enabled.
    pub fn comm_stats(&self) -> Option<&Arc<crate::comm::logger::CommStats>> {
        self.observers.comms.as_ref()
    }

    /// The directories this rank's monitors write (empty when none is enabled here).
    pub fn monitor_dirs(&self) -> &[std::path::PathBuf] {
        self.observers.monitor.as_ref().map_or(&[], |m| m.dirs())
    }

    /// The resolved configuration.
    pub fn config(&self) -> &ResolvedConfig {
        &self.cfg
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// Ranks in the data-parallel group.
    pub fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    /// The memory ledger.
    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// Optimizer steps taken so far.
    pub fn global_steps(&self) -> u64 {
        self.steps
    }

    /// The model being trained.
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// The device the units compute on.
    pub fn backend(&self) -> &dyn Backend {
        &*self.be
    }

    /// Whether the optimizer step overlaps backward in `train_batch`, and why not.
    pub fn optimizer_overlap(&self) -> &OptimizerOverlap {
        &self.opt_overlap
    }

    /// Starts (or stops) recording which lane runs what: each unit's backward and each
    /// group's optimizer step, with start and end times.
    pub fn trace_schedule(&mut self, on: bool) {
        self.trace = if on { Trace::on() } else { Trace::default() };
    }

    /// The spans recorded since the last call, oldest first.
    pub fn take_schedule_trace(&self) -> Vec<Span> {
        self.trace.take()
    }

    pub(super) fn shared_index(&self) -> Option<usize> {
        super::optimizer_overlap::shared_group(&self.model)
    }

    pub(super) fn unit_seed(&self, unit: usize) -> u64 {
        let mix = |h: u64, x: u64| (h ^ x).wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(29);
        let h = mix(self.cfg.seed, self.steps);
        let h = mix(h, self.micro as u64);
        let h = mix(h, self.comm.rank() as u64);
        mix(h, unit as u64)
    }

    pub(super) fn checkpointing(&self) -> bool {
        self.cfg.activation_checkpointing.is_some()
    }

    /// Gathers `unit`'s groups; `fused`: the unit runs its backward inside this forward.
    pub(super) fn gather_unit(&mut self, unit: usize, fused: bool) -> Result<()> {
        let t = Instant::now();
        let bucket = self.cfg.zero.allgather_bucket_size;
        let shared = self
            .shared_index()
            .filter(|_| !self.model.units[unit].uses_shared.is_empty());
        // Groups this call gathers (not kept from forward): hpZ follows forward's gathers.
        let fresh: Vec<usize> = std::iter::once(unit)
            .chain(shared)
            .filter(|&g| self.groups[g].full_params().is_none())
            .collect();
        // The parameters' first use since the optimizer uploaded them.
        self.await_landing(unit)?;
        if let Some(s) = shared {
            self.await_landing(s)?;
        }
        self.take_prefetched(unit)?;
        self.gather_group(unit, bucket)?;
        if let Some(s) = shared {
            self.gather_group(s, bucket)?;
        }
        if !self.hpz_in_backward() {
            for g in fresh {
                self.hpz_after_forward_gather(g, rules::hpz_cuts_secondary(unit, g, fused))?;
            }
        }
        self.timings.gather += t.elapsed().as_secs_f64();
        Ok(())
    }

    /// Swaps group `g`'s shard in from NVMe if it lives there, gathers, and swaps it out.
    fn gather_group(&mut self, g: usize, bucket: usize) -> Result<()> {
        self.swap_in_for_gather(g)?;
        let r = match self
            .gather_direct(g)
            .and_then(|()| self.hpz_gather(g, bucket))
        {
            Ok(false) => self.stage.gather(
                &mut self.groups[g],
                shard_comm(self.comm.as_ref(), &self.hybrid),
                &*self.be,
                bucket,
                &mut self.ledger,
            ),
            done => done.map(|_| ()),
        };
        self.swap_out_after_gather(g);
        r
    }

    /// [`rules::reused_soon`] for `unit`.
    pub(super) fn reused_soon(&self, unit: usize) -> bool {
        let later: usize = self.groups[unit + 1..self.model.units.len()]
            .iter()
            .map(|g| g.layout.padded())
            .sum();
        let partitioned = matches!(
            self.groups[unit].params,
            super::group::ParamStore::Partitioned { .. }
        );
        rules::reused_soon(&self.cfg, partitioned, later)
    }

    pub(super) fn release_unit(&mut self, unit: usize) {
        let be = &*self.be;
        self.stage
            .release(&mut self.groups[unit], be, &mut self.ledger);
        if let Some(s) = self
            .shared_index()
            .filter(|_| !self.model.units[unit].uses_shared.is_empty())
        {
            self.stage
                .release(&mut self.groups[s], be, &mut self.ledger);
        }
    }
}

/// Opens the rank's parameter swap store when `offload_param.device = "nvme"`.
fn open_param_swap(cfg: &ResolvedConfig, comm: &dyn Communicator) -> Result<Option<ParamSwap>> {
    match &cfg.zero.offload_param.target {
        ferrozero_config::resolved::OffloadTarget::Nvme(dir) => {
            ParamSwap::open(cfg, dir, comm.rank()).map(Some)
        }
        _ => Ok(None),
    }
}

/// Opens the rank's NVMe store when `offload_optimizer.device = "nvme"`.
/// `shards` lays out the sharded state; `rank` (the world's) names the rank's files.
fn open_nvme(
    cfg: &ResolvedConfig,
    model: &Model,
    stage: &dyn Stage,
    shards: &dyn Communicator,
    rank: usize,
) -> Result<Option<NvmeOffload>> {
    let ferrozero_config::resolved::OffloadTarget::Nvme(dir) = &cfg.zero.offload_optimizer.target
    else {
        return Ok(None);
    };
    let largest = rules::largest_owned(model, stage, shards.world_size(), shards.rank());
    NvmeOffload::open(cfg, dir, rank, largest).map(Some)
}
