//! The memory estimator: per-rank peak bytes by location and ledger category for a model, a
//! resolved config, a micro-batch and a sequence length, computed without allocating a
//! single parameter (so it answers for 7B and 13B models on a laptop).
//!
//! It replays the engine's buffer lifetimes (see [`replay`]) rather than applying closed
//! formulas, so activations, communication staging and working copies are counted exactly as
//! the engine's ledger counts them, and the engine's pre-flight check and `ferrozero
//! estimate` give the same answer. The decisions that shape those lifetimes are the engine's
//! own functions ([`super::rules`]), not copies.
//!
//! The device is priced from its description ([`MemoryModel`], from the config's `device`
//! without opening it: [`memory_model`]), the same description the backend reports and the
//! layers size their saved state with. On the CPU that reproduces the engine's ledger (f32
//! activations, attention probabilities, f32 working copies). On a GPU it is the caching
//! allocator's view: the activation dtype, per-row log-sum-exp instead of probabilities and
//! logits, no working copies, 512-byte blocks, and the buffers that live only during a call
//! (which the allocator counts and the ledger does not). A struct rather than a trait object
//! because a laptop must describe a GPU it does not have; the layers' formulas take it, so the
//! description a real run reports and the one the estimator reads cannot differ.

mod book;
mod cap;
mod replay;

pub use replay::PageLockedFigures;
pub mod shape;
pub mod suggest;

use ferrozero_config::resolved::{OffloadTarget, ResolvedConfig};
use serde::Serialize;

use super::ledger::{Category, Ledger, Location};
use super::optimizer::Optimizer;
use super::optimizer_overlap::OptimizerOverlap;
use crate::backend::MemoryModel;
use crate::nn::Model;

pub use cap::check_device_cap;
pub use suggest::{preflight, suggest, Budget, Change, Suggestion};

/// Peak bytes at one location: the peak of the total, and each category's own peak.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Placement {
    /// Peak of the location's total (what must fit), as the ledger's `peak_total`.
    pub peak_bytes: u64,
    /// Each category's peak, in [`Category::ALL`] order. Peaks of different categories need
    /// not coincide, so these may sum to more than `peak_bytes`.
    pub by_category: Vec<(Category, u64)>,
}

impl Placement {
    fn from_ledger(l: &Ledger, loc: Location) -> Self {
        Placement {
            peak_bytes: l.peak_total(loc),
            by_category: Category::ALL.iter().map(|&c| (c, l.peak(loc, c))).collect(),
        }
    }

    /// The peak of one category.
    pub fn category(&self, c: Category) -> u64 {
        self.by_category
            .iter()
            .find(|(k, _)| *k == c)
            .map_or(0, |&(_, b)| b)
    }
}

/// Per-rank memory estimate for one configuration.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Estimate {
    /// Parameters in the model (shared ones counted once).
    pub num_params: u64,
    /// Data-parallel ranks.
    pub world_size: usize,
    /// ZeRO stage, 0 to 3.
    pub stage: u8,
    /// Rows per micro-batch.
    pub micro_batch: usize,
    /// Tokens per row.
    pub seq_len: usize,
    /// Device memory (on CPU runs: the working set that would live on the GPU).
    pub device: Placement,
    /// Host memory the engine's ledger counts (offloaded state, CPU-checkpointed activations).
    pub host: Placement,
    /// NVMe swap files.
    pub nvme: Placement,
    /// Host bytes `pin_memory` asks to pin, as DeepSpeed counts them: offloaded state with
    /// `pin_memory`, plus swap buffers. What is really locked is less: see
    /// `mlocked_host_bytes` (charged against `RLIMIT_MEMLOCK`) and `page_locked` (registered
    /// with a device's driver, charged against host RAM only).
    pub pinned_host_bytes: u64,
    /// Host bytes locked with `mlock`, the only ones the kernel charges against
    /// `RLIMIT_MEMLOCK` (`rules::mlocked_bytes`: the NVMe optimizer's buffer pool under
    /// `offload_optimizer.pin_memory`); the locked-memory pre-flight compares this figure.
    pub mlocked_host_bytes: u64,
    /// Host bytes that are ordinary pageable memory.
    pub other_host_bytes: u64,
    /// Host bytes of the speculative optimizer overlap's snapshots (pageable; included in
    /// `host`), 0 when the overlap estimated is not speculative.
    pub snapshot_host_bytes: u64,
    /// Each group's snapshot bytes were it snapshotted, in the engine's group order: what a
    /// speculative overlap bounded by host memory plans from (`OptimizerOverlap::decide_for_host`).
    pub snapshot_group_bytes: Vec<u64>,
    /// Host bytes the device page-locks for this run (its parameter store, its copies'
    /// staging buffers, its upload ring, its host gradient accumulators), as its driver
    /// counts registrations; 0 on the CPU. Resident and unswappable, so charged against host
    /// RAM (and a cgroup's limit), but not against `RLIMIT_MEMLOCK`.
    pub page_locked: PageLockedFigures,
    /// Pinned staging buffers for NVMe swaps (see `swap_buffers`). The engine's ledger does
    /// not count these yet; they are included in `pinned_host_bytes`.
    pub swap_buffer_bytes: u64,
    /// Peak activation bytes in both checkpointing modes (one of them is the config's), so a
    /// user sees what checkpointing buys.
    pub activations: ActivationFigures,
    /// Gradient bytes each rank hands to reductions per optimizer step (every micro-step's
    /// padded gradients in `communication_data_type`), as the step report's `reduced_bytes`
    /// counts them; 0 at world size 1.
    pub reduced_bytes_per_step: u64,
}

/// Peak activation bytes (device plus host) in both checkpointing modes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ActivationFigures {
    /// Every unit's saved state kept from forward to backward.
    pub without_checkpointing: u64,
    /// Unit inputs kept; one unit's saved state alive during its recompute and backward.
    pub with_checkpointing: u64,
}

impl Estimate {
    /// Peak host bytes including swap buffers: what the host must really provide per rank.
    pub fn host_total_bytes(&self) -> u64 {
        self.host.peak_bytes + self.swap_buffer_bytes
    }
}

/// What one replayed step leaves: its ledger, the snapshots' host bytes, each group's snapshot
/// bytes and the page-locked bytes.
type Replayed = (Ledger, u64, Vec<u64>, PageLockedFigures);

/// Replays one step.
fn replay_ledger(
    model: &Model,
    cfg: &ResolvedConfig,
    micro_batch: usize,
    seq: usize,
    overlap: &OptimizerOverlap,
) -> Replayed {
    let moments = Optimizer::new(cfg.optimizer.clone()).moments();
    let mut r = replay::Replay::build(model, cfg, moments, overlap, memory_model(cfg));
    r.forward(micro_batch, seq);
    r.backward(micro_batch, seq);
    r.step();
    let groups = std::mem::take(&mut r.snapshot_group_bytes);
    (
        r.ledger().clone(),
        r.snapshot_bytes,
        groups,
        r.page_locked(),
    )
}

fn activation_peak(l: &Ledger) -> u64 {
    l.peak(Location::Device, Category::Activations) + l.peak(Location::Host, Category::Activations)
}

/// Estimates per-rank peak memory for training `model` under `cfg` with micro-batches of
/// `micro_batch` rows of `seq` tokens, with the optimizer overlap the config alone decides
/// ([`OptimizerOverlap::decide`]). Allocates nothing model-sized.
pub fn estimate(model: &Model, cfg: &ResolvedConfig, micro_batch: usize, seq: usize) -> Estimate {
    estimate_with_overlap(model, cfg, micro_batch, seq, &OptimizerOverlap::decide(cfg))
}

/// As [`estimate`], for an engine built with `overlap` (the builder's memory-aware decision
/// may turn a speculative overlap off, and then no snapshot is counted).
pub fn estimate_with_overlap(
    model: &Model,
    cfg: &ResolvedConfig,
    micro_batch: usize,
    seq: usize,
    overlap: &OptimizerOverlap,
) -> Estimate {
    // As the engine does: `sub_group_size = 0` sizes tiles by the largest parameter.
    let mut own = cfg.clone();
    own.zero.sub_group_size = super::build::effective_sub_group_size(cfg, model);
    let cfg = &own;
    let (ledger, snapshot_host_bytes, snapshot_group_bytes, page_locked) =
        replay_ledger(model, cfg, micro_batch, seq, overlap);
    let mut flipped = cfg.clone();
    flipped.activation_checkpointing = match &cfg.activation_checkpointing {
        Some(_) => None,
        None => Some(default_checkpointing()),
    };
    let other = activation_peak(&replay_ledger(model, &flipped, micro_batch, seq, overlap).0);
    let this = activation_peak(&ledger);
    let activations = match cfg.activation_checkpointing {
        Some(_) => ActivationFigures {
            without_checkpointing: other,
            with_checkpointing: this,
        },
        None => ActivationFigures {
            without_checkpointing: this,
            with_checkpointing: other,
        },
    };
    let host = Placement::from_ledger(&ledger, Location::Host);
    let swap_buffer_bytes = swap_buffers(cfg);
    let pinned_state = pinned_state(cfg, &host, snapshot_host_bytes);
    let pinned = pinned_state + swap_buffer_bytes;
    let other_host = host.peak_bytes.saturating_sub(pinned_state);
    Estimate {
        num_params: model.num_params() as u64,
        world_size: cfg.world_size,
        stage: cfg.zero.stage.number(),
        micro_batch,
        seq_len: seq,
        device: Placement::from_ledger(&ledger, Location::Device),
        host,
        nvme: Placement::from_ledger(&ledger, Location::Nvme),
        pinned_host_bytes: pinned,
        mlocked_host_bytes: mlocked_bytes(model, cfg),
        other_host_bytes: other_host,
        snapshot_host_bytes,
        snapshot_group_bytes,
        page_locked,
        swap_buffer_bytes,
        activations,
        reduced_bytes_per_step: reduced_per_step(model, cfg),
    }
}

/// `Estimate::mlocked_host_bytes`, by the engine's rule (`rules::mlocked_bytes`).
fn mlocked_bytes(model: &Model, cfg: &ResolvedConfig) -> u64 {
    let world = super::partition::shard_world(cfg.world_size.max(1), cfg.zero.mics_shard_size);
    let stage = super::stage::for_stage(cfg.zero.stage);
    let largest = super::rules::largest_owned(model, &*stage, world, 0);
    super::rules::mlocked_bytes(cfg, largest)
}

/// `Estimate::reduced_bytes_per_step`: each group's padded gradient in the wire dtype, once
/// per micro-step, when there is anyone to reduce with.
fn reduced_per_step(model: &Model, cfg: &ResolvedConfig) -> u64 {
    if cfg.world_size <= 1 {
        return 0;
    }
    let moments = Optimizer::new(cfg.optimizer.clone()).moments();
    let overlap = OptimizerOverlap::decide(cfg);
    let per_micro = replay::Replay::build(model, cfg, moments, &overlap, memory_model(cfg))
        .reduced_bytes_per_micro();
    per_micro * cfg.gradient_accumulation_steps as u64
}

/// The device `cfg` runs on, described without opening it: its `device` key, activations in
/// the precision's storage dtype (as `Engine::new` opens it).
pub fn memory_model(cfg: &ResolvedConfig) -> MemoryModel {
    MemoryModel::for_device(cfg.device, super::build::storage_dtype(&cfg.precision))
}

/// Checkpointing on every unit, activations kept on the device.
pub fn default_checkpointing() -> ferrozero_config::resolved::ActivationCheckpointing {
    ferrozero_config::resolved::ActivationCheckpointing {
        cpu_checkpointing: false,
    }
}

/// Host-resident model state that `pin_memory` page-locks; the speculative overlap's
/// `snapshots`, counted as host optimizer state, are ordinary pageable buffers.
fn pinned_state(cfg: &ResolvedConfig, host: &Placement, snapshots: u64) -> u64 {
    let z = &cfg.zero;
    let mut b = 0;
    if z.offload_param.pin_memory && z.offload_param.target == OffloadTarget::Cpu {
        b += host.category(Category::Parameters);
    }
    if z.offload_optimizer.pin_memory && z.offload_optimizer.target == OffloadTarget::Cpu {
        b += host
            .category(Category::OptimizerState)
            .saturating_sub(snapshots);
    }
    b
}

/// Pinned staging for optimizer state swapped to NVMe, sized as DeepSpeed sizes it:
/// `buffer_count` sub-groups of f32 state. (Parameter shards swapped from NVMe occupy host
/// buffers that the ledger itself counts, as `Prefetch` on the host, so they are in the
/// replayed host peak rather than here.)
fn swap_buffers(cfg: &ResolvedConfig) -> u64 {
    let z = &cfg.zero;
    let nvme = |o: &ferrozero_config::resolved::Offload| matches!(o.target, OffloadTarget::Nvme(_));
    let mut b = 0u64;
    if nvme(&z.offload_optimizer) {
        b += z.offload_optimizer.buffer_count as u64 * z.sub_group_size as u64 * 4;
    }
    b
}
