//! `activation_checkpointing`, `aio` and ferrozero's own `comms` section.

use schemars::JsonSchema;
use serde::Serialize;

use crate::diagnostic::DiagnosticKind;
use crate::parse::Node;
use crate::reader::{to_choice, to_uint, Cx, Report, Support, TableReader};

/// `activation_checkpointing`: keep only each unit's input during the forward pass and
/// recompute the unit's activations in the backward pass, trading compute for memory.
/// ferrozero checkpoints every unit, except that `train_batch` runs the last (the loss head)
/// forward and backward at once, so it keeps nothing; DeepSpeed's layout and logging keys
/// are accepted at their defaults and ignored with a warning otherwise.
#[derive(Debug, Clone, Default, PartialEq, Serialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct ActivationCheckpointingSection {
    /// Partition checkpointed activations across model-parallel ranks (there are none in
    /// ferrozero: `true` is ignored with a warning).
    pub partition_activations: bool,
    /// Keep checkpointed activations in host memory.
    pub cpu_checkpointing: bool,
    /// Copy checkpoints into one contiguous buffer (a fragmentation option: `true` is ignored
    /// with a warning).
    pub contiguous_memory_optimization: bool,
    /// Number of checkpoint buffers for the contiguous layout; ferrozero checkpoints every
    /// unit, so a number is ignored with a warning.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub number_checkpoints: Option<u64>,
    /// Synchronise the device at checkpoint boundaries (`true` is ignored with a warning).
    pub synchronize_checkpoint_boundary: bool,
    /// Time forward and recompute (`true` is ignored with a warning; `wall_clock_breakdown`
    /// times the phases).
    pub profile: bool,
}

/// `aio`: how offload to NVMe issues its reads and writes (io_uring, or a thread pool where the
/// kernel denies io_uring).
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Aio {
    /// Bytes per I/O request.
    pub block_size: u64,
    /// Requests in flight.
    pub queue_depth: u64,
    /// Threads (or rings) per operation.
    #[schemars(extend("x-deprecated-aliases" = ["thread_count"]))]
    pub intra_op_parallelism: u64,
    /// Submit requests one at a time.
    pub single_submit: bool,
    /// Overlap submission and completion.
    pub overlap_events: bool,
}

impl Default for Aio {
    fn default() -> Self {
        Aio {
            block_size: 1_048_576,
            queue_depth: 8,
            intra_op_parallelism: 1,
            single_submit: false,
            overlap_events: true,
        }
    }
}

/// Communicator backend.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// Ranks as threads in one process.
    #[default]
    Local,
    /// MPI across processes.
    Mpi,
    /// NCCL on GPUs.
    Nccl,
}

/// How the MPI backend forms sums.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Reduction {
    /// MPI's own reductions for f32 sums: Open MPI's bandwidth; deterministic for a world
    /// size, but summed in rank order only at two ranks.
    #[default]
    Native,
    /// Sums in rank order, bitwise equal to the `local` backend at every world size (so ZeRO
    /// stages stay bitwise identical), at the cost measured in `docs/config.md`.
    RankOrdered,
}

/// `comms` (ferrozero's own table; DeepSpeed picks its backend outside the config). Used by
/// `initialize` when no communicator is passed to the engine.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Comms {
    /// Which communicator carries the collectives.
    pub backend: Backend,
    /// Seconds after which a collective without progress fails.
    pub timeout: u64,
    /// How MPI and NCCL form sums: `native` (the library's own reduction: fastest, and
    /// deterministic for a fixed communicator) or `rank_ordered` (bitwise the local
    /// communicator's sums at every world size; costs bandwidth, see docs/scaling.md). The
    /// local communicator always sums in rank order.
    pub reduction: Reduction,
}

impl Default for Comms {
    fn default() -> Self {
        Comms {
            backend: Backend::Local,
            timeout: 300,
            reduction: Reduction::Native,
        }
    }
}

/// Reads `activation_checkpointing`.
pub(crate) fn read_activation(
    cx: &mut Cx<'_>,
    path: &str,
    node: &Node,
) -> Option<ActivationCheckpointingSection> {
    let mut t = TableReader::new(cx, path, node)?;
    let a = ActivationCheckpointingSection {
        partition_activations: t.bool(cx, "partition_activations", false),
        cpu_checkpointing: t.bool(cx, "cpu_checkpointing", false),
        contiguous_memory_optimization: t.bool(cx, "contiguous_memory_optimization", false),
        number_checkpoints: t
            .get(cx, "number_checkpoints", &[], read_number_checkpoints)
            .flatten(),
        synchronize_checkpoint_boundary: t.bool(cx, "synchronize_checkpoint_boundary", false),
        profile: t.bool(cx, "profile", false),
    };
    for (key, ignored, why) in [
        (
            "partition_activations",
            a.partition_activations,
            "ferrozero has no model-parallel ranks to partition activations across",
        ),
        (
            "contiguous_memory_optimization",
            a.contiguous_memory_optimization,
            "a fragmentation option of DeepSpeed's checkpoint buffers",
        ),
        (
            "number_checkpoints",
            a.number_checkpoints.is_some(),
            "ferrozero checkpoints every unit's input",
        ),
        (
            "synchronize_checkpoint_boundary",
            a.synchronize_checkpoint_boundary,
            "a device synchronisation for profiling",
        ),
        (
            "profile",
            a.profile,
            "use wall_clock_breakdown for per-phase times",
        ),
    ] {
        let path = t.key_path(key);
        if ignored {
            cx.ignored_if_set(&path, why);
        }
    }
    t.finish(cx, &[]);
    Some(a)
}

/// `null` means unset (DeepSpeed's default); `false` appears in widely copied templates and is
/// read as unset with a warning.
fn read_number_checkpoints(cx: &mut Cx<'_>, path: &str, node: &Node) -> Option<Option<u64>> {
    match node.kind {
        crate::parse::Kind::Null => Some(None),
        crate::parse::Kind::Bool(false) => {
            cx.warn(Report {
                kind: DiagnosticKind::InvalidValue,
                path,
                span: &node.span,
                message: "`false` is not a number of checkpoints; read as unset".into(),
                help: Some("remove the key to checkpoint every unit".into()),
            });
            Some(None)
        }
        _ => to_uint(cx, path, node).map(Some),
    }
}

const AIO_SUPPORT: &[(&str, Support)] = &[(
    "use_gds",
    Support::Ignored("GPUDirect Storage is not used; reads go through host memory"),
)];

/// Reads `aio`; `thread_count` maps to `intra_op_parallelism` with a warning.
pub(crate) fn read_aio(cx: &mut Cx<'_>, path: &str, node: &Node) -> Option<Aio> {
    let mut t = TableReader::new(cx, path, node)?;
    let d = Aio::default();
    let old = t.take(cx, "thread_count", &[]);
    let new = t.get(cx, "intra_op_parallelism", &[], to_uint);
    let old_value = old.and_then(|e| to_uint(cx, &t.key_path("thread_count"), &e.value));
    if let Some(e) = old {
        let path = t.key_path("thread_count");
        let (severity_both, message) = if new.is_some() {
            (
                true,
                "deprecated `thread_count` given together with `intra_op_parallelism`",
            )
        } else {
            (
                false,
                "`thread_count` is deprecated; read as `intra_op_parallelism`",
            )
        };
        let r = Report {
            kind: if severity_both {
                DiagnosticKind::Conflict
            } else {
                DiagnosticKind::Deprecated
            },
            path: &path,
            span: &e.key_span,
            message: message.into(),
            help: Some("write `intra_op_parallelism` instead".into()),
        };
        if severity_both {
            cx.error(r);
        } else {
            cx.warn(r);
        }
    }
    let a = Aio {
        block_size: t.uint(cx, "block_size", d.block_size),
        queue_depth: t.uint(cx, "queue_depth", d.queue_depth),
        intra_op_parallelism: new.or(old_value).unwrap_or(d.intra_op_parallelism),
        single_submit: t.bool(cx, "single_submit", d.single_submit),
        overlap_events: t.bool(cx, "overlap_events", d.overlap_events),
    };
    t.finish(cx, AIO_SUPPORT);
    Some(a)
}

const BACKENDS: &[(&str, Backend)] = &[
    ("local", Backend::Local),
    ("mpi", Backend::Mpi),
    ("nccl", Backend::Nccl),
];

const REDUCTIONS: &[(&str, Reduction)] = &[
    ("native", Reduction::Native),
    ("rank_ordered", Reduction::RankOrdered),
];

/// Reads `comms`.
pub(crate) fn read_comms(cx: &mut Cx<'_>, path: &str, node: &Node) -> Option<Comms> {
    let mut t = TableReader::new(cx, path, node)?;
    let d = Comms::default();
    let c = Comms {
        backend: t
            .get(cx, "backend", &[], |cx, p, n| to_choice(cx, p, n, BACKENDS))
            .unwrap_or(d.backend),
        timeout: t.uint(cx, "timeout", d.timeout),
        reduction: t
            .get(cx, "reduction", &[], |cx, p, n| {
                to_choice(cx, p, n, REDUCTIONS)
            })
            .unwrap_or(d.reduction),
    };
    t.finish(cx, &[]);
    Some(c)
}
