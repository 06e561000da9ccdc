//! What one optimizer step reports.

use serde::Serialize;

use crate::ledger::LedgerReport;

/// Wall-clock time per phase of one step, in seconds (filled when `wall_clock_breakdown` is on).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Timings {
    /// Forward passes (including stage-3 gathers).
    pub forward: f64,
    /// Backward passes (including recomputation).
    pub backward: f64,
    /// Gradient reduction.
    pub reduce: f64,
    /// Parameter gathering (stage 3) and publishing (stages 1-2).
    pub gather: f64,
    /// Optimizer step; when it overlaps backward, only the time the step waited for the
    /// optimizer lane after backward (the part the overlap did not hide).
    pub optimizer: f64,
}

/// The outcome of one optimizer step.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepReport {
    /// Optimizer steps taken so far, including this one (skipped steps count).
    pub step: u64,
    /// Mean loss over every target token of the global batch, before the update.
    pub loss: f64,
    /// Learning rate used.
    pub lr: f64,
    /// Loss scale in force for this step's backward.
    pub loss_scale: f64,
    /// Whether the update was skipped because gradients overflowed.
    pub skipped: bool,
    /// Global gradient norm before clipping (unscaled); NaN when the step overflowed.
    pub grad_norm: f64,
    /// Target tokens in the global batch.
    pub tokens: u64,
    /// Per-phase timings.
    pub timings: Timings,
    /// This rank's memory ledger.
    pub memory: LedgerReport,
    /// The device's memory as its allocator measured it (shared by the ranks on the device);
    /// `None` on the CPU, where the ledger is the only count.
    pub device_memory: Option<crate::backend::DeviceMemory>,
    /// Bytes this rank moved to and from NVMe during the step (parameter shards and
    /// optimizer state; zero without NVMe offload).
    pub swap: SwapTraffic,
    /// Bytes this rank sent across hybrid-sharding groups during the step (gradient shards
    /// all-reduced between the groups, counted as a ring sends them: `2 (R - 1) / R` of the
    /// payload for `R` groups); zero without hybrid sharding.
    pub cross_group_bytes: u64,
    /// Gradient bytes this rank handed to reductions during the step (every micro-step's
    /// all-reduce or reduce-scatter input, in `communication_data_type`: half the f32 figure
    /// in bf16 or fp16); zero at world size 1.
    pub reduced_bytes: u64,
    /// The FLOPs profiler's measurements when this is `flops_profiler.profile_step`.
    pub flops_profile: Option<crate::profiler::FlopsProfile>,
    /// What this rank asked of its device since the previous step (or since `train_batch`
    /// began): host syncs, kernel launches, copies, as the driver layer counted them. `None`
    /// on the CPU. With ranks as threads sharing one device the counts are the device's.
    pub device_activity: Option<crate::backend::DeviceActivity>,
}

/// NVMe bytes moved by one rank in one step.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct SwapTraffic {
    /// Bytes read from swap files.
    pub read_bytes: u64,
    /// Bytes written to swap files.
    pub written_bytes: u64,
}
