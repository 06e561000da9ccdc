//! Cross-field rules, checked once the typed config is built. Each failure names every value
//! involved, so the user sees the whole conflict at once.

use crate::diagnostic::DiagnosticKind;
use crate::model::{AutoOr, Config, OffloadDevice, OffloadSection, SchedulerType};
use crate::reader::{Cx, Report};

/// One rule failure: the key it is reported on, and the facts behind it.
struct Violation<'a> {
    kind: DiagnosticKind,
    path: &'a str,
    message: String,
    help: Option<String>,
    notes: Vec<String>,
}

fn report(cx: &mut Cx<'_>, v: Violation<'_>) {
    let span = span_near(cx, v.path);
    let d = cx.error(Report {
        kind: v.kind,
        path: v.path,
        span: &span,
        message: v.message,
        help: v.help,
    });
    d.notes = v.notes;
}

/// The span of `path`, or of its nearest ancestor that was written (defaults have no span).
fn span_near(cx: &Cx<'_>, path: &str) -> std::ops::Range<usize> {
    let mut p = path;
    loop {
        if let Some(s) = cx.span_of(p) {
            return s;
        }
        match p.rfind('.') {
            Some(i) => p = &p[..i],
            None => return 0..0,
        }
    }
}

fn invalid(cx: &mut Cx<'_>, path: &str, message: String, help: Option<&str>) {
    report(
        cx,
        Violation {
            kind: DiagnosticKind::InvalidValue,
            path,
            message,
            help: help.map(str::to_string),
            notes: vec![],
        },
    );
}

/// Checks every cross-field rule.
pub(crate) fn check(cx: &mut Cx<'_>, c: &Config) {
    check_batch(cx, c);
    check_precision(cx, c);
    check_zero(cx, c);
    check_optimizer(cx, c);
    check_scheduler(cx, c);
    check_misc(cx, c);
}

fn positive(cx: &mut Cx<'_>, path: &str, value: Option<u64>) {
    if value == Some(0) {
        invalid(cx, path, "must be at least 1, found 0".into(), None);
    }
}

fn check_batch(cx: &mut Cx<'_>, c: &Config) {
    let train = c.train_batch_size.and_then(|v| v.value());
    let micro = c.train_micro_batch_size_per_gpu.and_then(|v| v.value());
    let gas = c.gradient_accumulation_steps.and_then(|v| v.value());
    positive(cx, "train_batch_size", train);
    positive(cx, "train_micro_batch_size_per_gpu", micro);
    positive(cx, "gradient_accumulation_steps", gas);
    if let (Some(t), Some(m), Some(g)) = (train, micro, gas) {
        let per_rank = m.saturating_mul(g);
        if per_rank > 0 && t % per_rank != 0 {
            report(cx, Violation {
                kind: DiagnosticKind::BatchSize,
                path: "train_batch_size",
                message: "train_batch_size is not a multiple of micro × accumulation; no world size fits".into(),
                help: Some("train_batch_size must equal train_micro_batch_size_per_gpu × gradient_accumulation_steps × world size".into()),
                notes: vec![format!("train_batch_size = {t}, train_micro_batch_size_per_gpu = {m}, gradient_accumulation_steps = {g}")],
            });
        }
    }
    if let Some(AutoOr::Value(clip)) = Some(c.gradient_clipping) {
        if clip < 0.0 {
            invalid(
                cx,
                "gradient_clipping",
                format!("must be 0 (off) or positive, found {clip}"),
                None,
            );
        }
    }
}

fn check_precision(cx: &mut Cx<'_>, c: &Config) {
    if c.fp16.enabled == AutoOr::Value(true) && c.bf16.enabled == AutoOr::Value(true) {
        report(
            cx,
            Violation {
                kind: DiagnosticKind::Conflict,
                path: "bf16.enabled",
                message: "fp16 and bf16 cannot both be enabled".into(),
                help: Some("choose one: bf16 needs no loss scaling".into()),
                notes: vec!["fp16.enabled = true, bf16.enabled = true".into()],
            },
        );
        if let Some(s) = cx.span_of("fp16.enabled") {
            cx.relate(&s, "fp16 enabled here");
        }
    }
    let f = &c.fp16;
    if f.loss_scale < 0.0 {
        invalid(
            cx,
            "fp16.loss_scale",
            format!("must be 0 (dynamic) or positive, found {}", f.loss_scale),
            None,
        );
    }
    if f.initial_scale_power > 63 {
        invalid(
            cx,
            "fp16.initial_scale_power",
            format!("must be at most 63, found {}", f.initial_scale_power),
            Some("fp16's largest finite value is about 2^16; 16 is the usual start"),
        );
    }
    positive(cx, "fp16.loss_scale_window", Some(f.loss_scale_window));
    positive(cx, "fp16.hysteresis", Some(u64::from(f.hysteresis)));
    if f.min_loss_scale <= 0.0 {
        invalid(
            cx,
            "fp16.min_loss_scale",
            format!("must be positive, found {}", f.min_loss_scale),
            None,
        );
    } else if f.initial_scale_power <= 63
        && f.min_loss_scale > 2f64.powi(f.initial_scale_power as i32)
    {
        report(
            cx,
            Violation {
                kind: DiagnosticKind::Conflict,
                path: "fp16.min_loss_scale",
                message: "min_loss_scale is above the initial scale".into(),
                help: Some("lower min_loss_scale or raise initial_scale_power".into()),
                notes: vec![format!(
                    "min_loss_scale = {}, initial_scale_power = {} (initial scale {})",
                    f.min_loss_scale,
                    f.initial_scale_power,
                    2f64.powi(f.initial_scale_power as i32)
                )],
            },
        );
    }
}

fn check_zero(cx: &mut Cx<'_>, c: &Config) {
    let z = &c.zero_optimization;
    let stage = z.stage;
    for (key, value) in [
        ("reduce_bucket_size", z.reduce_bucket_size.value()),
        ("allgather_bucket_size", Some(z.allgather_bucket_size)),
        ("sub_group_size", Some(z.sub_group_size)),
        (
            "stage3_prefetch_bucket_size",
            z.stage3_prefetch_bucket_size.value(),
        ),
        (
            "stage3_max_live_parameters",
            Some(z.stage3_max_live_parameters),
        ),
        ("zero_hpz_partition_size", Some(z.zero_hpz_partition_size)),
    ] {
        positive(cx, &format!("zero_optimization.{key}"), value);
    }
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

fn check_optimizer(cx: &mut Cx<'_>, c: &Config) {
    let Some(o) = &c.optimizer else { return };
    let p = &o.params;
    let base = "optimizer.params";
    for (key, v) in [
        ("lr", p.lr),
        ("eps", p.eps),
        ("weight_decay", p.weight_decay),
    ] {
        if let Some(AutoOr::Value(v)) = v {
            if v < 0.0 {
                invalid(
                    cx,
                    &format!("{base}.{key}"),
                    format!("must not be negative, found {v}"),
                    None,
                );
            }
        }
    }
    if let Some(AutoOr::Value([b1, b2])) = p.betas {
        if !(0.0..1.0).contains(&b1) || !(0.0..1.0).contains(&b2) {
            invalid(
                cx,
                &format!("{base}.betas"),
                format!("each beta must be in [0, 1), found [{b1}, {b2}]"),
                None,
            );
        }
    }
}

fn check_scheduler(cx: &mut Cx<'_>, c: &Config) {
    let Some(s) = &c.scheduler else { return };
    let p = &s.params;
    let base = "scheduler.params";
    let needs_total = matches!(
        s.kind,
        SchedulerType::WarmupDecayLR | SchedulerType::WarmupCosineLR
    );
    if needs_total && p.total_num_steps.is_none() {
        invalid(
            cx,
            base,
            format!("{:?} needs `total_num_steps`", s.kind),
            Some("add `total_num_steps` to scheduler.params"),
        );
    }
    if let (Some(AutoOr::Value(w)), Some(AutoOr::Value(t))) =
        (p.warmup_num_steps, p.total_num_steps)
    {
        if w > t {
            conflict(
                cx,
                &format!("{base}.warmup_num_steps"),
                "warmup is longer than the whole schedule",
                format!("warmup_num_steps = {w}, total_num_steps = {t}"),
            );
        }
    }
    if let (Some(AutoOr::Value(lo)), Some(AutoOr::Value(hi))) = (p.warmup_min_lr, p.warmup_max_lr) {
        if lo > hi {
            conflict(
                cx,
                &format!("{base}.warmup_min_lr"),
                "warmup_min_lr is above warmup_max_lr",
                format!("warmup_min_lr = {lo}, warmup_max_lr = {hi}"),
            );
        }
    }
    if s.kind == SchedulerType::OneCycle {
        match (p.cycle_min_lr, p.cycle_max_lr) {
            (Some(lo), Some(hi)) if lo > hi => conflict(
                cx,
                &format!("{base}.cycle_min_lr"),
                "cycle_min_lr is above cycle_max_lr",
                format!("cycle_min_lr = {lo}, cycle_max_lr = {hi}"),
            ),
            (Some(_), Some(_)) => {}
            _ => invalid(
                cx,
                base,
                "OneCycle needs `cycle_min_lr` and `cycle_max_lr`".into(),
                None,
            ),
        }
        if let (Some(lo), Some(hi)) = (p.cycle_min_mom, p.cycle_max_mom) {
            if lo > hi {
                conflict(
                    cx,
                    &format!("{base}.cycle_min_mom"),
                    "cycle_min_mom is above cycle_max_mom",
                    format!("cycle_min_mom = {lo}, cycle_max_mom = {hi}"),
                );
            }
        }
    }
    for (key, v) in [
        ("warmup_min_ratio", p.warmup_min_ratio),
        ("cos_min_ratio", p.cos_min_ratio),
    ] {
        if let Some(v) = v.filter(|v| !(0.0..=1.0).contains(v)) {
            invalid(
                cx,
                &format!("{base}.{key}"),
                format!("must be in [0, 1], found {v}"),
                None,
            );
        }
    }
}

fn conflict(cx: &mut Cx<'_>, path: &str, message: &str, values: String) {
    report(
        cx,
        Violation {
            kind: DiagnosticKind::Conflict,
            path,
            message: message.into(),
            help: None,
            notes: vec![values],
        },
    );
}

fn check_misc(cx: &mut Cx<'_>, c: &Config) {
    positive(cx, "steps_per_print", Some(c.steps_per_print));
    positive(cx, "aio.block_size", Some(c.aio.block_size));
    positive(cx, "aio.queue_depth", Some(c.aio.queue_depth));
    positive(
        cx,
        "aio.intra_op_parallelism",
        Some(c.aio.intra_op_parallelism),
    );
    positive(cx, "comms.timeout", Some(c.comms.timeout));
    if let Some(a) = &c.activation_checkpointing {
        positive(
            cx,
            "activation_checkpointing.number_checkpoints",
            a.number_checkpoints,
        );
    }
}
