//! Replays one training step's buffer lifetimes on a [`Ledger`] without allocating anything.
//!
//! Invariant: every `alloc`/`free` here mirrors one in the engine (`build.rs`, `group.rs`,
//! `stage.rs`, `core.rs`, `step.rs`), in the same order and with the same sizes, so the
//! replayed peaks are the peaks the engine's ledger will measure. Sizes come from the shared
//! layout arithmetic ([`GroupLayout`]) and [`crate::nn::Module::saved_bytes`]; the
//! `estimate_*` tests run the engine beside this replay to keep the two in step.

mod page_locked;
mod reduce;
mod staged;
mod swap;
mod transient;

use std::collections::VecDeque;

pub use page_locked::PageLockedFigures;

use ferrozero_config::resolved::{ActivationCheckpointing, OffloadTarget, ResolvedConfig};

use super::book::Book;
use crate::backend::MemoryModel;
use crate::engine::build::{
    accum_dtype, optimizer_location, param_location, state_dtype, storage_dtype,
};
use crate::engine::ledger::{Category, Ledger, Location};
use crate::engine::optimizer_overlap::{snapshot_bytes, snapshot_plan, OptimizerOverlap};
use crate::engine::partition::{shard_world, GroupLayout};
use crate::engine::rules;
use crate::engine::stage::{self, Extent, Stage};
use crate::nn::Model;
use crate::tensor::DType;

/// What one group's buffers look like on one rank, sizes only.
struct GroupShape {
    layout: GroupLayout,
    /// The layout of the group's trainable parameters: what gradients, master weights and
    /// moments cover. The engine keeps a unit's frozen parameters in a group of their own
    /// (`engine/places.rs`); the replay prices the two as one unit's, up to padding.
    grads: GroupLayout,
    /// The layout of the group's frozen parameters (the engine's frozen group of the unit).
    frozen: GroupLayout,
    /// The parameter extent after the persistence threshold (stage 3 keeps small groups whole).
    params: Extent,
}

/// The replay state: sizes that do not change during a step, and the ledger being driven.
pub(super) struct Replay<'a> {
    model: &'a Model,
    cfg: &'a ResolvedConfig,
    stage: Box<dyn Stage>,
    dtype: DType,
    groups: Vec<GroupShape>,
    /// The lowest unit backward runs (`Model::backward_floor`).
    floor: usize,
    ledger: Book,
    /// The device's memory behaviour: what layers save, working copies, block rounding.
    mem: MemoryModel,
    micro_alive: Vec<bool>,
    /// Stage-3 groups whose gathered copy exists (gathered, prefetched or kept for reuse).
    gathered: Vec<bool>,
    /// Groups whose f32 working copy exists.
    work: Vec<bool>,
    /// Reduction buffers queued on the comm worker (`overlap_comm`): the wire-dtype input's
    /// bytes, the reduced shard's (where the device counts it), the group's padded elements.
    queued: VecDeque<(u64, u64, usize)>,
    /// Reduced gradients on their way down to host accumulators (`grad_download.rs`): the
    /// device bytes of each, oldest first.
    downloads: VecDeque<u64>,
    /// Device bytes of the reduced gradients moved into place (`rules::gradient_by_move`),
    /// held until the step ends.
    moved: u64,
    /// `offload_param.buffer_count` when stage-3 shards live on NVMe.
    swap_limit: Option<usize>,
    /// Per group, the host bytes its NVMe shard's buffer was counted with while it occupies
    /// one (read ahead, in, or being written).
    swapped_in: Vec<Option<u64>>,
    /// hpZ's group size when it applies (stage 3, several groups), else 0.
    hpz: usize,
    /// Groups whose hpZ secondary partition exists (from their first forward gather).
    secondary: Vec<bool>,
    /// Each group's optimizer-state bytes.
    opt_bytes: Vec<u64>,
    /// Host bytes of the speculative overlap's snapshots (0 without them).
    pub(super) snapshot_bytes: u64,
    /// Each group's snapshot bytes, were it snapshotted (what a bound is planned from).
    pub(super) snapshot_group_bytes: Vec<u64>,
    /// Device bytes of the tensor between units: forward's latest output, then backward's
    /// latest input gradient (priced where the device counts transients).
    boundary: u64,
    /// Device bytes of the loss backward started from, kept until the step.
    loss: u64,
    /// Units whose host checkpoint is back on the device ahead of its recompute.
    ckpt_up: Vec<bool>,
    /// Bytes of each checkpoint one forward sends down to host staging, in forward's order
    /// (empty unless `cpu_checkpointing` keeps them in host memory).
    ckpt_down: Vec<u64>,
    /// The groups a speculative overlap snapshots (their snapshots stage device values);
    /// none when the overlap is not speculative.
    snapshotted: Vec<bool>,
}

impl<'a> Replay<'a> {
    /// Lays out every group of `model` for `cfg`'s world size and counts the model states,
    /// with the speculative overlap's snapshots when `overlap` is speculative.
    pub(super) fn build(
        model: &'a Model,
        cfg: &'a ResolvedConfig,
        moments: usize,
        overlap: &OptimizerOverlap,
        mem: MemoryModel,
    ) -> Self {
        let stage = stage::for_stage(cfg.zero.stage);
        let world = shard_world(cfg.world_size.max(1), cfg.zero.mics_shard_size);
        let mut specs: Vec<_> = model.units.iter().map(|u| u.module.param_specs()).collect();
        if !model.shared.is_empty() {
            specs.push(model.shared.clone());
        }
        let groups = specs
            .iter()
            .map(|s| {
                let layout = GroupLayout::new(s, world);
                let params = rules::param_extent(cfg, stage.params(), layout.numel);
                let trainable: Vec<_> = (s.iter())
                    .filter(|p| !model.is_frozen(&p.name))
                    .cloned()
                    .collect();
                let grads = GroupLayout::new(&trainable, world);
                let frozen: Vec<_> = (s.iter())
                    .filter(|p| model.is_frozen(&p.name))
                    .cloned()
                    .collect();
                GroupShape {
                    layout,
                    grads,
                    frozen: GroupLayout::new(&frozen, world),
                    params,
                }
            })
            .collect::<Vec<_>>();
        let n = groups.len();
        let hpz = rules::hpz_size(cfg, cfg.world_size, stage.params());
        let mut r = Replay {
            model,
            cfg,
            stage,
            dtype: storage_dtype(&cfg.precision),
            groups,
            floor: model.backward_floor(),
            ledger: Book::new(mem),
            mem,
            micro_alive: vec![false; n],
            gathered: vec![false; n],
            work: vec![false; n],
            queued: VecDeque::new(),
            downloads: VecDeque::new(),
            moved: 0,
            swap_limit: matches!(cfg.zero.offload_param.target, OffloadTarget::Nvme(_))
                .then_some(cfg.zero.offload_param.buffer_count.max(2)),
            swapped_in: vec![None; n],
            hpz,
            secondary: vec![false; n],
            opt_bytes: vec![0; n],
            snapshot_bytes: 0,
            snapshot_group_bytes: Vec::new(),
            boundary: 0,
            loss: 0,
            ckpt_up: vec![false; n],
            ckpt_down: Vec::new(),
            snapshotted: vec![false; n],
        };
        for g in 0..n {
            r.build_group(g, moments);
        }
        r.snapshot_group_bytes = (0..n)
            .map(|g| {
                let owned = r.stage.optimizer().range(&r.groups[g].grads, 0).len();
                snapshot_bytes(owned, r.opt_bytes[g], r.dtype)
            })
            .collect();
        // Mirrors `OptimizerLane::for_overlap`: a speculative optimizer overlap keeps one host
        // snapshot of each planned group's optimizer values.
        if let OptimizerOverlap::Speculative(_, budget) = overlap {
            let shared = crate::engine::optimizer_overlap::shared_group(model);
            r.snapshotted = snapshot_plan(&r.snapshot_group_bytes, shared, *budget);
            for g in (0..n).filter(|&g| r.snapshotted[g]) {
                let b = r.snapshot_group_bytes[g];
                r.ledger.alloc(Location::Host, Category::OptimizerState, b);
                r.snapshot_bytes += b;
            }
        }
        r
    }

    /// `Hpz::after_forward_gather`: a sharded group's first forward gather allocates
    /// its secondary partition (`1 / G` of the padded parameters), kept from then on.
    fn keep_secondary(&mut self, g: usize) {
        if self.hpz > 1 && self.groups[g].params == Extent::Shard && !self.secondary[g] {
            self.secondary[g] = true;
            let b = self.lp(self.groups[g].layout.padded() / self.hpz);
            self.ledger.alloc(Location::Device, Category::Parameters, b);
        }
    }

    fn lp(&self, elems: usize) -> u64 {
        (elems * self.dtype.size()) as u64
    }

    fn build_group(&mut self, g: usize, moments: usize) {
        let (layout, params) = (&self.groups[g].layout, self.groups[g].params);
        let param_elems = params.range(layout, 0).len();
        let param_loc = match params {
            Extent::Shard => param_location(self.cfg),
            Extent::Full => Location::Device,
        };
        let grads = &self.groups[g].grads;
        let grad_elems = self.stage.grads().range(grads, 0).len();
        let owned = self.stage.optimizer().range(grads, 0).len();
        let own_master = self.dtype == DType::F32 || self.cfg.bf16_state.master_weights_and_grads;
        let master = if own_master { 0 } else { owned };
        let state = state_dtype(self.cfg).size();
        let opt_bytes = (master * 4 + owned * moments * state) as u64;
        // Moved gradients leave no accumulator between steps.
        let grad_elems = match rules::gradient_by_move(self.cfg) {
            true => 0,
            false => grad_elems,
        };
        let pb = self.lp(param_elems);
        let gb = (grad_elems * accum_dtype(self.cfg).size()) as u64;
        self.ledger.alloc(param_loc, Category::Parameters, pb);
        self.ledger
            .alloc(rules::grad_location(self.cfg), Category::Gradients, gb);
        let opt_loc = optimizer_location(self.cfg);
        self.opt_bytes[g] = opt_bytes;
        self.ledger
            .alloc(opt_loc, Category::OptimizerState, opt_bytes);
    }

    fn shared_index(&self) -> Option<usize> {
        (!self.model.shared.is_empty()).then_some(self.model.units.len())
    }

    fn uses_shared(&self, unit: usize) -> Option<usize> {
        self.shared_index()
            .filter(|_| !self.model.units[unit].uses_shared.is_empty())
    }

    /// The buffers `Stage::gather` makes for one group: the gathered copy (sharded
    /// parameters, unless prefetched or kept) and the f32 working copy (low precision).
    fn gather_group(&mut self, g: usize) {
        let padded = self.groups[g].layout.padded();
        if self.on_nvme(g) && !self.gathered[g] {
            self.swap_buffer(g, true);
        }
        if self.groups[g].params == Extent::Shard && !self.gathered[g] {
            self.gathered[g] = true;
            self.wire_staging(g);
            let full = self.lp(padded);
            self.ledger
                .alloc(Location::Device, Category::Prefetch, full);
        }
        if let Some(b) = self.work_bytes(g).filter(|_| !self.work[g]) {
            self.work[g] = true;
            self.ledger.alloc(Location::Device, Category::Prefetch, b);
        }
        // `Swap::out_after_gather`: the file still holds the shard.
        self.swap_buffer(g, false);
    }

    /// `Group::ensure_work`: bytes of group `g`'s working copy in the dtype layers read
    /// parameters in, or `None` where they read the stored dtype (no copy).
    fn work_bytes(&self, g: usize) -> Option<u64> {
        let want = self.mem.param_dtype(self.dtype);
        (want != self.dtype).then(|| (self.groups[g].layout.padded() * want.size()) as u64)
    }

    fn release_group(&mut self, g: usize) {
        let padded = self.groups[g].layout.padded();
        if std::mem::take(&mut self.work[g]) {
            let b = self.work_bytes(g).unwrap_or(0);
            self.ledger.free(Location::Device, Category::Prefetch, b);
        }
        if self.groups[g].params == Extent::Shard && std::mem::take(&mut self.gathered[g]) {
            let full = self.lp(padded);
            self.ledger.free(Location::Device, Category::Prefetch, full);
        }
    }

    /// `Engine::prefetch`: a sharded group is gathered ahead of use on the comm worker, or at
    /// one rank a host shard is uploaded ahead with or without it (with the tied group when
    /// the unit uses it), when it fits the prefetch bucket and the live-parameter limit.
    fn prefetch(&mut self, g: usize) {
        if self.swap_limit.is_some() {
            // Every partitioned shard is on NVMe: read ahead, never gathered ahead.
            self.prefetch_swap(g);
            return;
        }
        // A one-rank shard group uploads a host shard ahead (`param_upload.rs`); more gather
        // on the worker.
        let z = &self.cfg.zero;
        let shard_world = self.groups.first().map_or(1, |g| g.layout.world_size);
        let upload = rules::uploads_ahead(self.cfg, shard_world);
        if !(upload || (z.overlap_comm && self.cfg.world_size > 1)) {
            return;
        }
        let live: usize = (0..self.groups.len())
            .filter(|&i| self.groups[i].params == Extent::Full || self.gathered[i])
            .map(|i| self.groups[i].layout.padded())
            .sum();
        let n = self.groups[g].layout.padded();
        if !rules::prefetch_fits(self.cfg, n, live) {
            return;
        }
        let shared = (self.groups.len() > self.model.units.len())
            .then_some(self.model.units.len())
            .filter(|_| upload && !self.model.units[g].uses_shared.is_empty());
        if self.gather_ahead(g) {
            if let Some(s) = shared {
                self.gather_ahead(s);
            }
        }
    }

    /// A sharded group not gathered yet is gathered ahead; whether it was.
    fn gather_ahead(&mut self, g: usize) -> bool {
        if self.groups[g].params != Extent::Shard || self.gathered[g] {
            return false;
        }
        self.gathered[g] = true;
        let full = self.lp(self.groups[g].layout.padded());
        self.ledger
            .alloc(Location::Device, Category::Prefetch, full);
        self.wire_staging(g);
        true
    }

    /// `stage::wire_staging_bytes`: qwZ's packed buffers, held while a gather runs: the
    /// engine gathers a unit's trainable and frozen parameters as two groups, one after the
    /// other, each quantized by its own rule.
    fn wire_staging(&mut self, g: usize) {
        let shape = &self.groups[g];
        let world = shape.layout.world_size;
        let parts = [
            (shape.grads.shard_len, false),
            (shape.frozen.shard_len, true),
        ];
        for (s, frozen) in parts.into_iter().filter(|p| p.0 > 0) {
            let wire = rules::param_wire(self.cfg, frozen);
            let staging = stage::wire_staging_bytes(wire, world, s);
            self.ledger
                .alloc(Location::Device, Category::CommBuffers, staging);
            self.ledger
                .free(Location::Device, Category::CommBuffers, staging);
        }
    }

    /// `Engine::reused_soon`: [`rules::reused_soon`] over the replay's layouts.
    fn reused_soon(&self, unit: usize) -> bool {
        let later: usize = self.groups[unit + 1..self.model.units.len()]
            .iter()
            .map(|g| g.layout.padded())
            .sum();
        rules::reused_soon(self.cfg, self.groups[unit].params == Extent::Shard, later)
    }

    fn gather_unit(&mut self, unit: usize) {
        self.gather_group(unit);
        if let Some(s) = self.uses_shared(unit) {
            self.gather_group(s);
        }
    }

    fn release_unit(&mut self, unit: usize) {
        self.release_group(unit);
        if let Some(s) = self.uses_shared(unit) {
            self.release_group(s);
        }
    }

    fn checkpointing(&self) -> Option<&ActivationCheckpointing> {
        self.cfg.activation_checkpointing.as_ref()
    }

    fn ckpt_location(&self) -> Location {
        rules::ckpt_location(self.cfg)
    }

    /// `Checkpoints::ahead`: a checkpoint in host memory goes up to the device
    /// [`rules::CHECKPOINTS_AHEAD`] units ahead of its recompute.
    fn checkpoint_ahead(&mut self, unit: usize, mb: usize, seq: usize) {
        if self.checkpointing().is_none()
            || self.ckpt_location() != Location::Host
            || std::mem::replace(&mut self.ckpt_up[unit], true)
        {
            return;
        }
        let b = self.input_bytes(unit, mb, seq);
        self.ledger
            .alloc(Location::Device, Category::Activations, b);
    }

    /// Bytes of a unit's input tensor: its predecessor's output (the first unit gets none).
    fn input_bytes(&self, unit: usize, mb: usize, seq: usize) -> u64 {
        match unit {
            0 => 0,
            u => self.model.units[u - 1]
                .module
                .output_bytes(mb, seq, &self.mem) as u64,
        }
    }

    fn saved_bytes(&self, unit: usize, mb: usize, seq: usize) -> u64 {
        self.model.units[unit]
            .module
            .saved_bytes(mb, seq, &self.mem) as u64
    }

    /// One training forward over every unit (`train_batch`'s: the last unit runs its backward
    /// at once, `engine/passes.rs`).
    pub(super) fn forward(&mut self, mb: usize, seq: usize) {
        self.begin_forward_transients(mb, seq);
        let n = self.model.units.len();
        for unit in 0..n {
            self.gather_unit(unit);
            if rules::hpz_cuts_secondary(true, unit + 1 == n) {
                self.keep_secondary(unit);
            }
            if let Some(s) = self.uses_shared(unit) {
                self.keep_secondary(s);
            }
            if unit + 1 < n {
                self.prefetch(unit + 1);
            } else {
                self.fused_unit(unit, mb, seq);
                break;
            }
            self.unit_forward_transients(unit, mb, seq);
            // `Engine::forward_units`: nothing kept below the backward floor.
            let below = unit < self.floor;
            if below || !self.reused_soon(unit) {
                self.release_unit(unit);
            }
            if !below {
                self.keep_for_backward(unit, mb, seq);
            }
            self.pass_boundary(unit, mb, seq);
        }
    }

    /// What forward keeps of a unit for its backward: its input checkpoint (on the device or
    /// on its way to the host), or its saved activations.
    fn keep_for_backward(&mut self, unit: usize, mb: usize, seq: usize) {
        if self.checkpointing().is_some() {
            let b = self.input_bytes(unit, mb, seq);
            self.ledger
                .alloc(self.ckpt_location(), Category::Activations, b);
            if self.ckpt_location() == Location::Host {
                self.ckpt_down.push(b);
            }
        } else {
            let b = self.saved_bytes(unit, mb, seq);
            self.ledger
                .alloc(Location::Device, Category::Activations, b);
        }
    }

    /// `Engine::run_unit_fused`: the last unit's gradients allocated, computed with its
    /// forward, its parameters released; nothing saved or checkpointed.
    fn fused_unit(&mut self, unit: usize, mb: usize, seq: usize) {
        self.ensure_micro(unit);
        if let Some(s) = self.uses_shared(unit) {
            self.ensure_micro(s);
        }
        self.fused_transients(unit, mb, seq);
        self.release_unit(unit);
    }

    /// `Engine::reduce_unit`: the unit's reduction, and the shared group's after its first
    /// user.
    fn reduce_unit(&mut self, unit: usize, first_shared_user: Option<usize>) {
        self.reduce_group(unit);
        if let (Some(s), Some(first)) = (self.shared_index(), first_shared_user) {
            if first == unit {
                self.reduce_group(s);
            }
        }
    }

    /// One backward over every unit in reverse, with recompute under checkpointing; the
    /// fused last unit only prefetches its predecessor and is reduced.
    pub(super) fn backward(&mut self, mb: usize, seq: usize) {
        let first_shared_user = self
            .model
            .units
            .iter()
            .position(|u| !u.uses_shared.is_empty());
        let Some(last) = self.model.units.len().checked_sub(1) else {
            return;
        };
        let floor = self.floor;
        if let Some(next) = rules::backward_next(last, floor) {
            self.prefetch(next);
        }
        if let Some(below) = rules::checkpoint_up_with(last, floor) {
            self.checkpoint_ahead(below, mb, seq);
        }
        self.reduce_unit(last, first_shared_user);
        for unit in (floor..last).rev() {
            self.gather_unit(unit);
            if let Some(next) = rules::backward_next(unit, floor) {
                self.prefetch(next);
            }
            if let Some(below) = rules::checkpoint_up_with(unit, floor) {
                self.checkpoint_ahead(below, mb, seq);
            }
            let saved = self.saved_bytes(unit, mb, seq);
            if self.checkpointing().is_some() {
                self.unit_forward_transients(unit, mb, seq);
                let b = self.input_bytes(unit, mb, seq);
                // `Checkpoints::take`: back on the device (ahead, or now), then used.
                if self.ckpt_location() == Location::Host {
                    self.checkpoint_ahead(unit, mb, seq);
                    self.ckpt_up[unit] = false;
                    self.ledger.free(Location::Device, Category::Activations, b);
                }
                self.ledger
                    .free(self.ckpt_location(), Category::Activations, b);
                self.ledger
                    .alloc(Location::Device, Category::Activations, saved);
            }
            self.ensure_micro(unit);
            if let Some(s) = self.uses_shared(unit) {
                self.ensure_micro(s);
            }
            self.unit_backward_transients(unit, mb, seq);
            self.ledger
                .free(Location::Device, Category::Activations, saved);
            self.release_unit(unit);
            self.reduce_unit(unit, first_shared_user);
        }
        for q in std::mem::take(&mut self.queued) {
            self.free_reduction(q);
        }
        self.land_downloads(0);
        self.end_backward_transients(mb, seq);
    }

    /// The optimizer boundary: stages that shard the optimizer over replicated parameters
    /// all-gather the updated shards (`Stage::publish`).
    pub(super) fn step(&mut self) {
        self.step_transients();
        self.step_swapped();
        self.publish();
        // `Group::clear_grad`: moved gradients go once the step is done.
        let moved = std::mem::take(&mut self.moved);
        self.ledger
            .free(Location::Device, Category::Gradients, moved);
    }

    fn publish(&mut self) {
        // One rank owns everything: the optimizer wrote the parameters in place.
        let world = self.groups.first().map_or(1, |g| g.layout.world_size);
        if self.stage.optimizer() != Extent::Shard || world == 1 {
            return;
        }
        for g in 0..self.groups.len() {
            if self.groups[g].params != Extent::Full {
                continue;
            }
            let shard = self.lp(self.groups[g].grads.shard_len);
            self.ledger
                .alloc(Location::Device, Category::CommBuffers, shard);
            self.ledger
                .free(Location::Device, Category::CommBuffers, shard);
        }
    }

    /// The ledger after the replay.
    pub(super) fn ledger(&self) -> &Ledger {
        self.ledger.ledger()
    }
}
