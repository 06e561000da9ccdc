//! `zero_optimization` with DeepSpeed's key names, aliases, deprecated keys and v0.19 defaults.

use schemars::JsonSchema;
use serde::Serialize;

use super::auto::AutoOr;
use super::offload::{read_offload, OffloadDevice, OffloadSection};
use super::zenflow::{read_zenflow, ZenFlowSection};
use crate::diagnostic::DiagnosticKind;
use crate::parse::Node;
use crate::reader::{auto_or, off, to_bool, to_uint, Cx, Report, Support, TableReader};

/// `zero_optimization`: what each rank keeps of the parameters, gradients and optimizer state,
/// and how they move. DeepSpeed's key names, aliases and v0.19 defaults.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct ZeroOptimization {
    /// ZeRO stage: 0 (plain data parallelism) to 3 (parameters partitioned too).
    #[schemars(range(min = 0, max = 3))]
    pub stage: u8,
    /// Copy gradients into a contiguous buffer as they are produced. ferrozero's gradients
    /// always live in contiguous per-unit buffers; `false` is ignored with a warning.
    pub contiguous_gradients: bool,
    /// Overlap reduction with compute; unset means DeepSpeed's default (true only at stage 3).
    /// With the optimizer state offloaded and no gradient clipping or fp16 dynamic loss scale,
    /// each group's optimizer step also runs alongside the rest of backward (same bits).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub overlap_comm: Option<bool>,
    /// Reduce gradients with reduce-scatter rather than all-reduce (stages 1-2).
    pub reduce_scatter: bool,
    /// Elements per gradient-reduction bucket; `"auto"` = hidden_size²; 0 (DeepSpeed: each
    /// parameter alone) reduces each unit in one collective.
    pub reduce_bucket_size: AutoOr<u64>,
    /// Gather updated partitions with all-gather rather than broadcasts (stages 1-2).
    /// ferrozero always all-gathers (the same values); `false` is ignored with a warning.
    pub allgather_partitions: bool,
    /// Elements per all-gather bucket (stages 1-2); 0 gathers each unit in one collective.
    pub allgather_bucket_size: u64,
    /// Elements per optimizer-step tile: bounds the optimizer's working set, and with NVMe
    /// offload the size of each swap. 0 is DeepSpeed's "one sub-group per parameter": tiles
    /// as large as the model's largest parameter.
    pub sub_group_size: u64,
    /// Elements of parameters gathered ahead of use (stage 3); `"auto"` = 0.9 × hidden_size².
    #[schemars(extend("x-aliases" = ["prefetch_bucket_size"]))]
    pub stage3_prefetch_bucket_size: AutoOr<u64>,
    /// Parameters with fewer elements than this stay gathered on every rank (stage 3);
    /// `"auto"` = 10 × hidden_size.
    #[schemars(extend("x-aliases" = ["param_persistence_threshold"]))]
    pub stage3_param_persistence_threshold: AutoOr<u64>,
    /// Most parameter elements gathered at once (stage 3); it bounds prefetching, so 0
    /// gathers each unit only when it runs.
    #[schemars(extend("x-aliases" = ["max_live_parameters"]))]
    pub stage3_max_live_parameters: u64,
    /// A gathered parameter needed again within this many elements is kept rather than
    /// released (stage 3).
    #[schemars(extend("x-aliases" = ["max_reuse_distance"]))]
    pub stage3_max_reuse_distance: u64,
    /// Gather full 16-bit weights when saving (stage 3; `"auto"`, as Accelerate writes it,
    /// means its default, false). ferrozero saves sharded checkpoints and consolidates them
    /// with `ferrozero checkpoint consolidate`; `true` is ignored with a warning.
    #[schemars(extend(
        "x-aliases" = ["gather_16bit_weights_on_model_save"],
        "x-deprecated-aliases" = ["stage3_gather_fp16_weights_on_model_save"]
    ))]
    pub stage3_gather_16bit_weights_on_model_save: AutoOr<bool>,
    /// Assign gradient partitions to ranks round-robin (DeepSpeed's copy-parallelism option
    /// for stages 1-2 with CPU offload; results are the same). Not implemented: `true` is
    /// ignored with a warning.
    pub round_robin_gradients: bool,
    /// ZeRO++ hpZ (stage 3; DeepSpeed's meaning): optimizer state, gradients and parameters
    /// stay partitioned over all ranks, and each rank also keeps a *secondary* copy of the
    /// low-precision parameters partitioned over the group of this many consecutive ranks
    /// (one node), taken from forward's all-gather, so backward's all-gathers stay inside the
    /// group. Costs `1 / G` of the parameters per rank; must divide the world size; 0 or 1 =
    /// off.
    pub zero_hpz_partition_size: u64,
    /// ZeRO++ qwZ (stage 3; DeepSpeed's meaning): every parameter all-gather sends each
    /// rank's shard as int8 codes with an f32 scale per block of about 8000 elements
    /// (DeepSpeed's `CUDAQuantizer` symmetric formula and group sizes), and every rank
    /// computes with the dequantized values; the stored shards, master weights and optimizer
    /// stay full precision. Forward's gathers, prefetches and backward's re-gathers are all
    /// quantized, so a step sees one set of values; with hpZ, forward's gather is quantized
    /// and the secondary copy holds the dequantized values it produced. Below stage 3 (or at
    /// one rank) nothing is gathered and it has no effect.
    pub zero_quantized_weights: bool,
    /// ZeRO++ quantized non-trainable weights (stage 3): the gathers of frozen parameters
    /// are quantized as `zero_quantized_weights` quantizes every gather. DeepSpeed also
    /// stores those shards quantized; ferrozero keeps them in the storage dtype (the values
    /// computed with are the same, since frozen shards never change).
    pub zero_quantized_nontrainable_weights: bool,
    /// ZeRO++ qgZ (stage 3; DeepSpeed's meaning): the gradient reduce-scatter becomes a
    /// quantized all-to-all: each rank quantizes the part of its gradient every other rank
    /// owns (4-bit codes, an f32 scale per block), the parts are exchanged, and each rank
    /// dequantizes what it received and sums it in rank order in f32 into its shard.
    pub zero_quantized_gradients: bool,
    /// MiCS shard group size (DeepSpeed's meaning; FSDP's `HYBRID_SHARD`): parameters,
    /// gradients and optimizer state are sharded inside groups of this many consecutive ranks
    /// (one node) and replicated across the groups, so parameter gathers stay inside a group
    /// and only gradient shards cross groups. Must divide the world size; -1 or 0 = off; 1
    /// replicates every rank's state (each rank its own shard group: no parameter gathers).
    pub mics_shard_size: i64,
    /// MiCS's hierarchical parameter all-gather for shard groups that span nodes. ferrozero's
    /// shard group gathers in one collective; `true` is ignored with a warning.
    pub mics_hierarchical_params_gather: bool,
    /// Where parameters live between uses (stage 3 only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub offload_param: Option<OffloadSection>,
    /// Where optimizer state (and the fp32 master weights) lives, and where the step runs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub offload_optimizer: Option<OffloadSection>,
    /// DeepSpeed's ZenFlow: checked, then ignored with a warning; ferrozero's exact
    /// overlapped offload runs instead.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub zenflow: Option<ZenFlowSection>,
}

impl Default for ZeroOptimization {
    fn default() -> Self {
        ZeroOptimization {
            stage: 0,
            contiguous_gradients: true,
            overlap_comm: None,
            reduce_scatter: true,
            reduce_bucket_size: AutoOr::Value(500_000_000),
            allgather_partitions: true,
            allgather_bucket_size: 500_000_000,
            sub_group_size: 1_000_000_000,
            stage3_prefetch_bucket_size: AutoOr::Value(50_000_000),
            stage3_param_persistence_threshold: AutoOr::Value(100_000),
            stage3_max_live_parameters: 1_000_000_000,
            stage3_max_reuse_distance: 1_000_000_000,
            stage3_gather_16bit_weights_on_model_save: AutoOr::Value(false),
            round_robin_gradients: false,
            zero_hpz_partition_size: 1,
            zero_quantized_weights: false,
            zero_quantized_nontrainable_weights: false,
            zero_quantized_gradients: false,
            mics_shard_size: -1,
            mics_hierarchical_params_gather: false,
            offload_param: None,
            offload_optimizer: None,
            zenflow: None,
        }
    }
}

/// The other keys of DeepSpeed 0.19's `DeepSpeedZeroConfig`, and what ferrozero does with
/// them (`docs/deepspeed-keys.md` lists them with reasons).
#[rustfmt::skip]
const SUPPORT: &[(&str, Support)] = &[
    ("elastic_checkpoint", Support::IgnoredUnless(off::is_false, "ferrozero checkpoints always reload at any world size")),
    ("load_from_fp32_weights", Support::IgnoredUnless(off::is_true, "ferrozero always reloads from fp32 master weights")),
    ("ignore_unused_parameters", Support::IgnoredUnless(off::is_true, "unused parameters get zero gradients")),
    ("legacy_stage1", Support::IgnoredUnless(off::is_false, "there is one stage-1 implementation")),
    ("memory_efficient_linear", Support::IgnoredUnless(off::is_true, "a memory optimisation of DeepSpeed's linear layer")),
    ("log_trace_cache_warnings", Support::IgnoredUnless(off::is_false, "logging only")),
    ("enable_sanity_checks", Support::IgnoredUnless(off::is_false, "DeepSpeed's internal debug checks")),
    ("override_module_apply", Support::IgnoredUnless(off::is_true, "a PyTorch module hook")),
    ("pipeline_loading_checkpoint", Support::IgnoredUnless(off::is_false, "pipeline-engine checkpoint loading")),
    ("stage3_model_persistence_threshold", Support::Ignored("memory tuning only")),
    ("model_persistence_threshold", Support::Ignored("memory tuning only")),
    ("stage3_module_granularity_threshold", Support::IgnoredUnless(off::is_zero_or_one, "a fetch-granularity tuning of PyTorch module hooks; ferrozero gathers whole units")),
    ("module_granularity_threshold", Support::IgnoredUnless(off::is_zero_or_one, "a fetch-granularity tuning of PyTorch module hooks; ferrozero gathers whole units")),
    ("stage3_use_all_reduce_for_fetch_params", Support::IgnoredUnless(off::is_false, "a parameter-fetch schedule; ferrozero all-gathers (the same values)")),
    ("use_all_reduce_for_fetch_params", Support::IgnoredUnless(off::is_false, "a parameter-fetch schedule; ferrozero all-gathers (the same values)")),
    ("stage3_allgather_sequential", Support::IgnoredUnless(off::is_false, "a parameter-fetch schedule; ferrozero gathers each unit's buffer")),
    ("allgather_sequential", Support::IgnoredUnless(off::is_false, "a parameter-fetch schedule; ferrozero gathers each unit's buffer")),
    ("leaf_module", Support::IgnoredUnless(off::is_empty, "PyTorch module classes treated as ZeRO-3 leaves; ferrozero's units are its layers")),
    ("save_muon_momentum_buffer_in_memory", Support::IgnoredUnless(off::is_false, "the Muon optimizer is not implemented")),
    ("use_multi_rank_bucket_allreduce", Support::IgnoredUnless(off::is_true, "a communication schedule only")),
    ("zeropp_loco_param", Support::RefusedUnless(off::is_empty, "LoCo-ZeRO++'s error feedback for quantized gradients is not implemented")),
];

/// Reads `zero_optimization`; the deprecated boolean form maps to stage 1 or 0.
pub(crate) fn read_zero(cx: &mut Cx<'_>, path: &str, node: &Node) -> ZeroOptimization {
    if let crate::parse::Kind::Bool(on) = node.kind {
        cx.warn(Report {
            kind: DiagnosticKind::Deprecated,
            path,
            span: &node.span,
            message: format!(
                "the boolean form is deprecated; read as stage {}",
                u8::from(on)
            ),
            help: Some(format!(
                "write `[zero_optimization]` with `stage = {}`",
                u8::from(on)
            )),
        });
        return ZeroOptimization {
            stage: u8::from(on),
            ..ZeroOptimization::default()
        };
    }
    let Some(mut t) = TableReader::new(cx, path, node) else {
        return ZeroOptimization::default();
    };
    let z = read_fields(cx, &mut t);
    if !z.zero_quantized_gradients {
        ignore_loco(cx, &mut t);
    }
    t.finish(cx, SUPPORT);
    z
}

/// `zeropp_loco_param` without qgZ: DeepSpeed reads LoCo's settings only for the quantized
/// gradient reduction, so there they change nothing and are ignored with a warning (with qgZ
/// on, the table's rule refuses them: LoCo's error feedback is not implemented).
fn ignore_loco(cx: &mut Cx<'_>, t: &mut TableReader<'_>) {
    let Some(e) = t.take(cx, "zeropp_loco_param", &[]) else {
        return;
    };
    if crate::reader::off::is_empty(&e.value) {
        return;
    }
    let path = t.key_path("zeropp_loco_param");
    cx.ignored(
        &path,
        &e.key_span,
        "LoCo's settings apply only to the quantized gradient reduction \
         (`zero_quantized_gradients`), which is off",
    );
}

fn read_fields(cx: &mut Cx<'_>, t: &mut TableReader<'_>) -> ZeroOptimization {
    let d = ZeroOptimization::default();
    let auto_uint = |cx: &mut Cx<'_>, p: &str, n: &Node| auto_or(cx, p, n, to_uint);
    let stage = t.get(cx, "stage", &[], read_stage).unwrap_or(d.stage);
    let mut z = ZeroOptimization {
        stage,
        contiguous_gradients: t.bool(cx, "contiguous_gradients", d.contiguous_gradients),
        overlap_comm: t.get(cx, "overlap_comm", &[], to_bool),
        reduce_scatter: t.bool(cx, "reduce_scatter", d.reduce_scatter),
        reduce_bucket_size: t
            .get(cx, "reduce_bucket_size", &[], auto_uint)
            .unwrap_or(d.reduce_bucket_size),
        allgather_partitions: t.bool(cx, "allgather_partitions", d.allgather_partitions),
        allgather_bucket_size: t.uint(cx, "allgather_bucket_size", d.allgather_bucket_size),
        sub_group_size: t.uint(cx, "sub_group_size", d.sub_group_size),
        stage3_prefetch_bucket_size: t
            .get(
                cx,
                "stage3_prefetch_bucket_size",
                &["prefetch_bucket_size"],
                auto_uint,
            )
            .unwrap_or(d.stage3_prefetch_bucket_size),
        stage3_param_persistence_threshold: t
            .get(
                cx,
                "stage3_param_persistence_threshold",
                &["param_persistence_threshold"],
                auto_uint,
            )
            .unwrap_or(d.stage3_param_persistence_threshold),
        stage3_max_live_parameters: t
            .get(
                cx,
                "stage3_max_live_parameters",
                &["max_live_parameters"],
                to_uint,
            )
            .unwrap_or(d.stage3_max_live_parameters),
        stage3_max_reuse_distance: t
            .get(
                cx,
                "stage3_max_reuse_distance",
                &["max_reuse_distance"],
                to_uint,
            )
            .unwrap_or(d.stage3_max_reuse_distance),
        stage3_gather_16bit_weights_on_model_save: read_gather_16bit(cx, t),
        round_robin_gradients: t.bool(cx, "round_robin_gradients", d.round_robin_gradients),
        zero_hpz_partition_size: t.uint(cx, "zero_hpz_partition_size", d.zero_hpz_partition_size),
        zero_quantized_weights: t.bool(cx, "zero_quantized_weights", d.zero_quantized_weights),
        zero_quantized_nontrainable_weights: t.bool(
            cx,
            "zero_quantized_nontrainable_weights",
            d.zero_quantized_nontrainable_weights,
        ),
        zero_quantized_gradients: t.bool(
            cx,
            "zero_quantized_gradients",
            d.zero_quantized_gradients,
        ),
        mics_shard_size: t
            .get(cx, "mics_shard_size", &[], read_mics_size)
            .unwrap_or(d.mics_shard_size),
        mics_hierarchical_params_gather: t.bool(
            cx,
            "mics_hierarchical_params_gather",
            d.mics_hierarchical_params_gather,
        ),
        offload_param: t.get(cx, "offload_param", &[], read_offload),
        offload_optimizer: t.get(cx, "offload_optimizer", &[], |cx, p, n| {
            read_offload(cx, p, n)
        }),
        zenflow: t.get(cx, "zenflow", &[], read_zenflow),
    };
    map_cpu_offload(cx, t, &mut z);
    warn_fixed_behaviour(cx, t, &z);
    z
}

/// `mics_shard_size`: any integer, negative meaning off as in DeepSpeed (default -1).
fn read_mics_size(cx: &mut Cx<'_>, path: &str, node: &Node) -> Option<i64> {
    match node.kind {
        crate::parse::Kind::Int(n) => Some(n),
        crate::parse::Kind::Null => Some(-1),
        _ => to_uint(cx, path, node).map(|n| n as i64),
    }
}

/// Keys kept in the schema (they are common in DeepSpeed configs) whose every value but one
/// asks for something ferrozero does not do differently: that one is silent, the others are
/// ignored with a warning naming what ferrozero does.
fn warn_fixed_behaviour(cx: &mut Cx<'_>, t: &TableReader<'_>, z: &ZeroOptimization) {
    let checks: [(&str, bool, &str); 5] = [
        (
            "contiguous_gradients",
            !z.contiguous_gradients,
            "ferrozero's gradients always live in contiguous per-unit buffers",
        ),
        (
            "allgather_partitions",
            !z.allgather_partitions,
            "ferrozero always all-gathers updated partitions (broadcasts would move the same values)",
        ),
        (
            "round_robin_gradients",
            z.round_robin_gradients,
            "a copy-parallelism option of DeepSpeed's CPU offload; gradient partitions are the same",
        ),
        (
            "stage3_gather_16bit_weights_on_model_save",
            z.stage3_gather_16bit_weights_on_model_save == AutoOr::Value(true),
            "ferrozero saves sharded checkpoints; `ferrozero checkpoint consolidate` writes the full weights from them at any time",
        ),
        (
            "mics_hierarchical_params_gather",
            z.mics_hierarchical_params_gather,
            "the MiCS shard group gathers parameters in one all-gather; a hierarchical one moves the same values by another route",
        ),
    ];
    for (key, ignored, why) in checks {
        if !ignored {
            continue;
        }
        // The deprecated spelling is read on its own (and mapped): point at whichever is there.
        let path = [key, "stage3_gather_fp16_weights_on_model_save"]
            .iter()
            .take(if key.starts_with("stage3_gather") {
                2
            } else {
                1
            })
            .map(|k| t.key_path(k))
            .find(|p| cx.span_of(p).is_some());
        if let Some(path) = path {
            cx.ignored_if_set(&path, why);
        }
    }
}

fn read_stage(cx: &mut Cx<'_>, path: &str, node: &Node) -> Option<u8> {
    let n = to_uint(cx, path, node)?;
    if n > 3 {
        cx.error(Report {
            kind: DiagnosticKind::InvalidValue,
            path,
            span: &node.span,
            message: format!("ZeRO stage must be 0, 1, 2 or 3, found {n}"),
            help: None,
        });
        return None;
    }
    Some(n as u8)
}

fn read_gather_16bit(cx: &mut Cx<'_>, t: &mut TableReader<'_>) -> AutoOr<bool> {
    let auto_bool = |cx: &mut Cx<'_>, p: &str, n: &Node| auto_or(cx, p, n, to_bool);
    let new = t.get(
        cx,
        "stage3_gather_16bit_weights_on_model_save",
        &["gather_16bit_weights_on_model_save"],
        auto_bool,
    );
    let old_key = "stage3_gather_fp16_weights_on_model_save";
    let old = t.take(cx, old_key, &[]);
    match (new, old) {
        (_, None) => new.unwrap_or(AutoOr::Value(false)),
        (new, Some(e)) => {
            let path = t.key_path(old_key);
            let value = to_bool(cx, &path, &e.value).map(AutoOr::Value);
            deprecated(
                cx,
                t,
                old_key,
                &e.key_span,
                "stage3_gather_16bit_weights_on_model_save",
                new.is_some(),
            );
            new.or(value).unwrap_or(AutoOr::Value(false))
        }
    }
}

/// Reports a deprecated key: a warning when alone, an error next to its replacement.
fn deprecated(
    cx: &mut Cx<'_>,
    t: &TableReader<'_>,
    old: &str,
    span: &std::ops::Range<usize>,
    new: &str,
    both: bool,
) {
    let path = t.key_path(old);
    if both {
        cx.error(Report {
            kind: DiagnosticKind::Conflict,
            path: &path,
            span,
            message: format!("deprecated `{old}` given together with its replacement `{new}`"),
            help: Some(format!("remove `{old}`")),
        });
    } else {
        cx.warn(Report {
            kind: DiagnosticKind::Deprecated,
            path: &path,
            span,
            message: format!("`{old}` is deprecated; read as `{new}`"),
            help: Some(format!("write `{new}` instead")),
        });
    }
}

/// DeepSpeed's pre-0.5 `cpu_offload*` keys map onto the offload sections.
fn map_cpu_offload(cx: &mut Cx<'_>, t: &mut TableReader<'_>, z: &mut ZeroOptimization) {
    let pin = t.take(cx, "cpu_offload_use_pin_memory", &[]);
    let pin_value =
        pin.and_then(|e| to_bool(cx, &t.key_path("cpu_offload_use_pin_memory"), &e.value));
    for (old, new) in [
        ("cpu_offload", "offload_optimizer"),
        ("cpu_offload_param", "offload_param"),
    ] {
        let Some(e) = t.take(cx, old, &[]) else {
            continue;
        };
        let on = to_bool(cx, &t.key_path(old), &e.value);
        let slot = if old == "cpu_offload" {
            &mut z.offload_optimizer
        } else {
            &mut z.offload_param
        };
        let replacement = format!("{new}.device = \"cpu\"");
        deprecated(cx, t, old, &e.key_span, &replacement, slot.is_some());
        if slot.is_none() && on == Some(true) {
            *slot = Some(OffloadSection {
                device: OffloadDevice::Cpu,
                pin_memory: pin_value.unwrap_or(false),
                ..OffloadSection::default()
            });
        }
    }
    if let Some(e) = pin {
        let explicit = z.offload_optimizer.is_some() || z.offload_param.is_some();
        let from_old =
            t.value_span("cpu_offload").is_some() || t.value_span("cpu_offload_param").is_some();
        let both = explicit && !from_old;
        deprecated(
            cx,
            t,
            "cpu_offload_use_pin_memory",
            &e.key_span,
            "offload_*.pin_memory",
            both,
        );
    }
}
