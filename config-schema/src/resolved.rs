//! The resolved configuration: every value decided (`"auto"` replaced, defaults applied,
//! deprecated keys mapped, batch sizes derived and checked against the world size).
//! This is the only configuration type the engine reads.

use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;

/// ZeRO stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum ZeroStage {
    /// Plain data parallelism.
    Stage0,
    /// Optimizer state partitioned.
    Stage1,
    /// Optimizer state and gradients partitioned.
    Stage2,
    /// Optimizer state, gradients and parameters partitioned.
    Stage3,
}

impl ZeroStage {
    /// The stage number, 0 to 3.
    pub fn number(self) -> u8 {
        match self {
            ZeroStage::Stage0 => 0,
            ZeroStage::Stage1 => 1,
            ZeroStage::Stage2 => 2,
            ZeroStage::Stage3 => 3,
        }
    }
}

/// Where offloaded state lives.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub enum OffloadTarget {
    /// Not offloaded.
    None,
    /// Host memory.
    Cpu,
    /// NVMe files under this directory.
    Nvme(PathBuf),
}

/// `offload_param` / `offload_optimizer`, resolved.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Offload {
    /// Where the state lives.
    pub target: OffloadTarget,
    /// Page-lock host buffers.
    pub pin_memory: bool,
    /// Swap buffers in the pool.
    pub buffer_count: usize,
    /// Elements per swap buffer.
    pub buffer_size: usize,
    /// Elements kept in host memory at most (parameters offloaded to NVMe).
    pub max_in_cpu: usize,
    /// When the locked-memory limit cannot hold the pinned buffers: use pageable buffers
    /// instead of refusing to start (ferrozero's own `pin_memory_fallback`).
    pub pin_memory_fallback: bool,
}

/// `zero_optimization`, resolved.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ZeroConfig {
    /// The stage.
    pub stage: ZeroStage,
    /// Overlap gradient reduction and parameter gathering with compute.
    pub overlap_comm: bool,
    /// Use reduce-scatter rather than all-reduce for gradients (stages 1-2).
    pub reduce_scatter: bool,
    /// Elements per gradient-reduction bucket.
    pub reduce_bucket_size: usize,
    /// Elements per all-gather bucket.
    pub allgather_bucket_size: usize,
    /// Elements per optimizer-step tile; 0 means one sub-group per parameter (DeepSpeed), which
    /// the engine turns into tiles as large as the model's largest parameter.
    pub sub_group_size: usize,
    /// Elements prefetched ahead (stage 3).
    pub prefetch_bucket_size: usize,
    /// Parameters with fewer elements stay resident (stage 3).
    pub param_persistence_threshold: usize,
    /// Maximum elements gathered at once (stage 3).
    pub max_live_parameters: usize,
    /// Do not release a parameter that will be reused within this many elements (stage 3).
    pub max_reuse_distance: usize,
    /// ZeRO++ hpZ's secondary parameter partition size (stage 3); 0 or 1 = off.
    pub hpz_partition_size: usize,
    /// ZeRO++ qwZ: stage-3 parameter gathers carry int8 codes and block scales (false below
    /// stage 3, where nothing is gathered).
    pub quantized_weights: bool,
    /// Frozen parameters' stage-3 gathers are quantized (`zero_quantized_nontrainable_weights`).
    pub quantized_nontrainable_weights: bool,
    /// ZeRO++ qgZ: stage-3 gradient reductions are quantized all-to-alls (false below stage 3).
    pub quantized_gradients: bool,
    /// MiCS shard group size: all state sharded inside groups of this many ranks and
    /// replicated across groups; 0 = off, 1 = each rank its own group (state replicated).
    pub mics_shard_size: usize,
    /// Parameter offload (stage 3 only).
    pub offload_param: Offload,
    /// Optimizer-state offload.
    pub offload_optimizer: Offload,
}

/// Dynamic or static loss scaling for fp16.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub enum LossScaling {
    /// A fixed scale.
    Static(f64),
    /// DeepSpeed's dynamic loss scaler.
    Dynamic {
        /// Initial scale is `2^initial_scale_power`.
        initial_scale_power: u32,
        /// Clean iterations before the scale doubles.
        loss_scale_window: u64,
        /// Overflows tolerated before the scale halves.
        hysteresis: u32,
        /// Refill hysteresis on every clean step.
        consecutive_hysteresis: bool,
        /// Floor for the scale.
        min_loss_scale: f64,
    },
}

/// Compute precision.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub enum Precision {
    /// Everything f32.
    F32,
    /// bf16 parameter copies and communication, f32 master weights; no loss scaling.
    Bf16,
    /// fp16 parameter copies and communication, f32 master weights, with loss scaling.
    Fp16(LossScaling),
}

/// Optimizer, resolved (DeepSpeed's `"Adam"` with `adam_w_mode: true` is AdamW).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub enum OptimizerConfig {
    /// Adam with L2 or decoupled (AdamW) weight decay.
    Adam {
        /// Learning rate.
        lr: f64,
        /// (beta1, beta2).
        betas: (f64, f64),
        /// Epsilon.
        eps: f64,
        /// Weight decay.
        weight_decay: f64,
        /// Decoupled weight decay (AdamW) rather than L2.
        adam_w_mode: bool,
        /// Apply bias correction.
        bias_correction: bool,
    },
    /// SGD with momentum.
    Sgd {
        /// Learning rate.
        lr: f64,
        /// Momentum.
        momentum: f64,
        /// Dampening.
        dampening: f64,
        /// Weight decay (L2).
        weight_decay: f64,
        /// Nesterov momentum.
        nesterov: bool,
    },
    /// Lion.
    Lion {
        /// Learning rate.
        lr: f64,
        /// (beta1, beta2).
        betas: (f64, f64),
        /// Decoupled weight decay.
        weight_decay: f64,
    },
    /// LAMB with DeepSpeed's `FusedLamb` semantics (the formula is documented on
    /// `ferrozero_offload::optim::lamb_moments`'s module): Adam's moments, a per-tensor trust
    /// ratio.
    Lamb {
        /// Learning rate.
        lr: f64,
        /// (beta1, beta2).
        betas: (f64, f64),
        /// Epsilon.
        eps: f64,
        /// `sqrt(v + eps)` rather than `sqrt(v) + eps`.
        eps_inside_sqrt: bool,
        /// Weight decay, added to the update direction.
        weight_decay: f64,
        /// Fold the bias corrections into the step size.
        bias_correction: bool,
        /// Upper clamp of the trust ratio.
        max_coeff: f64,
        /// Lower clamp of the trust ratio.
        min_coeff: f64,
    },
}

impl OptimizerConfig {
    /// The base learning rate.
    pub fn lr(&self) -> f64 {
        match self {
            OptimizerConfig::Adam { lr, .. }
            | OptimizerConfig::Sgd { lr, .. }
            | OptimizerConfig::Lion { lr, .. }
            | OptimizerConfig::Lamb { lr, .. } => *lr,
        }
    }
}

/// LR schedule, resolved, with DeepSpeed's parameter names.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub enum SchedulerConfig {
    /// Warm up from `warmup_min_lr` to `warmup_max_lr`, then hold.
    WarmupLR {
        /// Start of warmup.
        warmup_min_lr: f64,
        /// End of warmup.
        warmup_max_lr: f64,
        /// Warmup steps.
        warmup_num_steps: u64,
        /// `"log"` or `"linear"`.
        warmup_type: WarmupType,
    },
    /// Warmup, then linear decay to zero at `total_num_steps`.
    WarmupDecayLR {
        /// Total steps.
        total_num_steps: u64,
        /// Start of warmup.
        warmup_min_lr: f64,
        /// End of warmup.
        warmup_max_lr: f64,
        /// Warmup steps.
        warmup_num_steps: u64,
        /// `"log"` or `"linear"`.
        warmup_type: WarmupType,
    },
    /// Warmup as a ratio of the optimizer's lr, then cosine decay.
    WarmupCosineLR {
        /// Total steps.
        total_num_steps: u64,
        /// Warmup starts at `warmup_min_ratio * lr`.
        warmup_min_ratio: f64,
        /// Warmup steps.
        warmup_num_steps: u64,
        /// Cosine ends at `cos_min_ratio * lr`.
        cos_min_ratio: f64,
        /// `"log"` or `"linear"`.
        warmup_type: WarmupType,
    },
    /// The 1-cycle policy (learning rate and momentum).
    OneCycle {
        /// Lowest lr of the cycle.
        cycle_min_lr: f64,
        /// Highest lr of the cycle.
        cycle_max_lr: f64,
        /// Decay rate after the cycle.
        decay_lr_rate: f64,
        /// Steps of the rising half.
        cycle_first_step_size: u64,
        /// Steps of the falling half (defaults to the first).
        cycle_second_step_size: u64,
        /// Step interval of the rising half.
        cycle_first_stair_count: u64,
        /// Step interval of the falling half.
        cycle_second_stair_count: u64,
        /// Decay interval after the cycle.
        decay_step_size: u64,
        /// Cycle momentum too.
        cycle_momentum: bool,
        /// Lowest momentum.
        cycle_min_mom: f64,
        /// Highest momentum.
        cycle_max_mom: f64,
        /// Momentum decay rate after the cycle.
        decay_mom_rate: f64,
    },
}

/// Warmup curve.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum WarmupType {
    /// Logarithmic (DeepSpeed's default).
    Log,
    /// Linear.
    Linear,
}

/// `activation_checkpointing`, resolved. Present means the engine checkpoints every unit's
/// input (but the last unit's in `train_batch`, which runs forward and backward at once). (DeepSpeed's other keys there tune memory layout or logging; they are accepted at
/// their defaults and ignored with a warning otherwise.)
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ActivationCheckpointing {
    /// Keep checkpointed activations in host memory.
    pub cpu_checkpointing: bool,
}

/// `aio`, resolved.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AioConfig {
    /// Bytes per I/O request.
    pub block_size: usize,
    /// Requests in flight.
    pub queue_depth: usize,
    /// Threads (or rings) per operation.
    pub intra_op_parallelism: usize,
    /// Submit requests one at a time.
    pub single_submit: bool,
    /// Overlap submission and completion.
    pub overlap_events: bool,
}

/// A dtype gradients are reduced in (`communication_data_type`).
pub use crate::model::CommDataType;

/// Communicator backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum CommBackend {
    /// Ranks as threads in one process (the default).
    Local,
    /// MPI across processes.
    Mpi,
    /// NCCL on GPUs.
    Nccl,
}

/// `comms` (ferrozero's own section), resolved.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CommsConfig {
    /// Backend.
    pub backend: CommBackend,
    /// Every collective fails after this long without progress.
    pub timeout: Duration,
    /// How MPI and NCCL form sums.
    pub reduction: CommReduction,
    /// `communication_data_type`: the dtype gradient reductions carry on the wire (each
    /// rank's contribution rounded to it once, sums in f32 rounded once per hop); `None`
    /// reduces in the gradients' own dtype (the training precision).
    pub data_type: Option<CommDataType>,
}

/// How the MPI backend forms sums (`comms.reduction`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum CommReduction {
    /// MPI's own reduction for f32 sums (fastest; rank order only at two ranks).
    Native,
    /// Rank-ordered sums, bitwise equal to the local backend at every world size.
    RankOrdered,
}

/// Which of the optimizer's values stay in bf16 instead of f32 (`bf16.bf16_master_weights_and_grads`,
/// `bf16.bf16_optimizer_states`); both off outside bf16.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Bf16State {
    /// No f32 master weights: the optimizer updates the bf16 parameters themselves.
    pub master_weights_and_grads: bool,
    /// The optimizer's moments are stored in bf16.
    pub optimizer_states: bool,
}

/// The whole resolved configuration.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ResolvedConfig {
    /// Global batch in samples.
    pub train_batch_size: usize,
    /// Samples per rank per micro-step.
    pub train_micro_batch_size_per_gpu: usize,
    /// Micro-steps per optimizer step.
    pub gradient_accumulation_steps: usize,
    /// Data-parallel world size the batch rule was checked against.
    pub world_size: usize,
    /// Clip the global gradient norm to this; 0 disables.
    pub gradient_clipping: f64,
    /// Log every this many steps.
    pub steps_per_print: usize,
    /// Time forward, backward, reduction and step separately.
    pub wall_clock_breakdown: bool,
    /// Seed for parameter init and dropout.
    pub seed: u64,
    /// The device the model computes on (`Auto` is decided when the engine opens it).
    pub device: crate::Device,
    /// Cap on each rank's device bytes (`device_memory_limit`), if any.
    pub device_memory_limit: Option<u64>,
    /// ZeRO settings.
    pub zero: ZeroConfig,
    /// Precision and loss scaling.
    pub precision: Precision,
    /// Optimizer values kept in bf16 (bf16 precision only).
    pub bf16_state: Bf16State,
    /// Micro-step gradients accumulate in f32 although the run is half precision
    /// (`data_types.grad_accum_dtype = "fp32"`); otherwise in the training precision.
    pub grad_accum_f32: bool,
    /// Optimizer.
    pub optimizer: OptimizerConfig,
    /// LR schedule, if any.
    pub scheduler: Option<SchedulerConfig>,
    /// Activation checkpointing, if enabled.
    pub activation_checkpointing: Option<ActivationCheckpointing>,
    /// Async I/O for NVMe offload.
    pub aio: AioConfig,
    /// Communicator.
    pub comms: CommsConfig,
    /// Monitors and the communication logger.
    pub monitor: MonitorConfig,
}

/// `tensorboard`, `csv_monitor`, `comms_logger` and `flops_profiler`, resolved: `None` where
/// disabled.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct MonitorConfig {
    /// TensorBoard event files.
    pub tensorboard: Option<MonitorOutput>,
    /// CSV files, one per scalar.
    pub csv_monitor: Option<MonitorOutput>,
    /// The communication logger.
    pub comms_logger: Option<CommsLoggerConfig>,
    /// The FLOPs profiler.
    pub flops_profiler: Option<FlopsProfilerConfig>,
    /// The device's peak dense TFLOP/s for `mfu` (`flops_profiler.peak_tflops`), when given;
    /// otherwise the device's datasheet figure where it is known.
    pub peak_tflops: Option<f64>,
}

/// `flops_profiler`, resolved.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FlopsProfilerConfig {
    /// The global optimizer step (1-based) profiled.
    pub profile_step: u64,
    /// Levels of the module tree printed (0 the model, 1 its units, 2 units by kernel
    /// family); `None` every level.
    pub module_depth: Option<usize>,
    /// The heaviest modules named per level.
    pub top_modules: usize,
    /// Print the per-module table.
    pub detailed: bool,
    /// Where the table goes; `None` standard output.
    pub output_file: Option<PathBuf>,
}

/// Where one monitor writes.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MonitorOutput {
    /// `output_path/job_name`.
    pub dir: PathBuf,
    /// Every rank writes (into `dir/rank<N>`), not only rank 0.
    pub all_ranks: bool,
}

/// `comms_logger`, resolved.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CommsLoggerConfig {
    /// Log each collective as it completes.
    pub verbose: bool,
    /// Record every kind of collective.
    pub prof_all: bool,
    /// The kinds recorded when `prof_all` is off (DeepSpeed's names).
    pub prof_ops: Vec<String>,
    /// Name records by their caller too.
    pub debug: bool,
}
