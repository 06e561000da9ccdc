//! The engine: owns the model's parameter groups and runs forward, backward and the
//! optimizer step through the stage's strategy.

use std::sync::Arc;
use std::time::Instant;

use ferrozero_config::resolved::ResolvedConfig;

use super::grad_flow::GradFlow;
use super::group::Group;
use super::ledger::{Category, Ledger, Location};
use super::micro::MicroState;
use super::observe::Observers;
use super::optimizer_overlap::OptimizerOverlap;
use super::param_flow::ParamFlow;
use super::rules;
use super::step_state::StepState;
use super::topology::Comms;
use super::trace::{Span, Trace};
use crate::backend::Backend;
use crate::comm::Communicator;
use crate::nn::{Batch, Model};
use crate::Result;

/// A ZeRO training engine for one rank: the model, its parameter groups and the memory
/// ledger, and the parts that move their contents (each a plain struct with its own file).
pub struct Engine {
    pub(super) cfg: ResolvedConfig,
    pub(super) model: Model,
    /// The world's and the shard group's communicators.
    pub(super) comm: Comms,
    /// The device the units compute on.
    pub(super) be: Arc<dyn Backend>,
    /// One group per unit, then the shared group (if the model has shared parameters).
    pub(super) groups: Vec<Group>,
    /// Gathers, uploads, hpZ and NVMe shards (after `groups`: the shards are dropped before
    /// their swap store, and `Engine`'s drop waits for uploads still reading them first).
    pub(super) params: ParamFlow,
    /// Reductions and the gradients' way to their accumulators.
    pub(super) grads: GradFlow,
    /// The optimizer and its schedule, loss scale, lane, NVMe store and step count.
    pub(super) opt: StepState,
    pub(super) ledger: Ledger,
    /// What forward leaves for backward and the micro-steps for the step.
    pub(super) acts: MicroState,
    /// Monitors, the communication logger, the profiler, the trace and the report marks.
    pub(super) obs: Observers,
    /// The model directory's `config.json` and tokenizer files, saved with each checkpoint.
    pub(super) model_files: crate::nn::weights::ModelFiles,
}

impl Drop for Engine {
    fn drop(&mut self) {
        // Copies still reading the shards finish before the groups free them.
        self.params.uploads.wait_all();
    }
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
        super::assemble::assemble(model, cfg, comm, be, overlap)
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
        super::assemble::assemble(model, cfg, comm, be, None)
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
        super::assemble::assemble(model, cfg, comm, be, Some(overlap))
    }

    /// What the communication logger recorded (`comms_logger`), if it is enabled.
    pub fn comm_stats(&self) -> Option<&Arc<crate::comm::logger::CommStats>> {
        self.obs.comms.as_ref()
    }

    /// The resolved configuration.
    pub fn config(&self) -> &ResolvedConfig {
        &self.cfg
    }

    /// This rank's position among the ranks its sharded state is split across (the shard
    /// group's rank with hybrid sharding, else the rank).
    pub fn shard_rank(&self) -> usize {
        self.comm.shards().rank()
    }

    /// Ranks one copy of the sharded state is split across: `mics_shard_size` with
    /// hybrid sharding, else the world size.
    pub fn shard_world(&self) -> usize {
        self.comm.shards().world_size()
    }

    /// Copies of the sharded state across the world: `world / mics_shard_size` with
    /// hybrid sharding, else 1.
    pub fn replicas(&self) -> usize {
        self.comm.replicas()
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.comm.world.rank()
    }

    /// Ranks in the data-parallel group.
    pub fn world_size(&self) -> usize {
        self.comm.world.world_size()
    }

    /// The memory ledger.
    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// Optimizer steps taken so far.
    pub fn global_steps(&self) -> u64 {
        self.opt.steps
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
        &self.opt.overlap
    }

    /// Each group's optimizer snapshot bytes, were a speculative overlap to take it, in the
    /// order of the engine's groups (what a bound on the snapshots is planned from).
    pub fn snapshot_group_bytes(&self) -> Vec<u64> {
        super::optimizer_overlap::snapshot_figures(&self.opt.overlap, &self.groups, None).groups
    }

    /// Keeps zeroed accumulators and adds every micro-step's gradient into them even at one
    /// micro-step per step, as before gradients moved into place: the reference the moved
    /// path is compared with, bit for bit. Takes effect from the next micro-step; a gradient
    /// already held becomes an accumulator holding the same values.
    pub fn accumulate_gradients(&mut self) -> Result<()> {
        let (groups, be) = (&mut self.groups, &*self.be);
        (self.grads.downloads).accumulate_always(groups, be, &mut self.ledger)
    }

    /// Starts (or stops) recording which lane runs what: each unit's backward and each
    /// group's optimizer step, with start and end times.
    pub fn trace_schedule(&mut self, on: bool) {
        self.obs.trace = if on { Trace::on() } else { Trace::default() };
    }

    /// The spans recorded since the last call, oldest first.
    pub fn take_schedule_trace(&self) -> Vec<Span> {
        self.obs.trace.take()
    }

    pub(super) fn shared_index(&self) -> Option<usize> {
        super::optimizer_overlap::shared_group(&self.model)
    }

    /// `unit`'s dropout seed: the run's seed and the unit only. The step, micro-step and
    /// rank enter through the counter ([`Engine::rng_row`]), so every rank and micro-step
    /// draws from one stream per unit and dropout site.
    pub(super) fn unit_seed(&self, unit: usize) -> u64 {
        let mix = |h: u64, x: u64| (h ^ x).wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(29);
        mix(self.cfg.seed, unit as u64)
    }

    /// The run's global index of `batch`'s first sample, `Ctx::rng_row`.
    ///
    /// Invariant: within an optimizer step the global batch is ordered micro-step-major,
    /// then rank, then row: row `b` of rank `r`'s micro-batch `k` (of `gas` micro-steps,
    /// world `w`, micro-batch `B`) is the run's sample `((step·gas + k)·w + r)·B + b`, and a
    /// dropout mask's counter is that index times the elements of a sample plus the element's
    /// position inside it. So a sample's masks depend only on the seed, the unit, the site,
    /// the global sample and the position, not on the rank, micro-step, world size, stage or
    /// device: a world-1 run of micro-batch 4, a world-2 run of 2 and a world-1 run of 2
    /// with two micro-steps, fed the same samples in this order, drop the same elements
    /// (`tests/engine_dropout.rs`: `dropout_masks_follow_the_sample_across_worlds_and_splits`).
    pub(super) fn rng_row(&self, batch: &Batch) -> u64 {
        let gas = self.cfg.gradient_accumulation_steps as u64;
        let micro_step = self.opt.steps * gas + self.acts.micro as u64;
        let rank_batch = micro_step * self.world_size() as u64 + self.rank() as u64;
        rank_batch * batch.batch as u64
    }

    pub(super) fn checkpointing(&self) -> bool {
        self.cfg.activation_checkpointing.is_some()
    }

    /// Gathers `unit`'s groups; `fused`: the unit runs its backward inside this forward.
    pub(super) fn gather_unit(&mut self, unit: usize, fused: bool) -> Result<()> {
        let t = Instant::now();
        let bucket = self.cfg.zero.allgather_bucket_size;
        // The unit's own groups, then the shared ones it reads.
        let used = self.params.places.groups(unit).to_vec();
        // Groups this call gathers (not kept from forward): hpZ follows forward's gathers.
        let fresh: Vec<usize> = (used.iter().copied())
            .filter(|&g| self.groups[g].full_params().is_none())
            .collect();
        // The parameters' first use since the optimizer uploaded them.
        for &g in &used {
            self.await_landing(g)?;
        }
        let own: Vec<usize> = (used.iter().copied())
            .filter(|&g| self.params.places.owns(unit, g))
            .collect();
        for g in own {
            self.take_prefetched(g)?;
        }
        for &g in &used {
            self.gather_group(g, bucket)?;
        }
        if !self.params.hpz.in_backward() {
            for g in fresh {
                let cut = rules::hpz_cuts_secondary(self.params.places.owns(unit, g), fused);
                let world = self.comm.world.world_size();
                self.params.hpz.after_forward_gather(
                    (g, &self.groups[g]),
                    world,
                    cut,
                    &mut self.ledger,
                )?;
            }
        }
        self.obs.timings.gather += t.elapsed().as_secs_f64();
        Ok(())
    }

    /// Swaps group `g`'s shard in from NVMe if it lives there, gathers, and swaps it out.
    fn gather_group(&mut self, g: usize, bucket: usize) -> Result<()> {
        (self.params.swap).in_for_gather(&mut self.groups[g], &mut self.ledger)?;
        let step = self.opt.steps;
        let wire = rules::param_wire(&self.cfg, self.groups[g].frozen);
        let direct = (g, &mut self.groups[g]);
        let r = match (self.params.uploads)
            .gather(direct, step, &*self.be, &mut self.ledger)
            .and_then(|()| {
                self.params.hpz.gather(
                    (g, &mut self.groups[g]),
                    &*self.be,
                    bucket,
                    &mut self.ledger,
                )
            }) {
            Ok(false) => self.params.stage.gather(
                &mut self.groups[g],
                self.comm.shards(),
                &*self.be,
                (bucket, wire),
                &mut self.ledger,
            ),
            done => done.map(|_| ()),
        };
        (self.params.swap).out_after_gather(&mut self.groups[g], &mut self.ledger);
        r
    }

    /// Prefetches `unit`'s groups: its own ([`Engine::prefetch_group`]), with the shared
    /// ones it reads, then its frozen part.
    pub(super) fn prefetch(&mut self, unit: usize) {
        let places = &self.params.places;
        let shared: Vec<usize> = (places.groups(unit).iter().copied())
            .filter(|&g| !places.owns(unit, g))
            .collect();
        let frozen = places.frozen_part(unit);
        self.prefetch_group(unit, &shared);
        if let Some(f) = frozen {
            self.prefetch_group(f, &[]);
        }
    }

    /// Starts gathering group `g` on the worker (stage 3, overlap on), if it is partitioned
    /// in memory, not gathered or in flight yet, and fits `stage3_prefetch_bucket_size` and
    /// `stage3_max_live_parameters` next to what is live now. At one rank the shard is
    /// uploaded instead (`param_upload.rs`), with or without overlap, and `shared` (the
    /// tied groups the unit reads) with it; a shard on NVMe is read ahead, with or without
    /// overlap.
    fn prefetch_group(&mut self, g: usize, shared: &[usize]) {
        // hpZ: backward gathers from the secondary partition inside the group, on this thread.
        if self.params.hpz.in_backward() {
            return;
        }
        let live: usize = self
            .groups
            .iter()
            .filter(|x| x.full_params().is_some())
            .map(|x| x.layout.padded())
            .sum();
        let bucket = self.cfg.zero.allgather_bucket_size;
        // Shards on NVMe are read ahead instead; their gather runs when they arrive.
        (self.params.swap).prefetch((g, &mut self.groups), &mut self.ledger);
        if !super::rules::prefetch_fits(&self.cfg, self.groups[g].layout.padded(), live) {
            return;
        }
        // The copy taken here is the shard's first use since the optimizer's upload; a failed
        // wait or upload leaves the gather to `gather_unit`, which reports it.
        if self.await_landing(g).is_err() {
            return;
        }
        // One rank: the shard goes up on the copy stream, with or without the worker, and the
        // tied parameters with it when the unit uses them and they are not gathered.
        let upload = |e: &mut Self, g: usize| {
            let at = (&e.cfg, e.opt.steps);
            e.params
                .uploads
                .prefetch((g, &e.groups[g]), at, &*e.be, &mut e.ledger)
        };
        let mut started = upload(self, g);
        for &s in shared {
            started = started.and_then(|up| match up {
                true => self.await_landing(s).and_then(|()| upload(self, s)),
                false => Ok(false),
            });
        }
        match started {
            Ok(false) => {}
            Ok(true) => return,
            Err(e) => {
                tracing::debug!("parameter upload of group {g} not started ahead: {e}");
                return;
            }
        }
        let grp = (g, &self.groups[g]);
        let wire = (bucket, rules::param_wire(&self.cfg, grp.1.frozen));
        (self.grads.overlap).start_gather(grp, wire, &self.be, &mut self.ledger);
    }

    /// Installs a prefetched gather of group `g`, if one is in flight.
    pub(super) fn take_prefetched(&mut self, g: usize) -> Result<()> {
        self.grads.overlap.take_gathered((g, &mut self.groups[g]))
    }

    /// [`rules::reused_soon`] for `unit`.
    pub(super) fn reused_soon(&self, unit: usize) -> bool {
        let places = &self.params.places;
        let later: usize = (unit + 1..self.model.units.len())
            .flat_map(|u| places.groups(u).iter().filter(move |&&g| places.owns(u, g)))
            .map(|&g| self.groups[g].layout.padded())
            .sum();
        let partitioned = matches!(
            self.groups[unit].params,
            super::group::ParamStore::Partitioned { .. }
        );
        rules::reused_soon(&self.cfg, partitioned, later)
    }

    pub(super) fn release_unit(&mut self, unit: usize) {
        let be = &*self.be;
        for &g in self.params.places.groups(unit) {
            self.params
                .stage
                .release(&mut self.groups[g], be, &mut self.ledger);
        }
    }
}

impl Engine {
    /// A one-screen summary: stage, precision, world, parameters, bytes per rank by category.
    pub fn summary(&self) -> String {
        let l = &self.ledger;
        let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
        let mut s = format!(
            "ZeRO stage {} on {} | {:?} | world size {} over {}{} | {} parameters | micro-batch {} x accumulation {} = {} per step\n",
            self.cfg.zero.stage.number(),
            self.be.name(),
            self.cfg.precision,
            self.world_size(),
            super::topology::backend_name(self.comm.world.backend()),
            self.comm.hybrid_summary(),
            self.model.num_params(),
            self.cfg.train_micro_batch_size_per_gpu,
            self.cfg.gradient_accumulation_steps,
            self.cfg.train_batch_size,
        );
        for loc in [Location::Device, Location::Host, Location::Nvme] {
            let parts: Vec<String> = Category::ALL
                .iter()
                .filter(|&&c| l.current(loc, c) > 0)
                .map(|&c| format!("{c:?} {:.1} MiB", mib(l.current(loc, c))))
                .collect();
            if !parts.is_empty() {
                s.push_str(&format!("  {loc:?} per rank: {}\n", parts.join(", ")));
            }
        }
        s
    }

    /// Orders the compute stream after group `g`'s parameter uploads: called where the
    /// parameters are next used.
    pub(super) fn await_landing(&self, g: usize) -> Result<()> {
        self.groups[g].landing.await_on(&*self.be)
    }

    /// Orders the compute stream after every group's parameter uploads (before parameters
    /// are read or written wholesale: checkpoints, `parameters`, `set_parameters`).
    pub(in crate::engine) fn await_landings(&self) -> Result<()> {
        (0..self.groups.len()).try_for_each(|g| self.await_landing(g))
    }
}
