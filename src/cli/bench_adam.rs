//! `ferrozero bench adam`: CPU AdamW step throughput over one flat buffer.

use std::process::ExitCode;

use ferrozero_offload::bench::{self, AdamDtype};

/// The parameter copy written besides the f32 master.
#[derive(Clone, Copy, clap::ValueEnum)]
pub enum Dtype {
    /// f32 master only (28 bytes per parameter).
    F32,
    /// f32 master and a fused bf16 copy (30 bytes per parameter).
    Bf16,
}

/// Arguments.
#[derive(clap::Args)]
pub struct Args {
    /// Parameters per step.
    #[arg(long, default_value_t = 100_000_000)]
    params: usize,
    /// Worker threads (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Parameter copy to write.
    #[arg(long, value_enum, default_value_t = Dtype::F32)]
    dtype: Dtype,
    /// Timed steps (after three warm-up steps); the median is reported.
    #[arg(long, default_value_t = 10)]
    steps: u32,
    /// One JSON object per result.
    #[arg(long)]
    json: bool,
}

/// Runs the subcommand.
pub fn run(args: Args) -> ExitCode {
    let threads = super::threads_or_all(args.threads);
    let dtype = match args.dtype {
        Dtype::F32 => AdamDtype::F32,
        Dtype::Bf16 => AdamDtype::Bf16,
    };
    let r = match bench::adam(args.params, threads, dtype, args.steps) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let gbps = r.params_per_s * f64::from(r.bytes_per_param) / 1e9;
    if args.json {
        let dtype = match dtype {
            AdamDtype::F32 => "f32",
            AdamDtype::Bf16 => "bf16",
        };
        let obj = serde_json::json!({
            "bench": "ferrozero_adam", "params": r.params, "threads": r.threads, "dtype": dtype,
            "steps": r.steps, "params_per_s": r.params_per_s,
            "best_params_per_s": r.best_params_per_s, "bytes_per_param": r.bytes_per_param,
            "gbps": gbps,
        });
        println!("{obj}");
    } else {
        println!(
            "adamw {} params, {} threads: {:.3} Gparam/s median, {:.3} best ({:.1} GB/s at {} B/param)",
            r.params, r.threads, r.params_per_s / 1e9, r.best_params_per_s / 1e9, gbps, r.bytes_per_param
        );
    }
    ExitCode::SUCCESS
}
