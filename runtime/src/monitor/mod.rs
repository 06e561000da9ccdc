//! DeepSpeed's monitors (`tensorboard`, `csv_monitor`): each optimizer step's scalars, under
//! DeepSpeed's names and indexed as DeepSpeed indexes them (samples seen after the step),
//! written by a background thread into `output_path/job_name/`.
//!
//! Scalars: `Train/Samples/train_loss`, `Train/Samples/lr`, `Train/Samples/loss_scale`
//! (fp16 only, as in DeepSpeed), and ferrozero's own `Train/Samples/grad_norm`,
//! `Train/Samples/tokens_per_second` and the memory ledger's peaks,
//! `Train/Samples/peak_<location>_<category>_bytes`; at `flops_profiler.profile_step` the
//! profile's `Train/Samples/profile_tflops_per_second` and per kernel family
//! `Train/Samples/profile_<family>_ms`.

mod sinks;
pub mod tfevents;
mod writer;

use std::time::{Instant, SystemTime, UNIX_EPOCH};

use ferrozero_config::resolved::{MonitorOutput, Precision, ResolvedConfig};

use crate::report::StepReport;
use crate::Result;
use sinks::Sink;
use writer::Writer;

/// The monitors of one rank: what it writes and the writer thread that writes it.
pub struct Monitor {
    writer: Writer,
    samples_per_step: u64,
    fp16: bool,
    last: Instant,
}

impl Monitor {
    /// Opens the enabled monitors for `rank` (creating their directories): `None` when none
    /// is enabled or this rank does not write (only rank 0 writes unless `all_ranks`).
    pub fn open(cfg: &ResolvedConfig, rank: usize) -> Result<Option<Monitor>> {
        let m = &cfg.monitor;
        let dir = |o: &Option<MonitorOutput>| {
            o.as_ref().and_then(|o| match (o.all_ranks, rank) {
                (true, r) => Some(o.dir.join(format!("rank{r}"))),
                (false, 0) => Some(o.dir.clone()),
                (false, _) => None,
            })
        };
        let now = wall_time();
        let mut sinks: Vec<Box<dyn Sink>> = Vec::new();
        if let Some(d) = dir(&m.tensorboard) {
            sinks.push(Box::new(sinks::TensorBoard::create(&d, now)?));
        }
        if let Some(d) = dir(&m.csv_monitor) {
            sinks.push(Box::new(sinks::Csv::create(&d)?));
        }
        if sinks.is_empty() {
            return Ok(None);
        }
        Ok(Some(Monitor {
            writer: Writer::spawn(sinks)?,
            samples_per_step: cfg.train_batch_size as u64,
            fp16: matches!(cfg.precision, Precision::Fp16(_)),
            last: Instant::now(),
        }))
    }

    /// Hands one step's scalars to the writer thread; reports an earlier write's failure.
    pub fn record(&mut self, report: &StepReport) -> Result<()> {
        let seconds = std::mem::replace(&mut self.last, Instant::now())
            .elapsed()
            .as_secs_f64();
        let step = report.step * self.samples_per_step;
        self.writer
            .write(step, wall_time(), self.scalars(report, seconds))
    }

    /// Asks the writer to push its buffers to the files (without waiting for the disk).
    pub fn flush(&self) {
        self.writer.flush();
    }

    fn scalars(&self, r: &StepReport, seconds: f64) -> Vec<(String, f64)> {
        let s = |name: &str, v: f64| (format!("Train/Samples/{name}"), v);
        let mut out = vec![s("train_loss", r.loss), s("lr", r.lr)];
        if self.fp16 {
            out.push(s("loss_scale", r.loss_scale));
        }
        out.push(s("grad_norm", r.grad_norm));
        if seconds > 0.0 {
            out.push(s("tokens_per_second", r.tokens as f64 / seconds));
        }
        let peaks = [
            ("device", &r.memory.peak_device_by_category),
            ("host", &r.memory.peak_host_by_category),
        ];
        for (place, by_cat) in peaks {
            for &(c, bytes) in by_cat.iter() {
                out.push(s(&format!("peak_{place}_{}_bytes", c.name()), bytes as f64));
            }
        }
        if let Some(p) = &r.flops_profile {
            out.push(s("profile_tflops_per_second", p.tflops_per_s));
            for f in &p.families {
                out.push(s(
                    &format!("profile_{}_ms", f.family.name()),
                    f.seconds * 1e3,
                ));
            }
        }
        out
    }
}

fn wall_time() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}
