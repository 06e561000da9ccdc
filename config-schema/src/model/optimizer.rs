//! `optimizer` {type, params}: Adam, AdamW, SGD, Lion and LAMB with DeepSpeed's parameter
//! names.

use schemars::JsonSchema;
use serde::Serialize;

use super::auto::AutoOr;
use crate::diagnostic::DiagnosticKind;
use crate::parse::{Kind, Node};
use crate::reader::{auto_or, off, to_bool, to_choice, to_f64, Cx, Report, Support, TableReader};

/// Optimizer type, matched case-insensitively as DeepSpeed does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, JsonSchema)]
pub enum OptimizerType {
    /// Adam; decoupled weight decay (AdamW) unless `adam_w_mode = false`.
    Adam,
    /// Adam with decoupled weight decay.
    AdamW,
    /// SGD with momentum.
    #[serde(rename = "SGD")]
    Sgd,
    /// Lion: sign of an interpolated momentum (one state buffer instead of Adam's two).
    Lion,
    /// LAMB as DeepSpeed's `FusedLamb`: Adam's moments, the update scaled per parameter
    /// tensor by the trust ratio `|w| / |u|` clamped to `[min_coeff, max_coeff]`. Runs where
    /// the optimizer state lives: on the CPU, on a GPU (its kernels), or on the host with
    /// `zero_optimization.offload_optimizer.device = "cpu"`, with the same bits.
    Lamb,
}

/// `optimizer`: the update rule and its hyper-parameters.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Optimizer {
    /// Which optimizer; matched case-insensitively, as DeepSpeed does.
    #[serde(rename = "type")]
    pub kind: OptimizerType,
    /// Its parameters; unset ones take the optimizer's defaults.
    #[serde(default)]
    pub params: OptimizerParams,
}

/// `optimizer.params`; which keys apply depends on the type.
#[derive(Debug, Clone, Default, PartialEq, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct OptimizerParams {
    /// Learning rate (all types; default 1e-3, Lion 1e-4).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lr: Option<AutoOr<f64>>,
    /// `[beta1, beta2]` (Adam, AdamW, Lion, Lamb; default `[0.9, 0.999]`, Lion `[0.9, 0.99]`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub betas: Option<AutoOr<[f64; 2]>>,
    /// Added to the denominator for stability (Adam, AdamW, Lamb; default 1e-8).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eps: Option<AutoOr<f64>>,
    /// Weight decay (all types; default 0). Lamb adds it to the update direction
    /// (`u = m / d + weight_decay * w`), inside the trust ratio.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub weight_decay: Option<AutoOr<f64>>,
    /// Decoupled weight decay for `Adam` (default true).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub adam_w_mode: Option<bool>,
    /// Bias correction (Adam, AdamW, Lamb; default true). Lamb folds it into the step size,
    /// `lr * sqrt(1 - beta2^t) / (1 - beta1^t)`, as DeepSpeed's `FusedLamb` does.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bias_correction: Option<bool>,
    /// Momentum (SGD; default 0).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub momentum: Option<f64>,
    /// Dampening of the momentum (SGD; default 0).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dampening: Option<f64>,
    /// Nesterov momentum (SGD; default false).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nesterov: Option<bool>,
    /// `eps` under the square root, `sqrt(v + eps)`, instead of `sqrt(v) + eps` (Lamb;
    /// default false).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eps_inside_sqrt: Option<bool>,
    /// Upper bound of the trust ratio (Lamb; default 10.0).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_coeff: Option<f64>,
    /// Lower bound of the trust ratio (Lamb; default 0.01).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_coeff: Option<f64>,
}

const TYPES: &[(&str, OptimizerType)] = &[
    ("Adam", OptimizerType::Adam),
    ("AdamW", OptimizerType::AdamW),
    ("SGD", OptimizerType::Sgd),
    ("Lion", OptimizerType::Lion),
    ("Lamb", OptimizerType::Lamb),
];

/// DeepSpeed optimizer types ferrozero refuses rather than silently replacing, each with why
/// (the help says what to use instead).
const REFUSED_TYPES: &[(&str, &str)] = &[
    ("OneBitAdam", "1-bit Adam freezes the variance after a warm-up and sends sign-compressed, error-compensated momentum: a different update from Adam's, with communication ferrozero's collectives do not carry"),
    ("ZeroOneAdam", "0/1 Adam skips variance updates and compresses communication: a different update from Adam's"),
    ("OneBitLamb", "1-bit LAMB compresses momentum after a warm-up: a different update from LAMB's"),
    ("Adagrad", "Adagrad is not implemented"),
    ("Muon", "Muon's orthogonalised updates are not implemented"),
    ("MuAdam", "muP's per-layer learning-rate scaling is not implemented"),
    ("MuAdamW", "muP's per-layer learning-rate scaling is not implemented"),
    ("MuSGD", "muP's per-layer learning-rate scaling is not implemented"),
];

const PARAM_SUPPORT: &[(&str, Support)] = &[
    (
        "torch_adam",
        Support::Ignored("ferrozero has one Adam kernel"),
    ),
    ("fused", Support::Ignored("ferrozero has one Adam kernel")),
    (
        "max_grad_norm",
        Support::Refused("DeepSpeed rejects it too: set the top-level `gradient_clipping`"),
    ),
];

/// Reads `optimizer`.
pub(crate) fn read_optimizer(cx: &mut Cx<'_>, path: &str, node: &Node) -> Option<Optimizer> {
    let mut t = TableReader::new(cx, path, node)?;
    let kind = t.get(cx, "type", &[], read_type);
    let params = match t.take(cx, "params", &[]) {
        Some(e) => read_params(cx, &t.key_path("params"), &e.value, kind),
        None => Some(OptimizerParams::default()),
    };
    if !has_key(node, "type") {
        cx.error(Report {
            kind: DiagnosticKind::InvalidValue,
            path,
            span: &t.span,
            message: "`type` is required".into(),
            help: Some("valid types: \"Adam\", \"AdamW\", \"SGD\", \"Lion\", \"Lamb\"".into()),
        });
    }
    t.finish(
        cx,
        &[(
            "legacy_fusion",
            Support::IgnoredUnless(
                off::is_false,
                "a fused-kernel switch of DeepSpeed's fp16 optimizer; ferrozero has one kernel per optimizer",
            ),
        )],
    );
    Some(Optimizer {
        kind: kind?,
        params: params?,
    })
}

fn has_key(node: &Node, key: &str) -> bool {
    matches!(&node.kind, Kind::Table(es) if es.iter().any(|e| e.key == key))
}

fn read_type(cx: &mut Cx<'_>, path: &str, node: &Node) -> Option<OptimizerType> {
    if let Kind::Str(s) = &node.kind {
        if let Some((name, why)) = REFUSED_TYPES
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(s))
        {
            cx.error(Report {
                kind: DiagnosticKind::Unsupported,
                path,
                span: &node.span,
                message: format!("optimizer \"{name}\" is not supported by ferrozero: {why}"),
                help: Some("use \"Adam\", \"AdamW\", \"SGD\", \"Lion\" or \"Lamb\"".into()),
            });
            return None;
        }
    }
    to_choice(cx, path, node, TYPES)
}

fn applies(key: &str, kind: OptimizerType) -> bool {
    use OptimizerType::*;
    match key {
        "lr" | "weight_decay" => true,
        "betas" => kind != Sgd,
        "eps" | "bias_correction" | "amsgrad" => matches!(kind, Adam | AdamW | Lamb),
        "adam_w_mode" => matches!(kind, Adam | AdamW),
        "eps_inside_sqrt" | "max_coeff" | "min_coeff" => kind == Lamb,
        _ => kind == Sgd,
    }
}

fn read_params(
    cx: &mut Cx<'_>,
    path: &str,
    node: &Node,
    kind: Option<OptimizerType>,
) -> Option<OptimizerParams> {
    let mut t = TableReader::new(cx, path, node)?;
    let f = |cx: &mut Cx<'_>, p: &str, n: &Node| auto_or(cx, p, n, to_f64);
    let p = OptimizerParams {
        lr: t.get(cx, "lr", &[], f),
        betas: t.get(cx, "betas", &[], |cx, p, n| auto_or(cx, p, n, read_betas)),
        eps: t.get(cx, "eps", &[], f),
        weight_decay: t.get(cx, "weight_decay", &[], f),
        adam_w_mode: t.get(cx, "adam_w_mode", &[], to_bool),
        bias_correction: t.get(cx, "bias_correction", &[], to_bool),
        momentum: t.get(cx, "momentum", &[], to_f64),
        dampening: t.get(cx, "dampening", &[], to_f64),
        nesterov: t.get(cx, "nesterov", &[], to_bool),
        eps_inside_sqrt: t.get(cx, "eps_inside_sqrt", &[], to_bool),
        max_coeff: t.get(cx, "max_coeff", &[], to_f64),
        min_coeff: t.get(cx, "min_coeff", &[], to_f64),
    };
    if let Some(amsgrad) = t.get(cx, "amsgrad", &[], to_bool) {
        if amsgrad {
            let span = cx
                .span_of(&format!("{path}.amsgrad"))
                .unwrap_or(t.span.clone());
            cx.error(Report {
                kind: DiagnosticKind::Unsupported,
                path: &format!("{path}.amsgrad"),
                span: &span,
                message: match kind {
                    Some(OptimizerType::Lamb) => {
                        "AMSGrad is not supported by Lamb (DeepSpeed's FusedLamb refuses it too)"
                    }
                    _ => "AMSGrad is not supported by ferrozero",
                }
                .into(),
                help: Some("remove `amsgrad` or set it to false".into()),
            });
        }
    }
    if let Some(kind) = kind {
        check_applicable(cx, path, kind, &p);
        if kind == OptimizerType::Lamb {
            refuse_adam_switches(cx, path, &mut t);
            check_coeffs(cx, path, &p);
        }
    }
    t.finish(cx, PARAM_SUPPORT);
    Some(p)
}

fn check_applicable(cx: &mut Cx<'_>, path: &str, kind: OptimizerType, p: &OptimizerParams) {
    let set = [
        ("betas", p.betas.is_some()),
        ("eps", p.eps.is_some()),
        ("adam_w_mode", p.adam_w_mode.is_some()),
        ("bias_correction", p.bias_correction.is_some()),
        ("momentum", p.momentum.is_some()),
        ("dampening", p.dampening.is_some()),
        ("nesterov", p.nesterov.is_some()),
        ("eps_inside_sqrt", p.eps_inside_sqrt.is_some()),
        ("max_coeff", p.max_coeff.is_some()),
        ("min_coeff", p.min_coeff.is_some()),
    ];
    for (key, present) in set {
        let key_path = format!("{path}.{key}");
        let Some(span) = cx
            .span_of(&key_path)
            .filter(|_| present && !applies(key, kind))
        else {
            continue;
        };
        cx.error(Report {
            kind: DiagnosticKind::InvalidValue,
            path: &key_path,
            span: &span,
            message: format!("`{key}` is not a parameter of {kind:?}"),
            help: Some("remove it, or change `optimizer.type`".into()),
        });
    }
    if kind == OptimizerType::AdamW && p.adam_w_mode == Some(false) {
        let key_path = format!("{path}.adam_w_mode");
        let span = cx.span_of(&key_path).unwrap_or_default();
        cx.error(Report {
            kind: DiagnosticKind::Conflict,
            path: &key_path,
            span: &span,
            message: "type \"AdamW\" with `adam_w_mode = false` is contradictory".into(),
            help: Some(
                "for L2-regularised Adam write type = \"Adam\" with adam_w_mode = false".into(),
            ),
        });
    }
}

/// `torch_adam` and `fused` choose DeepSpeed's Adam implementation; `FusedLamb` takes neither
/// (DeepSpeed fails on them), so under Lamb they are refused by name (taken here, so they
/// are not also reported as ignored Adam switches).
fn refuse_adam_switches(cx: &mut Cx<'_>, path: &str, t: &mut TableReader<'_>) {
    for key in ["torch_adam", "fused"] {
        let Some(e) = t.take(cx, key, &[]) else {
            continue;
        };
        let key_path = format!("{path}.{key}");
        let span = e.value.span.clone();
        cx.error(Report {
            kind: DiagnosticKind::InvalidValue,
            path: &key_path,
            span: &span,
            message: format!("`{key}` is not a parameter of Lamb"),
            help: Some("remove it, or change `optimizer.type`".into()),
        });
    }
}

/// The trust ratio's clamp must be a non-empty range of positive numbers.
fn check_coeffs(cx: &mut Cx<'_>, path: &str, p: &OptimizerParams) {
    let (lo, hi) = (p.min_coeff.unwrap_or(0.01), p.max_coeff.unwrap_or(10.0));
    if lo > 0.0 && lo <= hi && hi.is_finite() {
        return;
    }
    let key = if p.min_coeff.is_some() {
        "min_coeff"
    } else {
        "max_coeff"
    };
    let key_path = format!("{path}.{key}");
    let span = cx.span_of(&key_path).unwrap_or_default();
    cx.error(Report {
        kind: DiagnosticKind::InvalidValue,
        path: &key_path,
        span: &span,
        message: format!(
            "Lamb's trust ratio is clamped to [min_coeff, max_coeff] = [{lo}, {hi}]: that must be \
             a range of positive finite numbers with min_coeff <= max_coeff"
        ),
        help: Some("DeepSpeed's defaults are min_coeff = 0.01, max_coeff = 10.0".into()),
    });
}

fn read_betas(cx: &mut Cx<'_>, path: &str, node: &Node) -> Option<[f64; 2]> {
    let Kind::Array(items) = &node.kind else {
        cx.wrong_type(path, node, "an array of two numbers");
        return None;
    };
    if items.len() != 2 {
        cx.error(Report {
            kind: DiagnosticKind::InvalidValue,
            path,
            span: &node.span,
            message: format!(
                "expected two numbers [beta1, beta2], found {} values",
                items.len()
            ),
            help: None,
        });
        return None;
    }
    let b1 = to_f64(cx, &format!("{path}[0]"), &items[0]);
    let b2 = to_f64(cx, &format!("{path}[1]"), &items[1]);
    Some([b1?, b2?])
}
