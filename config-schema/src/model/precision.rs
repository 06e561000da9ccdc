//! `fp16` (with DeepSpeed's dynamic loss-scale block) and `bf16` (alias `bfloat16`).

use schemars::JsonSchema;
use serde::Serialize;

use super::auto::AutoOr;
use crate::parse::Node;
use crate::reader::{auto_or, off, to_bool, to_f64, Cx, Support, TableReader};

/// `fp16`: IEEE half-precision compute with f32 master weights, and DeepSpeed's static or
/// dynamic loss scaling.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Fp16 {
    /// fp16 mixed precision; `"auto"` resolves to off unless the caller asks for it.
    pub enabled: AutoOr<bool>,
    /// Autocast the forward pass to fp16 (ferrozero's layers choose their own precision:
    /// `true` is ignored with a warning).
    pub auto_cast: bool,
    /// Static loss scale; 0 selects the dynamic scaler.
    pub loss_scale: f64,
    /// The dynamic scaler starts at `2^initial_scale_power`.
    #[schemars(range(max = 63))]
    pub initial_scale_power: u32,
    /// Clean iterations before the scale doubles.
    pub loss_scale_window: u64,
    /// Overflows tolerated before the scale halves.
    pub hysteresis: u32,
    /// Refill hysteresis on every clean step.
    pub consecutive_hysteresis: bool,
    /// Floor for the dynamic scale; an overflow at the floor stops training.
    pub min_loss_scale: f64,
}

impl Default for Fp16 {
    fn default() -> Self {
        Fp16 {
            enabled: AutoOr::Value(false),
            auto_cast: false,
            loss_scale: 0.0,
            initial_scale_power: 16,
            loss_scale_window: 1000,
            hysteresis: 2,
            consecutive_hysteresis: false,
            min_loss_scale: 1.0,
        }
    }
}

/// `bf16`: bfloat16 compute with f32 master weights (unless told otherwise); no loss scaling
/// is needed.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Bf16 {
    /// bf16 mixed precision; `"auto"` resolves to off unless the caller asks for it.
    pub enabled: AutoOr<bool>,
    /// Keep the optimizer's master weights in bf16: no f32 copy, the optimizer updates the
    /// bf16 parameters themselves (computing in f32 and rounding to nearest even); gradients
    /// are bf16 already. ZeRO stages 1-3; without `bf16_optimizer_states` the optimizer state
    /// must be offloaded (`offload_optimizer.device = "cpu"`), as in DeepSpeed.
    pub bf16_master_weights_and_grads: bool,
    /// Keep the optimizer's moments (Adam's two, SGD's momentum, Lion's one) in bf16, widened
    /// to f32 for the update and rounded back to nearest even; needs
    /// `bf16_master_weights_and_grads`. The state stays where the optimizer runs: on the GPU
    /// (its kernels give the host step's bits) or offloaded to the CPU; not on NVMe, whose
    /// optimizer keeps f32 state, and not with LAMB.
    pub bf16_optimizer_states: bool,
}

impl Default for Bf16 {
    fn default() -> Self {
        Bf16 {
            enabled: AutoOr::Value(false),
            bf16_master_weights_and_grads: false,
            bf16_optimizer_states: false,
        }
    }
}

const FP16_SUPPORT: &[(&str, Support)] = &[
    (
        "fp16_master_weights_and_grads",
        Support::RefusedUnless(off::is_false, "master weights are always f32 in ferrozero"),
    ),
    (
        "type",
        Support::Refused("ferrozero's fp16 is IEEE half only"),
    ),
];

const BF16_SUPPORT: &[(&str, Support)] = &[
    (
        "immediate_grad_update",
        Support::IgnoredUnless(off::is_false, "gradients are always accumulated in f32"),
    ),
    (
        "check_grad_overflow",
        Support::Ignored("bf16 has f32's range; no overflow check is needed"),
    ),
];

fn auto_bool(cx: &mut Cx<'_>, p: &str, n: &Node) -> Option<AutoOr<bool>> {
    auto_or(cx, p, n, to_bool)
}

/// Reads `fp16`.
pub(crate) fn read_fp16(cx: &mut Cx<'_>, path: &str, node: &Node) -> Option<Fp16> {
    let mut t = TableReader::new(cx, path, node)?;
    let d = Fp16::default();
    let small = crate::reader::to_u32;
    let f = Fp16 {
        enabled: t.get(cx, "enabled", &[], auto_bool).unwrap_or(d.enabled),
        auto_cast: t.bool(cx, "auto_cast", d.auto_cast),
        loss_scale: t.get(cx, "loss_scale", &[], to_f64).unwrap_or(d.loss_scale),
        initial_scale_power: t
            .get(cx, "initial_scale_power", &[], small)
            .unwrap_or(d.initial_scale_power),
        loss_scale_window: t.uint(cx, "loss_scale_window", d.loss_scale_window),
        hysteresis: t.get(cx, "hysteresis", &[], small).unwrap_or(d.hysteresis),
        consecutive_hysteresis: t.bool(cx, "consecutive_hysteresis", d.consecutive_hysteresis),
        min_loss_scale: t.float(cx, "min_loss_scale", d.min_loss_scale),
    };
    if f.auto_cast {
        let path = t.key_path("auto_cast");
        cx.ignored_if_set(
            &path,
            "ferrozero's layers run in the precision the config selects; there is no autocast",
        );
    }
    t.finish(cx, FP16_SUPPORT);
    Some(f)
}

/// Reads `bf16`.
pub(crate) fn read_bf16(cx: &mut Cx<'_>, path: &str, node: &Node) -> Option<Bf16> {
    let mut t = TableReader::new(cx, path, node)?;
    let b = Bf16 {
        enabled: t
            .get(cx, "enabled", &[], auto_bool)
            .unwrap_or(AutoOr::Value(false)),
        bf16_master_weights_and_grads: t.bool(cx, "bf16_master_weights_and_grads", false),
        bf16_optimizer_states: t.bool(cx, "bf16_optimizer_states", false),
    };
    t.finish(cx, BF16_SUPPORT);
    Some(b)
}
