//! `data_types` against the training precision: gradients accumulate in the precision's own
//! dtype or in fp32; `param_dtype` may only restate the precision (DeepSpeed asserts it);
//! `buffer_dtype` may only keep buffers f32. Each violation names the precision it meets.

use super::{report, Violation};
use crate::diagnostic::DiagnosticKind;
use crate::model::{AutoOr, CommDataType, Config};
use crate::reader::Cx;

fn name(d: CommDataType) -> &'static str {
    match d {
        CommDataType::Fp32 => "fp32",
        CommDataType::Fp16 => "fp16",
        CommDataType::Bf16 => "bf16",
    }
}

/// The training precision's dtype; `"auto"` resolves to off (no mixed precision requested).
fn model_dtype(c: &Config) -> CommDataType {
    if c.fp16.enabled == AutoOr::Value(true) {
        CommDataType::Fp16
    } else if c.bf16.enabled == AutoOr::Value(true) {
        CommDataType::Bf16
    } else {
        CommDataType::Fp32
    }
}

fn conflict(cx: &mut Cx<'_>, key: &str, v: CommDataType, help: String, notes: Vec<String>) {
    let path = format!("data_types.{key}");
    report(
        cx,
        Violation {
            kind: DiagnosticKind::Conflict,
            path: &path,
            message: format!("{path} = \"{}\" is not available here", name(v)),
            help: Some(help),
            notes,
        },
    );
}

pub(super) fn check_data_types(cx: &mut Cx<'_>, c: &Config) {
    let (d, model) = (&c.data_types, model_dtype(c));
    let note = || vec![format!("training precision: {}", name(model))];
    if let Some(p) = d.param_dtype.filter(|&p| p != model) {
        let help = format!("remove it, or set it to \"{}\"", name(model));
        conflict(cx, "param_dtype", p, help, note());
    }
    if let Some(b) = d.buffer_dtype.filter(|&b| b != CommDataType::Fp32) {
        let help = "remove it: the rotary tables stay f32; casting them would change the model";
        conflict(cx, "buffer_dtype", b, help.into(), vec![]);
    }
    let Some(acc) = d.grad_accum_dtype.filter(|&a| a != model) else {
        return;
    };
    if acc != CommDataType::Fp32 {
        let help = format!(
            "gradients accumulate in the training precision (\"{}\") or in \"fp32\"",
            name(model)
        );
        conflict(cx, "grad_accum_dtype", acc, help, note());
    } else if c.bf16.bf16_master_weights_and_grads {
        let help = "bf16.bf16_master_weights_and_grads keeps the gradients in bf16: drop one";
        let notes = vec!["bf16.bf16_master_weights_and_grads = true".into()];
        conflict(cx, "grad_accum_dtype", acc, help.into(), notes);
    }
}
