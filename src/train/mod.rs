//! The training loop behind `ferrozero train` and the `train_gpt` example: steps over packed
//! rows, a held-out loss every N steps, metrics, checkpoints, and the ranks that run it.

mod hf;
mod metrics;
pub mod model;
mod ranks;
mod tuning;

use std::path::PathBuf;
use std::time::Instant;

use crate::data::Rows;
use crate::engine::Engine;
use ferrozero_runtime::engine::timeline::Timeline;
use ferrozero_runtime::nn::Batch;
use ferrozero_runtime::Result;

pub use hf::{load_model, write_output, ModelDir};
pub use metrics::vmhwm_mib;
pub use ranks::run_job;
pub use tuning::Tuning;

/// What a training run does besides stepping.
#[derive(Debug, Clone, Default)]
pub struct TrainOptions {
    /// The last step (exclusive): the run goes from its first step up to this one.
    pub steps: u64,
    /// A progress bar on rank 0 (else a log line every `steps_per_print` steps).
    pub progress: bool,
    /// One JSON object per step (and per evaluation) here, from rank 0.
    pub metrics: Option<PathBuf>,
    /// A chart of device memory by category per step (SVG) here at the end.
    pub memory_timeline: Option<PathBuf>,
    /// Checkpoint into this directory at the end.
    pub save: Option<PathBuf>,
    /// Also checkpoint every N steps (with `save`).
    pub save_every: Option<u64>,
    /// Held-out loss every N steps (and at the end) when there are held-out rows.
    pub eval_every: Option<u64>,
    /// At most this many held-out rows per evaluation.
    pub eval_rows: usize,
    /// Print one JSON line at the end for benchmarks.
    pub bench_json: bool,
}

/// What a run measured.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TrainSummary {
    /// Training loss of each step run, in order.
    pub losses: Vec<f64>,
    /// `(step, held-out loss)` of each evaluation.
    pub evals: Vec<(u64, f64)>,
}

/// A positive TFLOP/s figure for `--peak-tflops`.
pub fn parse_peak_tflops(s: &str) -> std::result::Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err(format!(
            "expected a positive number of TFLOP/s (e.g. 989 for an H100's bf16), found `{s}`"
        )),
    }
}

/// Row numbers: steps, then accumulation micro-steps, then ranks, then the micro-batch.
pub fn micro_batches(engine: &Engine, rows: &dyn Rows, step: u64) -> Vec<Batch> {
    let cfg = engine.config();
    let (gas, world, mb) = (
        cfg.gradient_accumulation_steps as u64,
        engine.world_size() as u64,
        cfg.train_micro_batch_size_per_gpu,
    );
    (0..gas)
        .map(|m| {
            rows.batch(
                ((step * gas + m) * world + engine.rank() as u64) * mb as u64,
                mb,
            )
        })
        .collect()
}

/// Optimizer steps that visit every row of `rows` `epochs` times (the last step may wrap).
pub fn steps_for_epochs(engine: &Engine, rows: &dyn Rows, epochs: u64) -> u64 {
    let cfg = engine.config();
    let per_step = (cfg.gradient_accumulation_steps * cfg.train_micro_batch_size_per_gpu) as u64
        * engine.world_size() as u64;
    epochs.saturating_mul(rows.len()).div_ceil(per_step.max(1))
}

/// Trains from step `first` up to `opts.steps` (collective: every rank calls it), evaluating
/// `eval` every `opts.eval_every` steps and at the end.
pub fn train(
    engine: &mut Engine,
    opts: &TrainOptions,
    rows: &dyn Rows,
    eval: Option<&dyn Rows>,
    first: u64,
) -> Result<TrainSummary> {
    let lead = engine.rank() == 0;
    let mut out = metrics::Writer::new(engine, opts)?;
    let mut summary = TrainSummary::default();
    let mut timeline = Timeline::new();
    let start = Instant::now();
    for step in first..opts.steps {
        let batches = micro_batches(engine, rows, step);
        let r = out.step(engine, &batches, &mut timeline)?;
        summary.losses.push(r.loss);
        let done = step + 1;
        let eval_now = opts.eval_every.is_some_and(|n| n > 0 && done % n == 0);
        if let Some(e) = eval.filter(|_| eval_now || done == opts.steps) {
            let loss = evaluate_loss(engine, e, opts.eval_rows)?;
            out.eval(done, loss)?;
            summary.evals.push((done, loss));
        }
        if let Some(dir) = &opts.save {
            if done == opts.steps || opts.save_every.is_some_and(|n| n > 0 && done % n == 0) {
                let path = engine.save_checkpoint(dir, &format!("step-{done}"), done)?;
                if lead {
                    tracing::info!("checkpoint {}", path.display());
                }
            }
        }
    }
    if first >= opts.steps {
        if let Some(e) = eval {
            let loss = evaluate_loss(engine, e, opts.eval_rows)?;
            out.eval(first, loss)?;
            summary.evals.push((first, loss));
        }
    }
    out.finish(engine, opts, &timeline, start)?;
    Ok(summary)
}

/// Mean loss per target token over up to `max_rows` rows of `rows`, split evenly across ranks
/// (collective). Every rank evaluates as many micro-batches, so stage 3's gathers pair up.
pub fn evaluate_loss(engine: &mut Engine, rows: &dyn Rows, max_rows: usize) -> Result<f64> {
    let (world, rank) = (engine.world_size() as u64, engine.rank() as u64);
    let n = rows.len().min(max_rows.max(1) as u64);
    let per_rank = (n / world).max(1);
    let mb = engine.config().train_micro_batch_size_per_gpu as u64;
    let (mut loss, mut tokens) = (0.0, 0.0);
    let mut first = rank * per_rank;
    let end = first + per_rank;
    while first < end {
        let k = mb.min(end - first);
        let e = engine.evaluate(&rows.batch(first, k as usize))?;
        loss += e.loss_sum;
        tokens += e.tokens as f64;
        first += k;
    }
    let (loss, tokens) = (
        engine.sum_across_ranks(loss)?,
        engine.sum_across_ranks(tokens)?,
    );
    Ok(loss / tokens.max(1.0))
}
