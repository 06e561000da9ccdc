//! ZeRO rules: offload only where the stage supports it, positive sizes, nvme paths, and
//! warnings for settings the chosen stage ignores.

use super::{invalid, positive, report, Violation};
use crate::diagnostic::DiagnosticKind;
use crate::model::{Config, OffloadDevice, OffloadSection};
use crate::reader::{Cx, Report};

pub(super) fn check_zero(cx: &mut Cx<'_>, c: &Config) {
    let z = &c.zero_optimization;
    let stage = z.stage;
    // Sizes of 0 are DeepSpeed's (each parameter alone for buckets and sub-groups, nothing
    // prefetched or kept live, hpZ off); resolution gives them their ferrozero meaning.
    if let Some(p) = &z.offload_param {
        check_offload(cx, "zero_optimization.offload_param", p);
        if p.device != OffloadDevice::None && stage < 3 {
            report(cx, Violation {
                kind: DiagnosticKind::Conflict,
                path: "zero_optimization.offload_param.device",
                message: "parameter offload needs ZeRO stage 3".into(),
                help: Some("set `zero_optimization.stage = 3`, or remove `offload_param` (DeepSpeed silently ignores it here)".into()),
                notes: vec![format!("zero_optimization.stage = {stage}, offload_param.device = {:?}", p.device).to_lowercase()],
            });
        }
    }
    if let Some(o) = &z.offload_optimizer {
        check_offload(cx, "zero_optimization.offload_optimizer", o);
        if o.ratio < 1.0 && stage < 3 {
            report(
                cx,
                Violation {
                    kind: DiagnosticKind::Conflict,
                    path: "zero_optimization.offload_optimizer.ratio",
                    message: "partial optimizer offload (ratio < 1) needs ZeRO stage 3".into(),
                    help: Some("set ratio = 1.0 or use stage 3".into()),
                    notes: vec![format!(
                        "zero_optimization.stage = {stage}, offload_optimizer.ratio = {}",
                        o.ratio
                    )],
                },
            );
        }
    }
    if z.zero_hpz_partition_size > 1 && z.mics_shard_size > 0 {
        report(cx, Violation {
            kind: DiagnosticKind::Conflict,
            path: "zero_optimization.mics_shard_size",
            message: "MiCS and hpZ are two ways to split the state and cannot be combined".into(),
            help: Some("keep `mics_shard_size` (all state sharded inside groups, replicated across them) or `zero_hpz_partition_size` (state over all ranks, a secondary parameter copy per group), not both".into()),
            notes: vec![format!("zero_hpz_partition_size = {}, mics_shard_size = {}", z.zero_hpz_partition_size, z.mics_shard_size)],
        });
    }
    if z.zero_quantized_gradients && z.mics_shard_size > 0 && stage == 3 {
        report(cx, Violation {
            kind: DiagnosticKind::Conflict,
            path: "zero_optimization.zero_quantized_gradients",
            message: "quantized gradients (qgZ) are not implemented with MiCS shard groups".into(),
            help: Some("qgZ's all-to-all replaces the reduce-scatter over all ranks; MiCS reduces inside its shard groups and across them: remove one of the two".into()),
            notes: vec![format!("zero_quantized_gradients = true, mics_shard_size = {}", z.mics_shard_size)],
        });
    }
    stage_mismatch_warnings(cx, c);
}

fn check_offload(cx: &mut Cx<'_>, path: &str, o: &OffloadSection) {
    if o.device == OffloadDevice::Nvme && o.nvme_path.is_none() {
        report(
            cx,
            Violation {
                kind: DiagnosticKind::InvalidValue,
                path: &format!("{path}.device"),
                message: "device \"nvme\" needs `nvme_path`".into(),
                help: Some(format!("add `nvme_path = \"/local_nvme\"` to `{path}`")),
                notes: vec![],
            },
        );
    }
    if o.nvme_path
        .as_ref()
        .is_some_and(|p| p.as_os_str().is_empty())
    {
        invalid(
            cx,
            &format!("{path}.nvme_path"),
            "must not be empty".into(),
            None,
        );
    }
    if !(o.ratio > 0.0 && o.ratio <= 1.0) {
        invalid(
            cx,
            &format!("{path}.ratio"),
            format!("must be in (0, 1], found {}", o.ratio),
            None,
        );
    }
    positive(cx, &format!("{path}.buffer_count"), o.buffer_count);
    positive(cx, &format!("{path}.buffer_size"), Some(o.buffer_size));
}

/// Keys that only mean something at another stage are accepted with a warning, since
/// DeepSpeed accepts them and configs are often shared across stages.
fn stage_mismatch_warnings(cx: &mut Cx<'_>, c: &Config) {
    let z = &c.zero_optimization;
    let d = crate::model::ZeroOptimization::default();
    // (key, applies at stage 3 only, set to something other than the default)
    let keys = [
        (
            "stage3_prefetch_bucket_size",
            true,
            z.stage3_prefetch_bucket_size != d.stage3_prefetch_bucket_size,
        ),
        (
            "stage3_param_persistence_threshold",
            true,
            z.stage3_param_persistence_threshold != d.stage3_param_persistence_threshold,
        ),
        (
            "stage3_max_live_parameters",
            true,
            z.stage3_max_live_parameters != d.stage3_max_live_parameters,
        ),
        (
            "stage3_max_reuse_distance",
            true,
            z.stage3_max_reuse_distance != d.stage3_max_reuse_distance,
        ),
        (
            "stage3_gather_16bit_weights_on_model_save",
            true,
            z.stage3_gather_16bit_weights_on_model_save
                != d.stage3_gather_16bit_weights_on_model_save,
        ),
        ("sub_group_size", true, z.sub_group_size != d.sub_group_size),
        (
            "allgather_partitions",
            false,
            z.allgather_partitions != d.allgather_partitions,
        ),
        (
            "allgather_bucket_size",
            false,
            z.allgather_bucket_size != d.allgather_bucket_size,
        ),
        (
            "reduce_scatter",
            false,
            z.reduce_scatter != d.reduce_scatter,
        ),
        (
            "zero_hpz_partition_size",
            true,
            z.zero_hpz_partition_size > 1,
        ),
        ("zero_quantized_weights", true, z.zero_quantized_weights),
        (
            "zero_quantized_nontrainable_weights",
            true,
            z.zero_quantized_nontrainable_weights,
        ),
        ("zero_quantized_gradients", true, z.zero_quantized_gradients),
    ];
    // A default value spelled out (as `config convert` writes) changes nothing either way.
    for (key, stage3_only, changed) in keys {
        let path = format!("zero_optimization.{key}");
        let span = cx
            .span_of(&path)
            .filter(|_| changed && stage3_only == (z.stage < 3));
        if let Some(span) = span {
            cx.warn(Report {
                kind: DiagnosticKind::InvalidValue,
                path: &path,
                span: &span,
                message: format!("has no effect at ZeRO stage {}", z.stage),
                help: None,
            });
        }
    }
}
