//! The profile as text, laid out like DeepSpeed's flops profiler: a summary, the heaviest
//! modules at each depth, the per-module tree to `module_depth` (when `detailed`) and the
//! kernel families.

use std::fmt::Write;

use ferrozero_config::resolved::FlopsProfilerConfig;

use super::report::{FamilyRow, FlopsProfile, ModuleRow};

/// `1.23 G`-style figures, as DeepSpeed prints them.
fn si(v: f64) -> String {
    for (scale, unit) in [(1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")] {
        if v.abs() >= scale {
            return format!("{:.2} {unit}", v / scale);
        }
    }
    format!("{v:.0}")
}

fn line(out: &mut String, title: &str) {
    let pad = 78usize.saturating_sub(title.len() + 2) / 2;
    let _ = writeln!(out, "{0} {title} {0}", "-".repeat(pad));
}

/// The column heads under a first column named `first`.
fn header(out: &mut String, first: &str) {
    let _ = writeln!(
        out,
        "{first:<28} {:>9} {:>9} {:>11} {:>11} {:>11} {:>7}",
        "params", "calls", "FLOPs", "time (ms)", "FLOP/s", "% step"
    );
}

fn module_line(out: &mut String, indent: usize, name: &str, params: Option<u64>, r: Figures) {
    let label = format!("{}{name}", "  ".repeat(indent));
    let params = params.map_or(String::new(), |p| si(p as f64));
    let _ = writeln!(
        out,
        "{label:<28} {params:>9} {:>9} {:>11} {:>11.3} {:>11} {:>7.1}",
        r.calls,
        si(r.flops as f64),
        r.seconds * 1e3,
        si(r.tflops * 1e12),
        r.percent
    );
}

#[derive(Clone, Copy)]
struct Figures {
    calls: u64,
    flops: u64,
    seconds: f64,
    tflops: f64,
    percent: f64,
}

/// A table row's figures, alike for a module's row and a family's.
macro_rules! figures_of {
    ($($row:ty),*) => {$(
        impl From<&$row> for Figures {
            fn from(r: &$row) -> Self {
                Figures {
                    calls: r.calls,
                    flops: r.flops,
                    seconds: r.seconds,
                    tflops: r.tflops_per_s,
                    percent: r.percent_of_step,
                }
            }
        }
    )*};
}
figures_of!(ModuleRow, FamilyRow);

/// Whether level `depth` is printed under `module_depth` (`None`: every level).
fn shown(cfg: &FlopsProfilerConfig, depth: usize) -> bool {
    cfg.module_depth.is_none_or(|d| depth <= d)
}

/// The table for `p` under `cfg`'s `module_depth`, `top_modules` and `detailed`.
pub fn render(p: &FlopsProfile, cfg: &FlopsProfilerConfig) -> String {
    let mut out = String::new();
    line(&mut out, "ferrozero Flops Profiler");
    let _ = writeln!(out, "Profile Summary at step {}:", p.step);
    let _ = writeln!(
        out,
        "Notations: FLOPs are matrix products' (2·m·n·k; causal attention's halved T·T \
         terms), forward and backward; time is wall time per operation, each waited on"
    );
    let kv = |out: &mut String, k: &str, v: String| {
        let _ = writeln!(out, "{:<40}{v}", format!("{k}:"));
    };
    kv(&mut out, "rank", p.rank.to_string());
    kv(&mut out, "device", p.device.clone());
    kv(&mut out, "params of model", si(p.params as f64));
    kv(&mut out, "FLOPs of the step", si(p.flops as f64));
    kv(
        &mut out,
        "step latency",
        format!("{:.3} ms", p.step_seconds * 1e3),
    );
    kv(&mut out, "achieved FLOP/s", si(p.tflops_per_s * 1e12));
    top_modules(&mut out, p, cfg);
    if cfg.detailed {
        line(&mut out, "Detailed Profile per module");
        header(&mut out, "module");
        if shown(cfg, 0) {
            let model = Figures {
                calls: p.modules.iter().map(|m| m.calls).sum(),
                flops: p.flops,
                seconds: p.step_seconds,
                tflops: p.tflops_per_s,
                percent: 100.0,
            };
            module_line(&mut out, 0, "model", Some(p.params), model);
        }
        for m in p.modules.iter().filter(|_| shown(cfg, 1)) {
            module_line(&mut out, 1, &m.name, Some(m.params), m.into());
            for f in m.families.iter().filter(|_| shown(cfg, 2)) {
                module_line(&mut out, 2, f.family.name(), None, f.into());
            }
        }
    }
    line(&mut out, "Profile per kernel family");
    header(&mut out, "family");
    for f in &p.families {
        module_line(&mut out, 0, f.family.name(), None, f.into());
    }
    line(&mut out, "end of profile");
    out
}

/// DeepSpeed's "Top k modules in terms of ..." lines for depths 1 and 2.
fn top_modules(out: &mut String, p: &FlopsProfile, cfg: &FlopsProfilerConfig) {
    let k = cfg.top_modules;
    if k == 0 {
        return;
    }
    line(out, "Aggregated Profile per module");
    let units: Vec<&ModuleRow> = p.training_thread_modules().collect();
    let mut by_time = units.clone();
    by_time.sort_by(|a, b| b.seconds.total_cmp(&a.seconds));
    let mut by_flops = units.clone();
    by_flops.sort_by_key(|r| std::cmp::Reverse(r.flops));
    let mut by_params = units;
    by_params.sort_by_key(|r| std::cmp::Reverse(r.params));
    let names = |rows: &[&ModuleRow], f: &dyn Fn(&ModuleRow) -> String| {
        rows.iter()
            .take(k)
            .map(|r| format!("{} ({})", r.name, f(r)))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let _ = writeln!(
        out,
        "Top {k} modules in terms of time at depth 1: {}",
        names(&by_time, &|r| format!(
            "{:.3} ms, {:.1}%",
            r.seconds * 1e3,
            r.percent_of_step
        ))
    );
    let _ = writeln!(
        out,
        "Top {k} modules in terms of FLOPs at depth 1: {}",
        names(&by_flops, &|r| si(r.flops as f64))
    );
    let _ = writeln!(
        out,
        "Top {k} modules in terms of params at depth 1: {}",
        names(&by_params, &|r| si(r.params as f64))
    );
    if shown(cfg, 2) {
        let mut cells: Vec<(&str, &FamilyRow)> = p
            .training_thread_modules()
            .flat_map(|m| m.families.iter().map(move |f| (m.name.as_str(), f)))
            .collect();
        cells.sort_by(|a, b| b.1.seconds.total_cmp(&a.1.seconds));
        let top: Vec<String> = cells
            .iter()
            .take(k)
            .map(|(m, f)| format!("{m}.{} ({:.3} ms)", f.family.name(), f.seconds * 1e3))
            .collect();
        let _ = writeln!(
            out,
            "Top {k} modules in terms of time at depth 2: {}",
            top.join(", ")
        );
    }
}
