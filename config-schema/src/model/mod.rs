//! The typed configuration as written by the user (defaults applied, `"auto"` kept), and the
//! walk that reads it from the spanned tree.

mod auto;
mod data_types;
mod device;
mod monitor;
mod offload;
mod optimizer;
mod precision;
mod profiler;
mod runtime;
mod scheduler;
mod size;
mod zenflow;
mod zero;

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

use schemars::JsonSchema;
use serde::Serialize;

pub use auto::AutoOr;
pub use data_types::DataTypes;
pub use device::Device;
pub use monitor::{CommsLoggerSection, MonitorSection, COMM_OPS};
pub use offload::{OffloadDevice, OffloadSection};
pub use optimizer::{Optimizer, OptimizerParams, OptimizerType};
pub use precision::{Bf16, Fp16};
pub use profiler::FlopsProfilerSection;
pub use runtime::{ActivationCheckpointingSection, Aio, Backend, Comms, Reduction};
pub use scheduler::{Scheduler, SchedulerParams, SchedulerType, WarmupKind};
pub use size::{parse_size, ByteSize};
pub use zenflow::ZenFlowSection;
pub use zero::ZeroOptimization;

use crate::parse::Node;
use crate::reader::{auto_or, off, to_f64, to_str, to_uint, Cx, Support, TableReader};

/// A ferrozero / DeepSpeed configuration file, typed.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
#[schemars(
    title = "ferrozero configuration",
    description = "DeepSpeed-compatible training configuration for ferrozero (TOML or JSON)."
)]
pub struct Config {
    /// JSON Schema reference for editors; ignored.
    #[serde(rename = "$schema", skip_serializing_if = "Option::is_none")]
    pub schema: Option<String>,
    /// Global batch in samples per optimizer step: micro-batch × accumulation × world size;
    /// unset, it is derived from the other two (DeepSpeed's batch rule). Give it or the
    /// micro-batch at least.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub train_batch_size: Option<AutoOr<u64>>,
    /// Samples per rank per micro-step; unset, it is derived from `train_batch_size` and the
    /// accumulation steps; `"auto"` takes the caller's micro-batch.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub train_micro_batch_size_per_gpu: Option<AutoOr<u64>>,
    /// Micro-steps (forward and backward passes) per optimizer step; unset, it is
    /// `train_batch_size` / (micro-batch × world size) when both are given, else 1.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gradient_accumulation_steps: Option<AutoOr<u64>>,
    /// Clip the global L2 norm of the gradients (computed across shards) to this; 0 disables;
    /// `"auto"` = 1.0.
    pub gradient_clipping: AutoOr<f64>,
    /// Log progress every this many optimizer steps.
    pub steps_per_print: u64,
    /// Time forward, backward, gradient reduction and optimizer step separately in the logs.
    pub wall_clock_breakdown: bool,
    /// The dtype gradient reductions carry on the wire (DeepSpeed's meaning; FSDP's
    /// `reduce_dtype`): each rank rounds its gradient to it once, and every hop of the
    /// reduction sums in f32 in rank order and rounds once to it, so the result is
    /// reproducible. `"bf16"` or `"fp16"` in an fp32 run halves the reduced bytes; unset
    /// reduces in the training precision.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub communication_data_type: Option<CommDataType>,
    /// Seed for parameter init and dropout (ferrozero's own key).
    pub seed: u64,
    /// The device the model computes on (ferrozero's own key): `"auto"` (a GPU when this
    /// build has the CUDA backend and the machine a GPU, else the CPU), `"cpu"`, `"cuda"` (the
    /// rank's `LOCAL_RANK`-th GPU) or `"cuda:N"`.
    pub device: Device,
    /// Cap on the bytes each rank keeps in device memory (ferrozero's own key; DeepSpeed has
    /// none): bytes, or a string such as `"40GB"` (10^9) or `"40GiB"` (2^30). It applies to
    /// what the engine counts as device memory on every backend (on the CPU: the working set
    /// a GPU would hold), so a 40 GB card's run can be rehearsed on a larger card or a CPU. A
    /// run that cannot fit is refused at `initialize` with the estimator's figures; the GPU's
    /// allocator and the engine's memory ledger refuse any allocation past it. Unset: no cap.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_memory_limit: Option<ByteSize>,
    /// ZeRO partitioning: the stage, communication buckets, and offload.
    pub zero_optimization: ZeroOptimization,
    /// fp16 mixed precision with loss scaling.
    pub fp16: Fp16,
    /// bf16 mixed precision.
    #[schemars(extend("x-aliases" = ["bfloat16"]))]
    pub bf16: Bf16,
    /// The dtypes of gradient accumulation, parameters and buffers (DeepSpeed's
    /// `data_types`).
    pub data_types: DataTypes,
    /// The optimizer and its hyper-parameters; required to train.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub optimizer: Option<Optimizer>,
    /// The learning-rate schedule; unset, the learning rate stays constant.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scheduler: Option<Scheduler>,
    /// Activation checkpointing; the table's presence turns it on.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub activation_checkpointing: Option<ActivationCheckpointingSection>,
    /// Asynchronous I/O for offload to NVMe.
    pub aio: Aio,
    /// The communicator between ranks (ferrozero's own table).
    pub comms: Comms,
    /// TensorBoard event files of the training scalars (DeepSpeed's monitor).
    pub tensorboard: MonitorSection,
    /// CSV files of the training scalars, one per scalar (DeepSpeed's monitor).
    pub csv_monitor: MonitorSection,
    /// Per-collective counts, bytes, times and bandwidths (DeepSpeed's communication logger).
    pub comms_logger: CommsLoggerSection,
    /// DeepSpeed's FLOPs profiler: time, FLOPs and TFLOP/s per module and kernel family at
    /// one step; also the device peak behind every step's `mfu`.
    pub flops_profiler: FlopsProfilerSection,
    /// Where each key came from, so that resolution errors point into the file too.
    #[serde(skip)]
    #[schemars(skip)]
    pub(crate) source: Arc<SourceMap>,
}

/// The text a config was read from and the value span of each key read.
#[derive(Default)]
pub(crate) struct SourceMap {
    pub origin: String,
    pub text: String,
    pub spans: HashMap<String, Range<usize>>,
}

/// Provenance is not part of a config's value: the same settings read from two files are equal.
impl PartialEq for SourceMap {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

/// The source text can be megabytes; debug output names the origin only.
impl std::fmt::Debug for SourceMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SourceMap({:?})", self.origin)
    }
}

impl Default for Config {
    /// The config an empty file produces.
    fn default() -> Self {
        Config {
            schema: None,
            train_batch_size: None,
            train_micro_batch_size_per_gpu: None,
            gradient_accumulation_steps: None,
            gradient_clipping: AutoOr::Value(1.0),
            steps_per_print: 10,
            wall_clock_breakdown: false,
            communication_data_type: None,
            seed: DEFAULT_SEED,
            device: Device::Auto,
            device_memory_limit: None,
            zero_optimization: ZeroOptimization::default(),
            fp16: Fp16::default(),
            bf16: Bf16::default(),
            data_types: DataTypes::default(),
            optimizer: None,
            scheduler: None,
            activation_checkpointing: None,
            aio: Aio::default(),
            comms: Comms::default(),
            tensorboard: MonitorSection::default(),
            csv_monitor: MonitorSection::default(),
            comms_logger: CommsLoggerSection::default(),
            flops_profiler: FlopsProfilerSection::default(),
            source: Arc::default(),
        }
    }
}

/// A dtype for gradient communication, as DeepSpeed names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum CommDataType {
    /// f32.
    Fp32,
    /// IEEE half.
    Fp16,
    /// bfloat16.
    Bf16,
}

const COMM_DTYPES: &[(&str, CommDataType)] = &[
    ("fp32", CommDataType::Fp32),
    ("fp16", CommDataType::Fp16),
    ("bf16", CommDataType::Bf16),
];

/// ferrozero's default seed.
pub const DEFAULT_SEED: u64 = 42;

/// Every other top-level key of DeepSpeed 0.19 (`runtime/config.py` and the config classes it
/// reads), and what ferrozero does with it; `docs/deepspeed-keys.md` lists them with reasons.
const TOP_SUPPORT: &[(&str, Support)] = &[
    // Monitors, profilers, logging: they cannot change training results.
    ("wandb", Support::IgnoredIfEnabled(NETWORK_MONITOR)),
    ("comet", Support::IgnoredIfEnabled(NETWORK_MONITOR)),
    ("timers", Support::IgnoredIfEnabled("throughput timers; ferrozero's StepReport carries tokens/s and, with wall_clock_breakdown, per-phase times")),
    ("memory_breakdown", Support::IgnoredUnless(off::is_false, PROFILER)),
    ("dump_state", Support::IgnoredUnless(off::is_false, "debug output only")),
    ("log_level", Support::Ignored("ferrozero logs through `tracing`: set RUST_LOG instead")),
    // Settings whose every value ferrozero already behaves as, or that only tune speed.
    ("zero_allow_untested_optimizer", Support::Ignored("every ferrozero optimizer works with every stage")),
    ("zero_force_ds_cpu_optimizer", Support::Ignored("ferrozero always uses its own CPU optimizer")),
    ("checkpoint", Support::Ignored("checkpoint layout options; ferrozero's checkpoints always reshard")),
    ("nebula", Support::IgnoredIfEnabled("checkpoint service; not used")),
    ("datastates_ckpt", Support::IgnoredUnless(off::is_false, "asynchronous checkpoint engine; ferrozero writes its own atomic checkpoints")),
    ("autotuning", Support::IgnoredIfEnabled("ferrozero does not autotune; the given values are used")),
    ("compile", Support::IgnoredIfEnabled("torch.compile does not apply to ferrozero")),
    ("dataloader_drop_last", Support::Ignored("ferrozero does not build data loaders")),
    ("graph_harvesting", Support::IgnoredUnless(off::is_false, "CUDA graph capture is not used")),
    ("disable_allgather", Support::IgnoredUnless(off::is_false, "a communication schedule only; ferrozero always all-gathers updated partitions")),
    ("sparse_gradients", Support::IgnoredUnless(off::is_false, "sparse (CSR) gradient exchange; ferrozero reduces dense gradients, with the same sums")),
    ("use_data_before_expert_parallelism", Support::IgnoredUnless(off::is_false, "process-group layout for mixture-of-experts; ferrozero has no experts")),
    ("hybrid_engine", Support::IgnoredIfEnabled("the RLHF hybrid engine's generation path is not implemented; training is unchanged")),
    ("eigenvalue", Support::IgnoredIfEnabled("eigenvalues only drive quantize_training's schedule, which is not implemented")),
    ("pipeline", Support::Ignored("pipeline-engine settings; they apply only to DeepSpeed PipelineModule models, which ferrozero does not have")),
    ("seq_parallel_communication_data_type", Support::IgnoredUnless(off::is_fp32, "sequence parallelism is not implemented")),
    ("prescale_gradients", Support::IgnoredUnless(off::is_true, "ferrozero always divides gradients by the world size before the reduction (the division is part of the loss gradient), which is what `true` asks for; `false` (sum first, divide after) is not available: at power-of-two world sizes the two give the same bits (short of subnormal gradients), at others they differ in the last bit")),
    ("gradient_predivide_factor", Support::IgnoredUnless(off::is_one, "ferrozero divides gradients by the whole world size before the reduction; splitting the division around it changes only rounding")),
    // Settings that would change the math if ignored: refused when they turn something on.
    ("elasticity", Support::RefusedIfEnabled("elastic batch sizes change the effective batch")),
    ("compression_training", Support::RefusedIfEnabled("compression changes the trained model")),
    ("quantize_training", Support::RefusedIfEnabled("quantization changes the trained model")),
    ("weight_quantization", Support::RefusedIfEnabled("quantized weights change the model's numerics")),
    ("sparse_attention", Support::Refused("sparse attention changes the model: ferrozero's models use dense attention")),
    ("tensor_parallel", Support::RefusedUnless(tensor_parallel_off, "tensor parallelism is not implemented: every rank would hold the whole model and the data-parallel world (so the batch) would change")),
    ("expert_parallel", Support::RefusedIfEnabled("mixture-of-experts layers are not implemented")),
    ("curriculum_learning", Support::RefusedIfEnabled("curriculum learning changes the data order")),
    ("data_efficiency", Support::RefusedIfEnabled("data sampling/routing changes training")),
    ("progressive_layer_drop", Support::RefusedIfEnabled("layer drop changes training")),
    ("amp", Support::RefusedIfEnabled("NVIDIA Apex AMP is not supported; use fp16 or bf16")),
    ("torch_autocast", Support::RefusedIfEnabled("torch autocast changes which operations run in low precision; use fp16 or bf16")),
    ("managed_gradient_accumulation", Support::RefusedUnless(off::is_true, "ferrozero steps the optimizer only at accumulation boundaries; `false` (an update at every step() call) is not implemented")),
    ("gradient_accumulation_dtype", Support::Ignored("DeepSpeed does not read a top-level `gradient_accumulation_dtype` either (the proposal became `data_types.grad_accum_dtype`); set `data_types.grad_accum_dtype = \"fp32\"` for f32 accumulation")),
    ("fp8", Support::Refused("fp8 matmuls (scaled e4m3/e5m2 tensors) are not implemented; training in bf16 instead would change the math, so the config is refused")),
    ("moe", Support::Refused("mixture-of-experts parallelism is not implemented")),
];

const NETWORK_MONITOR: &str = "a monitor that needs a network service; enable `tensorboard` \
     or `csv_monitor` for the same scalars in files under output_path/job_name";
const PROFILER: &str = "a profiler; it cannot change training results";

/// `tensor_parallel` asks for no tensor parallelism: `autotp_size` 0 or 1 and `tp.tp_size` 1.
fn tensor_parallel_off(n: &Node) -> bool {
    let crate::parse::Kind::Table(entries) = &n.kind else {
        return off::is_empty(n);
    };
    entries.iter().all(|e| match e.key.as_str() {
        "autotp_size" => off::is_zero_or_one(&e.value),
        "tp" | "tensor_parallel" => match &e.value.kind {
            crate::parse::Kind::Table(t) => t
                .iter()
                .all(|x| x.key != "tp_size" || off::is_one(&x.value)),
            _ => true,
        },
        _ => true,
    })
}

/// Reads the whole document into a [`Config`], reporting problems into `cx`.
pub(crate) fn read_config(cx: &mut Cx<'_>, root: &Node) -> Option<Config> {
    let mut t = TableReader::new(cx, "", root)?;
    let batch = |cx: &mut Cx<'_>, p: &str, n: &Node| auto_or(cx, p, n, to_uint);
    let f = |cx: &mut Cx<'_>, p: &str, n: &Node| auto_or(cx, p, n, to_f64);
    let d = Config::default();
    let config = Config {
        schema: t.get(cx, "$schema", &[], |cx, p, n| {
            to_str(cx, p, n).map(str::to_string)
        }),
        train_batch_size: t.get(cx, "train_batch_size", &[], batch),
        train_micro_batch_size_per_gpu: t.get(cx, "train_micro_batch_size_per_gpu", &[], batch),
        gradient_accumulation_steps: t.get(cx, "gradient_accumulation_steps", &[], batch),
        gradient_clipping: t
            .get(cx, "gradient_clipping", &[], f)
            .unwrap_or(AutoOr::Value(1.0)),
        steps_per_print: t.uint(cx, "steps_per_print", d.steps_per_print),
        wall_clock_breakdown: t.bool(cx, "wall_clock_breakdown", false),
        communication_data_type: t.get(cx, "communication_data_type", &[], |cx, p, n| {
            if matches!(n.kind, crate::parse::Kind::Null) {
                return None;
            }
            crate::reader::to_choice(cx, p, n, COMM_DTYPES)
        }),
        seed: t.uint(cx, "seed", d.seed),
        device: t
            .get(cx, "device", &[], device::read_device)
            .unwrap_or_default(),
        device_memory_limit: t.get(cx, "device_memory_limit", &[], size::read_size),
        zero_optimization: t
            .get(cx, "zero_optimization", &[], |cx, p, n| {
                Some(zero::read_zero(cx, p, n))
            })
            .unwrap_or_default(),
        fp16: t
            .get(cx, "fp16", &[], precision::read_fp16)
            .unwrap_or_default(),
        bf16: t
            .get(cx, "bf16", &["bfloat16"], precision::read_bf16)
            .unwrap_or_default(),
        data_types: t
            .get(cx, "data_types", &[], data_types::read_data_types)
            .unwrap_or_default(),
        optimizer: t.get(cx, "optimizer", &[], optimizer::read_optimizer),
        scheduler: t.get(cx, "scheduler", &[], scheduler::read_scheduler),
        activation_checkpointing: t.get(
            cx,
            "activation_checkpointing",
            &[],
            runtime::read_activation,
        ),
        aio: t.get(cx, "aio", &[], runtime::read_aio).unwrap_or_default(),
        comms: t
            .get(cx, "comms", &[], runtime::read_comms)
            .unwrap_or_default(),
        tensorboard: t
            .get(cx, "tensorboard", &[], monitor::read_monitor)
            .unwrap_or_default(),
        csv_monitor: t
            .get(cx, "csv_monitor", &[], monitor::read_monitor)
            .unwrap_or_default(),
        comms_logger: t
            .get(cx, "comms_logger", &[], monitor::read_comms_logger)
            .unwrap_or_default(),
        flops_profiler: t
            .get(cx, "flops_profiler", &[], profiler::read_flops_profiler)
            .unwrap_or_default(),
        source: Arc::default(),
    };
    t.finish(cx, TOP_SUPPORT);
    Some(config)
}
