//! DeepSpeed's `flops_profiler` (`deepspeed/profiling/config.py`), with DeepSpeed's keys and
//! defaults, and ferrozero's `peak_tflops` for the model FLOPs utilisation every step reports.

use schemars::JsonSchema;
use serde::Serialize;

use crate::parse::{Kind, Node};
use crate::reader::{to_f64, to_str, to_uint, Cx, Support, TableReader};

/// `flops_profiler`: at one step, the time, FLOPs and achieved TFLOP/s of every module of
/// the model (its units: embedding, each block, head; each split by kernel family) and of
/// every kernel family (matmul, attention, norm, elementwise, loss, optimizer, memory,
/// communication), printed as a table on rank 0 and written into the metrics.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct FlopsProfilerSection {
    /// Profile the step `profile_step`.
    pub enabled: bool,
    /// The global optimizer step (1-based) that is profiled.
    #[schemars(range(min = 1))]
    pub profile_step: u64,
    /// How deep the table goes: 0 the whole model, 1 its units (embedding, blocks, head), 2
    /// each unit split by kernel family; -1 every level.
    #[schemars(range(min = -1))]
    pub module_depth: i64,
    /// How many of the heaviest modules (by time) the summary names at each depth.
    pub top_modules: u64,
    /// Print the per-module table; `false` prints only the summary and the heaviest modules.
    pub detailed: bool,
    /// The file the table is written to (replaced); unset prints it to standard output.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub output_file: Option<String>,
    /// The device's peak dense TFLOP/s in the training precision, for `mfu` in every step's
    /// metrics (ferrozero's own key; read whether or not the profiler is enabled). Unset,
    /// known GPUs use their datasheet figure and the CPU reports no `mfu`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_tflops: Option<f64>,
}

impl Default for FlopsProfilerSection {
    fn default() -> Self {
        FlopsProfilerSection {
            enabled: false,
            profile_step: 1,
            module_depth: -1,
            top_modules: 1,
            detailed: true,
            output_file: None,
            peak_tflops: None,
        }
    }
}

/// DeepSpeed estimates backward FLOPs from forward's and needs the recomputation factor;
/// ferrozero counts every operation that runs, recomputed forwards included.
const SUPPORT: &[(&str, Support)] = &[(
    "recompute_fwd_factor",
    Support::IgnoredUnless(
        is_zero,
        "ferrozero counts the FLOPs of recomputed forward passes as they run, so no factor is needed",
    ),
)];

fn is_zero(n: &Node) -> bool {
    match n.kind {
        Kind::Int(i) => i == 0,
        Kind::Float(f) => f == 0.0,
        Kind::Null => true,
        _ => false,
    }
}

/// Reads `flops_profiler`.
pub(crate) fn read_flops_profiler(
    cx: &mut Cx<'_>,
    path: &str,
    node: &Node,
) -> Option<FlopsProfilerSection> {
    let mut t = TableReader::new(cx, path, node)?;
    let d = FlopsProfilerSection::default();
    let s = FlopsProfilerSection {
        enabled: t.bool(cx, "enabled", d.enabled),
        profile_step: t
            .get(cx, "profile_step", &[], read_step)
            .unwrap_or(d.profile_step),
        module_depth: t
            .get(cx, "module_depth", &[], read_depth)
            .unwrap_or(d.module_depth),
        top_modules: t.uint(cx, "top_modules", d.top_modules),
        detailed: t.bool(cx, "detailed", d.detailed),
        output_file: t.get(cx, "output_file", &[], read_file).flatten(),
        peak_tflops: t.get(cx, "peak_tflops", &[], read_peak).flatten(),
    };
    t.finish(cx, SUPPORT);
    Some(s)
}

fn read_step(cx: &mut Cx<'_>, path: &str, node: &Node) -> Option<u64> {
    let v = to_uint(cx, path, node)?;
    if v == 0 {
        let help = Some("steps count from 1, as DeepSpeed's global_steps does".into());
        cx.invalid(path, node, "must be at least 1, found 0".into(), help);
        return None;
    }
    Some(v)
}

fn read_depth(cx: &mut Cx<'_>, path: &str, node: &Node) -> Option<i64> {
    match node.kind {
        Kind::Int(n) if n >= -1 => Some(n),
        Kind::Int(n) => {
            let help = Some("-1 means every level".into());
            cx.invalid(path, node, format!("must be -1 or more, found {n}"), help);
            None
        }
        _ => {
            cx.wrong_type(path, node, "an integer");
            None
        }
    }
}

fn read_file(cx: &mut Cx<'_>, path: &str, node: &Node) -> Option<Option<String>> {
    match node.kind {
        Kind::Null => Some(None),
        _ => to_str(cx, path, node).map(|s| Some(s.to_string())),
    }
}

fn read_peak(cx: &mut Cx<'_>, path: &str, node: &Node) -> Option<Option<f64>> {
    if matches!(node.kind, Kind::Null) {
        return Some(None);
    }
    let v = to_f64(cx, path, node)?;
    if v <= 0.0 {
        cx.invalid(
            path,
            node,
            format!("must be a positive number of TFLOP/s, found {v}"),
            None,
        );
        return None;
    }
    Some(Some(v))
}
