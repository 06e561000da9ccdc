//! `ferrozero bench grad`: the engine's per-step passes over the whole gradient (accumulate a
//! micro-step into it, the sum of squares that is both the overflow check and the norm, and
//! zeroing it), on the CPU storage the engine uses.

use std::process::ExitCode;
use std::time::Instant;

use ferrozero_runtime::tensor::{DType, FlatBuf};

/// Arguments.
#[derive(clap::Args)]
pub struct Args {
    /// Gradient elements (f32).
    #[arg(long, default_value_t = 12_269_568)]
    elems: usize,
    /// Worker threads (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Timed repetitions of each pass (after one warm-up); the median is reported.
    #[arg(long, default_value_t = 20)]
    reps: usize,
    /// One JSON object per pass.
    #[arg(long)]
    json: bool,
}

/// Runs the subcommand.
pub fn run(args: Args) -> ExitCode {
    let threads = super::threads_or_all(args.threads);
    let pool = match rayon::ThreadPoolBuilder::new().num_threads(threads).build() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("error: thread pool: {e}");
            return ExitCode::from(2);
        }
    };
    let n = args.elems;
    let src = FlatBuf::F32((0..n).map(|i| (i % 1013) as f32 * 1e-3).collect());
    let mut grad = FlatBuf::zeros(DType::F32, n);
    let mut scratch = Vec::new();
    // (name, bytes moved per pass, median seconds)
    let mut rows: Vec<(&str, usize, f64)> = Vec::new();
    pool.install(|| {
        let accumulate = median(args.reps, || grad.accumulate(0, &src, n, &mut scratch));
        rows.push(("accumulate", 12 * n, accumulate));
        let mut sink = 0.0;
        let sumsq = median(args.reps, || sink += grad.sum_squares(0..n));
        std::hint::black_box(sink);
        rows.push(("sum_squares", 4 * n, sumsq));
        rows.push(("fill_zero", 4 * n, median(args.reps, || grad.fill_zero())));
    });
    for (pass, bytes, s) in rows {
        let gbps = bytes as f64 / s / 1e9;
        if args.json {
            let obj = serde_json::json!({"bench": "ferrozero_grad", "pass": pass, "elems": n,
                "threads": threads, "ms": s * 1e3, "gbps": gbps});
            println!("{obj}");
        } else {
            println!(
                "{pass:<12} {n} f32, {threads} threads: {:.2} ms median ({gbps:.1} GB/s)",
                s * 1e3
            );
        }
    }
    ExitCode::SUCCESS
}

/// Median wall time of `reps` calls of `f`, after one untimed call.
fn median(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut t: Vec<f64> = (0..reps.max(1))
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}
