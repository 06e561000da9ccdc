//! The memory estimator: per-rank peak bytes by location and ledger category for a model, a
//! resolved config, a micro-batch and a sequence length, without a single parameter's bytes
//! (so it answers for 7B and 70B models on a laptop).
//!
//! It runs the training step ([`run`]): the real engine, from the real config, on the
//! size-only device the config's `device` names, one optimizer step, and reads what the
//! engine's ledger (and a GPU's caching allocator) measured. There is no second model of the
//! step to keep in line with the engine: a buffer the step allocates is priced because it is
//! allocated, a user's module included. Value-dependent branches take their costlier way (see
//! `backend::meta`): no overflow skips an update, and clipping binds.

mod figures;
mod run;

pub use figures::PageLockedFigures;
pub mod shape;
pub mod suggest;

use ferrozero_config::resolved::{OffloadTarget, ResolvedConfig};
use serde::Serialize;

use super::ledger::{Category, Ledger, Location};
use super::optimizer_overlap::OptimizerOverlap;
use crate::backend::MemoryModel;
use crate::nn::Model;
use crate::Result;

pub use cap::check_device_cap;
pub use suggest::{preflight, suggest, Budget, Change, Suggestion};

mod cap;

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
    /// Peak host bytes, swap buffers included: what the host must really provide per rank.
    pub fn host_total_bytes(&self) -> u64 {
        self.host.peak_bytes
    }
}

fn activation_peak(l: &Ledger) -> u64 {
    l.peak(Location::Device, Category::Activations) + l.peak(Location::Host, Category::Activations)
}

/// Estimates per-rank peak memory for training `model` under `cfg` with micro-batches of
/// `micro_batch` rows of `seq` tokens, with the optimizer overlap the config alone decides
/// ([`OptimizerOverlap::decide`]). Allocates nothing model-sized.
pub fn estimate(
    model: &Model,
    cfg: &ResolvedConfig,
    micro_batch: usize,
    seq: usize,
) -> Result<Estimate> {
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
) -> Result<Estimate> {
    let shape = (micro_batch, seq);
    let m = run::measure(model, cfg, shape, overlap)?;
    let mut flipped = cfg.clone();
    flipped.activation_checkpointing = match &cfg.activation_checkpointing {
        Some(_) => None,
        None => Some(default_checkpointing()),
    };
    let other = activation_peak(&run::measure(model, &flipped, shape, overlap)?.ledger);
    let this = activation_peak(&m.ledger);
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
    let ledger = &m.ledger;
    let mut device = Placement::from_ledger(ledger, Location::Device);
    if let Some(peak) = m.device_peak {
        device.peak_bytes = peak;
    }
    let host = Placement::from_ledger(ledger, Location::Host);
    let swap_buffer_bytes = swap_buffers(model, cfg);
    let pinned_state = pinned_state(cfg, &host, m.snapshots.taken);
    let pinned = pinned_state + swap_buffer_bytes;
    let other_host = host.peak_bytes.saturating_sub(pinned);
    Ok(Estimate {
        num_params: model.num_params() as u64,
        world_size: cfg.world_size,
        stage: cfg.zero.stage.number(),
        micro_batch,
        seq_len: seq,
        device,
        host,
        nvme: Placement::from_ledger(ledger, Location::Nvme),
        pinned_host_bytes: pinned,
        mlocked_host_bytes: mlocked_bytes(model, cfg),
        other_host_bytes: other_host,
        snapshot_host_bytes: m.snapshots.taken,
        page_locked: PageLockedFigures::of(&m),
        snapshot_group_bytes: m.snapshots.groups,
        swap_buffer_bytes,
        activations,
        reduced_bytes_per_step: m.reduced_per_micro * cfg.gradient_accumulation_steps as u64,
    })
}

/// `Estimate::mlocked_host_bytes`, by the engine's rule (`rules::mlocked_bytes`).
fn mlocked_bytes(model: &Model, cfg: &ResolvedConfig) -> u64 {
    super::rules::mlocked_bytes(cfg, largest_owned(model, cfg))
}

/// The largest range of any group rank 0 owns, which sizes the NVMe tiles.
fn largest_owned(model: &Model, cfg: &ResolvedConfig) -> usize {
    let world = super::partition::shard_world(cfg.world_size.max(1), cfg.zero.mics_shard_size);
    let stage = super::stage::for_stage(cfg.zero.stage);
    super::rules::largest_owned(model, &*stage, world, 0)
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

/// The NVMe optimizer's tile pool (`rules::nvme_pool`: `buffer_count` tiles of f32 master
/// weights and both moments), which the engine's ledger counts as host communication
/// buffers: 0 unless the optimizer state is on NVMe.
fn swap_buffers(model: &Model, cfg: &ResolvedConfig) -> u64 {
    if !matches!(cfg.zero.offload_optimizer.target, OffloadTarget::Nvme(_)) {
        return 0;
    }
    let (count, bytes, _) = super::rules::nvme_pool(cfg, largest_owned(model, cfg));
    (count as u64).saturating_mul(bytes as u64)
}
