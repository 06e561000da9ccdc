//! Precision rules: fp16 and bf16 exclusive, loss-scale parameters in range.

use super::{invalid, positive, report, Violation};
use crate::diagnostic::DiagnosticKind;
use crate::model::{AutoOr, Config};
use crate::reader::Cx;

pub(super) fn check_precision(cx: &mut Cx<'_>, c: &Config) {
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
