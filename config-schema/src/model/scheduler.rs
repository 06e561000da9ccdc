//! `scheduler` {type, params}: WarmupLR, WarmupDecayLR, WarmupCosineLR and OneCycle with
//! DeepSpeed's parameter names.

use schemars::JsonSchema;
use serde::Serialize;

use super::auto::AutoOr;
use crate::diagnostic::DiagnosticKind;
use crate::parse::{Kind, Node};
use crate::reader::{
    auto_or, to_bool, to_choice, to_f64, to_uint, Cx, Report, Support, TableReader,
};

/// Scheduler type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, JsonSchema)]
pub enum SchedulerType {
    /// Warm up, then hold.
    WarmupLR,
    /// Warm up, then decay linearly to zero at `total_num_steps`.
    WarmupDecayLR,
    /// Warm up as a ratio of the optimizer's lr, then cosine decay.
    WarmupCosineLR,
    /// The 1-cycle policy.
    OneCycle,
}

/// Warmup curve.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum WarmupKind {
    /// Logarithmic (DeepSpeed's default).
    Log,
    /// Linear.
    Linear,
}

/// `scheduler`: how the learning rate (and, for OneCycle, the momentum) changes per step.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Scheduler {
    /// Which schedule.
    #[serde(rename = "type")]
    pub kind: SchedulerType,
    /// Its parameters; unset ones take DeepSpeed's defaults.
    #[serde(default)]
    pub params: SchedulerParams,
}

/// `scheduler.params`; which keys apply depends on the type.
#[derive(Debug, Clone, Default, PartialEq, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SchedulerParams {
    /// Start of warmup (WarmupLR, WarmupDecayLR; default 0).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warmup_min_lr: Option<AutoOr<f64>>,
    /// End of warmup (WarmupLR, WarmupDecayLR; default 0.001; `"auto"` = the optimizer's lr).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warmup_max_lr: Option<AutoOr<f64>>,
    /// Warmup steps (WarmupLR, WarmupDecayLR, WarmupCosineLR; default 1000).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warmup_num_steps: Option<AutoOr<u64>>,
    /// Shape of the warmup curve (WarmupLR, WarmupDecayLR, WarmupCosineLR; default `"log"`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warmup_type: Option<WarmupKind>,
    /// Total steps (WarmupDecayLR, WarmupCosineLR; required).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub total_num_steps: Option<AutoOr<u64>>,
    /// Warmup starts at this ratio of lr (WarmupCosineLR; default 0).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warmup_min_ratio: Option<f64>,
    /// Cosine ends at this ratio of lr (WarmupCosineLR; default 0.0001).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cos_min_ratio: Option<f64>,
    /// Lowest lr of the cycle (OneCycle; required).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cycle_min_lr: Option<f64>,
    /// Highest lr of the cycle (OneCycle; required).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cycle_max_lr: Option<f64>,
    /// Decay rate after the cycle (OneCycle; default 0).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decay_lr_rate: Option<f64>,
    /// Steps of the rising half (OneCycle; default 2000).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cycle_first_step_size: Option<u64>,
    /// Steps of the falling half (OneCycle; default = first).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cycle_second_step_size: Option<u64>,
    /// Stair interval of the rising half (OneCycle; default 0).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cycle_first_stair_count: Option<u64>,
    /// Stair interval of the falling half (OneCycle; default = first).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cycle_second_stair_count: Option<u64>,
    /// Decay interval after the cycle (OneCycle; default 0).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decay_step_size: Option<u64>,
    /// Cycle momentum too (OneCycle; default true).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cycle_momentum: Option<bool>,
    /// Lowest momentum (OneCycle; default 0.8).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cycle_min_mom: Option<f64>,
    /// Highest momentum (OneCycle; default 0.9).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cycle_max_mom: Option<f64>,
    /// Momentum decay rate after the cycle (OneCycle; default 0).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decay_mom_rate: Option<f64>,
}

const TYPES: &[(&str, SchedulerType)] = &[
    ("WarmupLR", SchedulerType::WarmupLR),
    ("WarmupDecayLR", SchedulerType::WarmupDecayLR),
    ("WarmupCosineLR", SchedulerType::WarmupCosineLR),
    ("OneCycle", SchedulerType::OneCycle),
];

const WARMUP: &[(&str, WarmupKind)] = &[("log", WarmupKind::Log), ("linear", WarmupKind::Linear)];

const PARAM_SUPPORT: &[(&str, Support)] = &[(
    "last_batch_iteration",
    Support::Ignored("the schedule position is restored from the checkpoint"),
)];

/// Reads `scheduler`.
pub(crate) fn read_scheduler(cx: &mut Cx<'_>, path: &str, node: &Node) -> Option<Scheduler> {
    let mut t = TableReader::new(cx, path, node)?;
    let kind = t.get(cx, "type", &[], |cx, p, n| {
        if matches!(&n.kind, Kind::Str(s) if s.eq_ignore_ascii_case("LRRangeTest")) {
            cx.error(Report {
                kind: DiagnosticKind::Unsupported,
                path: p,
                span: &n.span,
                message: "scheduler \"LRRangeTest\" is not supported by ferrozero".into(),
                help: Some(
                    "a learning-rate range test is a different run; use \"WarmupLR\", \"WarmupDecayLR\", \"WarmupCosineLR\" or \"OneCycle\""
                        .into(),
                ),
            });
            return None;
        }
        to_choice(cx, p, n, TYPES)
    });
    if !matches!(&node.kind, Kind::Table(es) if es.iter().any(|e| e.key == "type")) {
        cx.error(Report {
            kind: DiagnosticKind::InvalidValue,
            path,
            span: &t.span,
            message: "`type` is required".into(),
            help: Some(
                "valid types: \"WarmupLR\", \"WarmupDecayLR\", \"WarmupCosineLR\", \"OneCycle\""
                    .into(),
            ),
        });
    }
    let params = match t.take(cx, "params", &[]) {
        Some(e) => read_params(cx, &t.key_path("params"), &e.value, kind),
        None => Some(SchedulerParams::default()),
    };
    t.finish(cx, &[]);
    Some(Scheduler {
        kind: kind?,
        params: params?,
    })
}

fn read_params(
    cx: &mut Cx<'_>,
    path: &str,
    node: &Node,
    kind: Option<SchedulerType>,
) -> Option<SchedulerParams> {
    use SchedulerType::*;
    let mut t = TableReader::new(cx, path, node)?;
    let has = |types: &[SchedulerType]| kind.is_none_or(|k| types.contains(&k));
    let af = |cx: &mut Cx<'_>, p: &str, n: &Node| auto_or(cx, p, n, to_f64);
    let au = |cx: &mut Cx<'_>, p: &str, n: &Node| auto_or(cx, p, n, to_uint);
    let mut p = SchedulerParams::default();
    if has(&[WarmupLR, WarmupDecayLR]) {
        p.warmup_min_lr = t.get(cx, "warmup_min_lr", &[], af);
        p.warmup_max_lr = t.get(cx, "warmup_max_lr", &[], af);
    }
    if has(&[WarmupLR, WarmupDecayLR, WarmupCosineLR]) {
        p.warmup_num_steps = t.get(cx, "warmup_num_steps", &[], au);
        p.warmup_type = t.get(cx, "warmup_type", &[], |cx, p, n| {
            to_choice(cx, p, n, WARMUP)
        });
    }
    if has(&[WarmupDecayLR, WarmupCosineLR]) {
        p.total_num_steps = t.get(cx, "total_num_steps", &[], au);
    }
    if has(&[WarmupCosineLR]) {
        p.warmup_min_ratio = t.get(cx, "warmup_min_ratio", &[], to_f64);
        p.cos_min_ratio = t.get(cx, "cos_min_ratio", &[], to_f64);
    }
    if has(&[OneCycle]) {
        read_one_cycle(cx, &mut t, &mut p);
    }
    t.finish(cx, PARAM_SUPPORT);
    Some(p)
}

fn read_one_cycle(cx: &mut Cx<'_>, t: &mut TableReader<'_>, p: &mut SchedulerParams) {
    p.cycle_min_lr = t.get(cx, "cycle_min_lr", &[], to_f64);
    p.cycle_max_lr = t.get(cx, "cycle_max_lr", &[], to_f64);
    p.decay_lr_rate = t.get(cx, "decay_lr_rate", &[], to_f64);
    p.cycle_first_step_size = t.get(cx, "cycle_first_step_size", &[], to_uint);
    p.cycle_second_step_size = t.get(cx, "cycle_second_step_size", &[], to_uint);
    p.cycle_first_stair_count = t.get(cx, "cycle_first_stair_count", &[], to_uint);
    p.cycle_second_stair_count = t.get(cx, "cycle_second_stair_count", &[], to_uint);
    p.decay_step_size = t.get(cx, "decay_step_size", &[], to_uint);
    p.cycle_momentum = t.get(cx, "cycle_momentum", &[], to_bool);
    p.cycle_min_mom = t.get(cx, "cycle_min_mom", &[], to_f64);
    p.cycle_max_mom = t.get(cx, "cycle_max_mom", &[], to_f64);
    p.decay_mom_rate = t.get(cx, "decay_mom_rate", &[], to_f64);
}
