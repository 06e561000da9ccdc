//! The engine: owns the model's parameter groups and runs forward, backward and the
//! optimizer step through the stage's strategy.

use std::sync::Arc;
use std::time::Instant;

use ferrozero_config::resolved::ResolvedConfig;

use super::build::{optimizer_location, GroupPlan};
use super::group::{compute_view, Group};
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
use crate::nn::{Batch, BatchIds, Ctx, Grads, Model, Module, Params, Saved};
use crate::tensor::{Tensor, View, ViewMut};
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
    saved_bytes: Vec<u64>,
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
    last_batch: Option<(Batch, BatchIds)>,
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

    /// As [`Engine::new`], with the optimizer overlap already decided when `overlap` is set.
    pub(super) fn with_overlap(
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
            .filter_map(|g| g.pin.as_ref())
            .map(|p| p.bytes())
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
        let optimizer_lane = match opt_overlap {
            OptimizerOverlap::On => Some(OptimizerLane::new(
                comm.rank(),
                &groups,
                false,
                &mut ledger,
            )?),
            OptimizerOverlap::Speculative(_) => {
                Some(OptimizerLane::new(comm.rank(), &groups, true, &mut ledger)?)
            }
            OptimizerOverlap::Off(_) => None,
        };
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
        (!self.model.shared.is_empty()).then_some(self.model.units.len())
    }

    pub(super) fn unit_seed(&self, unit: usize) -> u64 {
        let mix = |h: u64, x: u64| (h ^ x).wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(29);
        let h = mix(self.cfg.seed, self.steps);
        let h = mix(h, self.micro as u64);
        let h = mix(h, self.comm.rank() as u64);
        mix(h, unit as u64)
    }

    fn checkpointing(&self) -> bool {
        self.cfg.activation_checkpointing.is_some()
    }

    pub(super) fn gather_unit(&mut self, unit: usize) -> Result<()> {
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
                self.hpz_after_forward_gather(g)?;
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
    fn reused_soon(&self, unit: usize) -> bool {
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
            saved,
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
            saved: &mut saved[unit],
        };
        u.module.forward(&mut ctx, &params, input)
    }

    fn track_saved(&mut self, unit: usize) {
        let b = self.saved[unit].as_ref().map_or(0, |s| s.bytes() as u64);
        self.ledger
            .alloc(Location::Device, Category::Activations, b);
        self.saved_bytes[unit] = b;
    }

    fn untrack_saved(&mut self, unit: usize) {
        let b = std::mem::take(&mut self.saved_bytes[unit]);
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
        self.head_grad = None;
        if training && self.micro == 0 && self.losses.is_empty() {
            self.observers.step_begin(self.steps + 1, &*self.be)?;
        }
        let t = Instant::now();
        // The step's staging (uploads in flight) is still held: the device's locked bytes now.
        self.ledger
            .observe_device_locked(self.be.page_locked_bytes());
        let mut x = Tensor::default();
        let n = self.model.units.len();
        for unit in 0..n {
            self.gather_unit(unit)?;
            if unit + 1 < n {
                self.prefetch(unit + 1);
            }
            let fuse = fused.filter(|_| training && unit + 1 == n);
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
                    self.saved[unit] = None;
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
        self.timings.forward += t.elapsed().as_secs_f64();
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
        self.hpz_backward(true);
        let r = self.backward_units(batch, loss_grad);
        self.hpz_backward(false);
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
        self.timings.backward += t.elapsed().as_secs_f64();
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
        let (mut grad, top) = match self.head_grad.take() {
            Some(dx) => {
                self.finish_fused_unit(n - 1, first_shared_user)?;
                (dx, n - 1)
            }
            None => (Tensor::scalar(loss_grad), n),
        };
        for unit in (0..top).rev() {
            self.gather_unit(unit)?;
            if unit > 0 {
                self.prefetch(unit - 1);
                self.checkpoint_ahead(unit - 1)?;
            }
            let trace = self.trace.clone();
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
            saved,
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
            saved: &mut saved[unit],
        };
        let out = f(&*u.module, &mut ctx, &params, &mut grads);
        drop(grads);
        self.saved[unit] = None;
        out
    }

    /// Forward of one micro-batch in training mode (DeepSpeed's `engine(batch)`); returns the
    /// micro-batch's mean token loss on this rank. Call [`Engine::backward`] next.
    pub fn forward(&mut self, batch: &Batch) -> Result<f64> {
        let ids = BatchIds::new(&*self.be, batch)?;
        let loss = self.forward_pass((batch, &ids), true)?;
        // The caller asked for the value: it leaves the device now.
        let sum = f64::from(loss.to_vec_f32()?[0]);
        self.losses.push(loss);
        self.tokens += batch.valid_targets() as u64;
        self.last_batch = Some((batch.clone(), ids));
        Ok(sum / batch.valid_targets().max(1) as f64)
    }

    /// Backward of the last forward, with DeepSpeed's scaling: the micro-batch mean loss,
    /// divided by the accumulation steps and averaged over ranks.
    pub fn backward(&mut self) -> Result<()> {
        let (batch, ids) = self
            .last_batch
            .take()
            .ok_or_else(|| Error::Invalid("backward() without a preceding forward()".into()))?;
        let denom =
            batch.valid_targets().max(1) * self.cfg.gradient_accumulation_steps * self.world_size();
        let grad = (self.scaler.scale() / denom as f64) as f32;
        self.backward_pass((&batch, &ids), grad)?;
        self.micro += 1;
        Ok(())
    }

    /// Whether the next [`Engine::step`] will update parameters (accumulation boundary).
    pub fn is_gradient_accumulation_boundary(&self) -> bool {
        self.micro >= self.cfg.gradient_accumulation_steps
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
    let world = shards.world_size();
    let layouts = model
        .units
        .iter()
        .map(|u| u.module.param_specs())
        .chain(std::iter::once(model.shared.clone()));
    let largest = layouts
        .map(|s| {
            stage
                .optimizer()
                .range(
                    &super::partition::GroupLayout::new(&s, world),
                    shards.rank(),
                )
                .len()
        })
        .max()
        .unwrap_or(1);
    NvmeOffload::open(cfg, dir, rank, largest).map(Some)
}
