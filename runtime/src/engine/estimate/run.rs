//! The estimate is a run: the real engine, built from the real config on the size-only device
//! the config's `device` names, takes one real optimizer step, and its ledger (and, on a GPU,
//! the caching allocator) say what it held. Nothing here knows what a layer saves or what the
//! engine allocates: a new buffer anywhere in the step is priced by being allocated.
//!
//! The size-only devices hold no bytes: the CPU stands in as [`MetaBackend`]; a GPU as the real
//! CUDA backend over the size-only driver ([`crate::backend::cuda::meta`]), so its caching
//! allocator rounds and caches as on the card. One rank of the world is simulated
//! ([`MetaComm`]); every rank holds the same shapes (layouts are padded to equal shards).

use std::sync::Arc;

use ferrozero_config::resolved::ResolvedConfig;

use crate::backend::Backend;
use crate::comm::meta::MetaComm;
use crate::engine::ledger::Ledger;
use crate::engine::optimizer_overlap::{
    shared_group, snapshot_figures, OptimizerOverlap, SnapshotFigures,
};
use crate::engine::Engine;
use crate::nn::{Batch, Model};
use crate::Result;

/// Micro-steps a measured step runs: the second one sees every buffer the first leaves for
/// the step (accumulators, reduced gradients), so more add nothing but time.
const MEASURED_MICRO_STEPS: usize = 2;

/// Optimizer steps a measurement runs: the second one sees every buffer the first leaves for
/// the next (the last groups' upload staging, which the upload window holds across the step
/// boundary, and each snapshot's staging, kept until its next save); a run's later steps hold
/// what its second does.
const MEASURED_STEPS: usize = 2;

/// The clipping threshold a speculative overlap is measured with: above the size-only norm
/// (whose sums of squares pass any configured threshold), so the lane saves and steps every
/// planned group and its snapshots hold their staging, as on a step whose speculation stands.
/// With the configured threshold the lane would stop at its first group (the norm already
/// passes it), saving nothing: the step would be priced without a single snapshot.
const SPECULATION_STANDS: f64 = f32::MAX as f64;

/// What one measured step held.
pub(super) struct Measured {
    /// The engine's ledger after the step (its peaks by location and category).
    pub ledger: Ledger,
    /// The device allocator's peak of live bytes, where the device counts every buffer (a
    /// GPU's caching allocator); `None` where the ledger is the device's count (the CPU).
    pub device_peak: Option<u64>,
    /// Bytes of gradients the rank handed to reductions, per micro-step.
    pub reduced_per_micro: u64,
    /// The snapshots the overlap takes, and each group's were it snapshotted.
    pub snapshots: SnapshotFigures,
    /// Page-locked host bytes at the peak, and of them the engine's own registrations.
    pub page_locked: (u64, u64),
    /// The device's page-locked small-upload ring (0 where nothing is page-locked).
    pub upload_ring: u64,
}

/// Runs one optimizer step of `model` under `cfg` (micro-batches of `micro` rows of `seq`
/// tokens, the optimizer overlap `overlap`) on the size-only device `cfg` names, as rank 0.
pub(super) fn measure(
    model: &Model,
    cfg: &ResolvedConfig,
    (micro, seq): (usize, usize),
    overlap: &OptimizerOverlap,
) -> Result<Measured> {
    let cfg = for_measuring(cfg, micro, overlap);
    let be = size_only_device(&cfg)?;
    let comm = MetaComm::new(0, cfg.world_size, cfg.comms.backend)?;
    let steps = cfg.gradient_accumulation_steps;
    let mut engine = Engine::with_backend_and_overlap(
        model.clone(),
        cfg,
        Box::new(comm),
        be.clone(),
        overlap.clone(),
    )?;
    let batch = Batch {
        batch: micro,
        seq,
        tokens: vec![0; micro * seq],
        targets: vec![0; micro * seq],
    };
    let batches = vec![batch; steps];
    let mut report = engine.train_batch(&batches)?;
    for _ in 1..MEASURED_STEPS {
        report = engine.train_batch(&batches)?;
    }
    let snapshots = snapshot_figures(overlap, &engine.groups, shared_group(model));
    let mut ledger = engine.ledger().clone();
    // The ledger samples the device's registrations at each forward and backward: what the
    // last optimizer step registered (its staging, its snapshots') is sampled here, as the
    // next step's forward would.
    ledger.observe_device_locked(be.page_locked_bytes());
    Ok(Measured {
        page_locked: (ledger.page_locked().1, ledger.engine_locked()),
        ledger,
        device_peak: be.memory_stats().map(|m| m.peak),
        reduced_per_micro: report.reduced_bytes / steps as u64,
        snapshots,
        upload_ring: be.memory_model().upload_ring,
    })
}

/// `cfg` as a measured step runs it: the micro-batch given, at most
/// [`MEASURED_MICRO_STEPS`] micro-steps, no device cap (the estimate reports the peak; the
/// cap is compared with it afterwards), a speculative `overlap`'s clipping at
/// [`SPECULATION_STANDS`], and nothing that writes files or reports.
fn for_measuring(cfg: &ResolvedConfig, micro: usize, overlap: &OptimizerOverlap) -> ResolvedConfig {
    let mut c = cfg.clone();
    if matches!(overlap, OptimizerOverlap::Speculative(..)) && c.gradient_clipping > 0.0 {
        c.gradient_clipping = SPECULATION_STANDS;
    }
    c.gradient_accumulation_steps = c.gradient_accumulation_steps.min(MEASURED_MICRO_STEPS);
    c.train_micro_batch_size_per_gpu = micro;
    c.train_batch_size = micro * c.gradient_accumulation_steps * c.world_size;
    c.device_memory_limit = None;
    let m = &mut c.monitor;
    (
        m.tensorboard,
        m.csv_monitor,
        m.comms_logger,
        m.flops_profiler,
    ) = (None, None, None, None);
    c.wall_clock_breakdown = false;
    c
}

/// The size-only stand-in for `cfg`'s device, with room for any peak (the estimate reports
/// it; the budget decides whether it fits).
fn size_only_device(cfg: &ResolvedConfig) -> Result<Arc<dyn Backend>> {
    let act = crate::engine::build::storage_dtype(&cfg.precision);
    crate::backend::size_only(cfg.device, act)
}
