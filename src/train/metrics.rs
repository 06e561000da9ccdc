//! What rank 0 reports while training: a progress bar or log lines, one JSON object per step
//! and per evaluation, the memory timeline and the closing summary.

use std::io::Write;
use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};

use super::TrainOptions;
use crate::engine::{Engine, StepReport};
use ferrozero_runtime::backend::DeviceActivity;
use ferrozero_runtime::engine::ledger::Location;
use ferrozero_runtime::engine::timeline::{Pool, Timeline};
use ferrozero_runtime::nn::Batch;
use ferrozero_runtime::profiler::{self, model_flops_per_token, stated_peak_tflops};
use ferrozero_runtime::{Error, Result};

fn io(context: &str, e: std::io::Error) -> Error {
    Error::Io {
        context: context.into(),
        source: e,
    }
}

/// Rank 0's outputs, and the throughput counters every rank keeps.
pub(super) struct Writer {
    lead: bool,
    bar: Option<ProgressBar>,
    file: Option<std::io::BufWriter<std::fs::File>>,
    tokens: u64,
    warm: (f64, f64),
    steps: u64,
    /// Model FLOPs over the warm steps (after the first two), for the benchmark's `mfu`.
    warm_flops: f64,
    /// Device activity summed over the warm steps (those `warm` counts), and their number.
    activity: (DeviceActivity, u64),
}

impl Writer {
    pub(super) fn new(engine: &Engine, opts: &TrainOptions) -> Result<Self> {
        let lead = engine.rank() == 0;
        let file = match (&opts.metrics, lead) {
            (Some(p), true) => Some(std::io::BufWriter::new(
                std::fs::File::create(p).map_err(|e| io(&format!("create {}", p.display()), e))?,
            )),
            _ => None,
        };
        Ok(Self {
            lead,
            bar: (lead && opts.progress).then(|| progress(opts.steps)),
            file,
            tokens: 0,
            warm: (0.0, 0.0),
            steps: 0,
            warm_flops: 0.0,
            activity: (DeviceActivity::default(), 0),
        })
    }

    /// Runs one optimizer step on `batches` and reports it.
    pub(super) fn step(
        &mut self,
        engine: &mut Engine,
        batches: &[Batch],
        timeline: &mut Timeline,
    ) -> Result<StepReport> {
        let t = Instant::now();
        let r = engine.train_batch(batches)?;
        let dt = t.elapsed().as_secs_f64();
        let tokens =
            engine.sum_across_ranks(batches.iter().map(|b| (b.batch * b.seq) as f64).sum())?;
        let seq = batches.first().map_or(0, |b| b.seq);
        let flops = tokens * model_flops_per_token(engine.model(), seq) as f64;
        self.tokens += tokens as u64;
        if self.steps >= 2 {
            self.warm.0 += tokens;
            self.warm.1 += dt;
            self.warm_flops += flops;
            if let Some(a) = r.device_activity {
                self.activity.0 = self.activity.0 + a;
                self.activity.1 += 1;
            }
        }
        self.steps += 1;
        let tps = tokens / dt.max(1e-9);
        let mfu = mfu(engine, flops / dt.max(1e-9));
        // On a GPU its allocator's peak is the truth; on the CPU the ledger's.
        let measured = r.device_memory.map(|m| m.peak);
        let peak_dev =
            engine.max_across_ranks(measured.unwrap_or(r.memory.peak_device_bytes) as f64)?;
        let peak_host = engine.max_across_ranks(r.memory.peak_host_bytes as f64)?;
        timeline.record(r.step, &r.memory);
        if let Some(m) = self.file.as_mut() {
            writeln!(m, "{}", step_line(&r, tps, mfu, peak_dev, peak_host))
                .map_err(|e| io("write metrics", e))?;
        }
        self.log(engine, &r, (tps, mfu), peak_dev, dt);
        Ok(r)
    }

    fn log(
        &self,
        engine: &Engine,
        r: &StepReport,
        speed: (f64, Option<f64>),
        peak_dev: f64,
        dt: f64,
    ) {
        let (tps, mfu) = speed;
        let mfu = mfu.map_or(String::new(), |m| format!(" (MFU {:.1}%)", m * 100.0));
        let mut line = format!(
            "loss {:.4} lr {:.2e} scale {} | {:.0} tok/s{mfu} | peak {:.1} MiB/rank",
            r.loss,
            r.lr,
            r.loss_scale,
            tps,
            peak_dev / 1048576.0
        );
        if r.swap != Default::default() {
            let gb = |b: u64| b as f64 / 1e9;
            line += &format!(
                " | {dt:.1} s/step, NVMe read {:.2} GB, written {:.2} GB (rank {})",
                gb(r.swap.read_bytes),
                gb(r.swap.written_bytes),
                engine.rank()
            );
        }
        let every = engine.config().steps_per_print.max(1) as u64;
        let print_now = self.lead && r.step.is_multiple_of(every);
        match &self.bar {
            // Output that is not a terminal hides the bar: it gets the periodic lines instead.
            Some(b) if !b.is_hidden() => {
                b.set_message(line);
                b.inc(1);
            }
            _ if print_now => tracing::info!("step {} {line}", r.step),
            _ => {}
        }
        if print_now && engine.config().wall_clock_breakdown {
            let t = &r.timings;
            let ms = |s: f64| s * 1e3;
            tracing::info!(
                "step {} time (ms): forward {:.1} | backward {:.1} | reduce {:.1} | gather {:.1} | optimizer {:.1}",
                r.step, ms(t.forward), ms(t.backward), ms(t.reduce), ms(t.gather), ms(t.optimizer)
            );
        }
    }

    /// Reports a held-out loss after `step` steps.
    pub(super) fn eval(&mut self, step: u64, loss: f64) -> Result<()> {
        if !self.lead {
            return Ok(());
        }
        let line = format!("step {step} eval_loss={loss:.4}");
        match &self.bar {
            // A hidden bar (output not a terminal) prints nothing: the line goes to stdout.
            Some(b) if !b.is_hidden() => b.println(&line),
            _ => println!("{line}"),
        }
        if let Some(m) = self.file.as_mut() {
            let j = serde_json::json!({"step": step, "eval_loss": loss});
            writeln!(m, "{j}").map_err(|e| io("write metrics", e))?;
        }
        Ok(())
    }

    /// The memory chart, the benchmark line and the closing log line.
    pub(super) fn finish(
        mut self,
        engine: &Engine,
        opts: &TrainOptions,
        timeline: &Timeline,
        start: Instant,
    ) -> Result<()> {
        if let Some(b) = self.bar.take() {
            b.finish();
        }
        if let Some(m) = self.file.as_mut() {
            m.flush().map_err(|e| io("write metrics", e))?;
        }
        if let (Some(path), true) = (&opts.memory_timeline, self.lead) {
            std::fs::write(path, timeline.to_svg(Pool::Device))
                .map_err(|e| io(&format!("write {}", path.display()), e))?;
            tracing::info!("memory timeline: {}", path.display());
        }
        let peak_dev =
            engine.max_across_ranks(engine.ledger().peak_total(Location::Device) as f64)?;
        if self.lead && opts.bench_json {
            let cfg = engine.config();
            println!(
                "{}",
                serde_json::json!({
                    "bench": "ferrozero_gpt_train", "stage": cfg.zero.stage.number(), "ranks": engine.world_size(),
                    "offload_optimizer": format!("{:?}", cfg.zero.offload_optimizer.target),
                    "params": engine.model().num_params(), "steps": opts.steps,
                    "tokens_per_s": self.warm.0 / self.warm.1.max(1e-9),
                    "mfu": mfu(engine, self.warm_flops / self.warm.1.max(1e-9)),
                    "peak_device_bytes_per_rank": peak_dev as u64, "process_vmhwm_mib": vmhwm_mib(),
                    "host_syncs_per_step": per_step(self.activity, |a| a.host_syncs),
                    "kernel_launches_per_step": per_step(self.activity, |a| a.kernel_launches),
                    "gemms_per_step": per_step(self.activity, |a| a.gemms),
                    "copies_per_step": per_step(self.activity, |a| a.copies),
                    "gemm_fallbacks_per_step": per_step(self.activity, |a| a.gemm_fallbacks),
                })
            );
        }
        if self.lead {
            let secs = start.elapsed().as_secs_f64();
            tracing::info!(
                "trained {} steps in {secs:.1}s: {:.0} tokens/s over all ranks",
                opts.steps,
                self.tokens as f64 / secs
            );
        }
        Ok(())
    }
}

fn progress(steps: u64) -> ProgressBar {
    let b = ProgressBar::new(steps);
    b.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} [{elapsed}<{eta}] {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    b
}

/// Model FLOPs utilisation of `flops_per_s` (over every rank) against the peak of the
/// devices the ranks compute on: the config's or `--peak-tflops`, else the device's stated
/// figure; `None` (JSON `null`) without one, as on the CPU.
fn mfu(engine: &Engine, flops_per_s: f64) -> Option<f64> {
    let be = engine.backend();
    let peak = engine
        .config()
        .monitor
        .peak_tflops
        .or_else(|| stated_peak_tflops(&be.name(), be.act_dtype()))?;
    profiler::mfu(flops_per_s / engine.world_size() as f64, Some(peak))
}

fn step_line(r: &StepReport, tps: f64, mfu: Option<f64>, peak_dev: f64, peak_host: f64) -> String {
    let by_cat: serde_json::Map<String, serde_json::Value> = r
        .memory
        .peak_device_by_category
        .iter()
        .map(|(c, b)| (format!("{c:?}").to_lowercase(), serde_json::json!(b)))
        .collect();
    let mut line = serde_json::json!({
        "step": r.step, "loss": r.loss, "lr": r.lr, "loss_scale": r.loss_scale, "skipped": r.skipped,
        "grad_norm": if r.grad_norm.is_finite() { serde_json::json!(r.grad_norm) } else { serde_json::Value::Null },
        "tokens_per_s": tps, "mfu": mfu, "peak_device_bytes": peak_dev as u64, "peak_host_bytes": peak_host as u64,
        "peak_device_bytes_by_category": by_cat,
        "ledger_peak_device_bytes": r.memory.peak_device_bytes,
        "device_memory_limit": r.memory.device_memory_limit,
        "device_allocator": r.device_memory,
        "swap_read_bytes": r.swap.read_bytes, "swap_written_bytes": r.swap.written_bytes,
        "cross_group_bytes": r.cross_group_bytes,
        "host_syncs_per_step": r.device_activity.map(|a| a.host_syncs),
        "kernel_launches_per_step": r.device_activity.map(|a| a.kernel_launches),
        "gemms_per_step": r.device_activity.map(|a| a.gemms),
        "copies_per_step": r.device_activity.map(|a| a.copies),
        "gemm_fallbacks_per_step": r.device_activity.map(|a| a.gemm_fallbacks),
    });
    if let Some(p) = &r.flops_profile {
        line["flops_profile"] = serde_json::json!(p);
    }
    line.to_string()
}

/// The mean of one count over the warm steps; null on the CPU (no device counted anything).
fn per_step(
    (sum, steps): (DeviceActivity, u64),
    count: impl Fn(&DeviceActivity) -> u64,
) -> Option<f64> {
    (steps > 0).then(|| count(&sum) as f64 / steps as f64)
}

/// The process's peak resident set (VmHWM) in MiB; NaN where /proc is unavailable.
pub fn vmhwm_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map_or(f64::NAN, |kb| kb / 1024.0)
}
