//! Cross-field rules, checked once the typed config is built. Each failure names every value
//! involved, so the user sees the whole conflict at once.
mod bf16_state;
mod data_types;
mod optim;
mod precision;
mod zero;

use crate::diagnostic::DiagnosticKind;
use crate::model::{AutoOr, Config};
use crate::reader::{Cx, Report};

/// One rule failure: the key it is reported on, and the facts behind it.
pub(super) struct Violation<'a> {
    pub(super) kind: DiagnosticKind,
    pub(super) path: &'a str,
    pub(super) message: String,
    pub(super) help: Option<String>,
    pub(super) notes: Vec<String>,
}

pub(super) fn report(cx: &mut Cx<'_>, v: Violation<'_>) {
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

pub(super) fn invalid(cx: &mut Cx<'_>, path: &str, message: String, help: Option<&str>) {
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
    precision::check_precision(cx, c);
    bf16_state::check_bf16_state(cx, c);
    data_types::check_data_types(cx, c);
    zero::check_zero(cx, c);
    optim::check_optimizer(cx, c);
    optim::check_scheduler(cx, c);
    check_misc(cx, c);
}

pub(super) fn positive(cx: &mut Cx<'_>, path: &str, value: Option<u64>) {
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
pub(super) fn conflict(cx: &mut Cx<'_>, path: &str, message: &str, values: String) {
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
