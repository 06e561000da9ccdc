//! `zero_optimization.zenflow`: DeepSpeed's ZenFlow steps the most important gradient columns
//! on the GPU every step and the rest on the host later, with stale values, so that the GPU
//! never waits on the host optimizer. ferrozero reaches the same goal exactly: its overlapped
//! offload steps each group on the host while backward goes on (speculatively where clipping
//! or a loss scale is on, within the host's memory). So a ZenFlow section is read, every key
//! checked as DeepSpeed checks it, and then answered with one warning saying what runs instead,
//! rather than refusing a config whose user wants exactly what ferrozero does.

use schemars::JsonSchema;
use serde::Serialize;

use super::auto::AutoOr;
use crate::diagnostic::DiagnosticKind;
use crate::parse::Node;
use crate::reader::{auto_or, to_choice, to_f64, to_uint, Cx, Report, TableReader};

/// What ferrozero does with a ZenFlow section, as the warning says it.
pub const INSTEAD: &str = "ZenFlow's stale, importance-selected updates are not implemented; \
     ferrozero runs its exact overlapped offload instead (each group's host step overlaps \
     backward where host memory allows; no stale updates)";

/// DeepSpeed's `ZenFlowConfig`, read for its checks: ferrozero runs its exact overlapped
/// offload instead (a warning says so).
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
pub struct ZenFlowSection {
    /// Share of gradient columns ZenFlow steps on the device, 0 to 1 (default 0.1).
    pub topk_ratio: f64,
    /// When ZenFlow picks the important columns: "auto", "step" or "epoch".
    pub select_strategy: String,
    /// Steps (or epochs) between picks, or "auto".
    pub select_interval: AutoOr<u64>,
    /// Steps between host updates of the other columns, or "auto".
    pub update_interval: AutoOr<u64>,
    /// Whether ZenFlow overlaps its host step with forward and backward.
    pub overlap_step: bool,
    /// Whether ZenFlow keeps its device optimizer's state on the host.
    pub offload: bool,
    /// The "auto" update interval's threshold, 0 to 1 (default 0.99).
    pub auto_ratio: f64,
    /// Steps at the start that update every column.
    pub full_warm_up_rounds: u64,
    /// Share of the cores ZenFlow leaves to PyTorch, 0 to 1 (default 0.5).
    pub pt_reserved_cores_perc: f64,
}

const STRATEGIES: &[(&str, &str)] = &[("auto", "auto"), ("step", "step"), ("epoch", "epoch")];

/// A number in [0, 1], as DeepSpeed's `Field(ge=0.0, le=1.0)` requires.
fn fraction(cx: &mut Cx<'_>, path: &str, node: &Node) -> Option<f64> {
    let v = to_f64(cx, path, node)?;
    if (0.0..=1.0).contains(&v) {
        return Some(v);
    }
    cx.invalid(path, node, format!("{v} is outside [0, 1]"), None);
    None
}

/// Reads the section and warns once that ferrozero's exact overlapped offload runs instead.
pub(crate) fn read_zenflow(cx: &mut Cx<'_>, path: &str, node: &Node) -> Option<ZenFlowSection> {
    let mut t = TableReader::new(cx, path, node)?;
    let auto_uint = |cx: &mut Cx<'_>, p: &str, n: &Node| auto_or(cx, p, n, to_uint);
    let s = ZenFlowSection {
        topk_ratio: t.get(cx, "topk_ratio", &[], fraction).unwrap_or(0.1),
        select_strategy: t
            .get(cx, "select_strategy", &[], |cx, p, n| {
                to_choice(cx, p, n, STRATEGIES)
            })
            .unwrap_or("auto")
            .to_string(),
        select_interval: t
            .get(cx, "select_interval", &[], auto_uint)
            .unwrap_or(AutoOr::Auto),
        update_interval: t
            .get(cx, "update_interval", &[], auto_uint)
            .unwrap_or(AutoOr::Auto),
        overlap_step: t.bool(cx, "overlap_step", false),
        offload: t.bool(cx, "offload", false),
        auto_ratio: t.get(cx, "auto_ratio", &[], fraction).unwrap_or(0.99),
        full_warm_up_rounds: t.uint(cx, "full_warm_up_rounds", 0),
        pt_reserved_cores_perc: t
            .get(cx, "pt_reserved_cores_perc", &[], fraction)
            .unwrap_or(0.5),
    };
    // DeepSpeed sets `steps_per_epoch` itself at run time and excludes it from the config.
    t.uint(cx, "steps_per_epoch", 0);
    let span = t.span.clone();
    t.finish(cx, &[]);
    cx.warn(Report {
        kind: DiagnosticKind::Unsupported,
        path,
        span: &span,
        message: "ZenFlow is not implemented; ignored".into(),
        help: Some(INSTEAD.into()),
    });
    Some(s)
}
