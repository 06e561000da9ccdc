//! `ferrozero bench swap`: NVMe store write and read bandwidth through the configured engine.

use std::path::PathBuf;
use std::process::ExitCode;

use ferrozero_offload::bench;
use ferrozero_offload::store::{AioSettings, EngineChoice, Overlap, Submit};

/// Engine selection.
#[derive(Clone, Copy, clap::ValueEnum)]
pub enum EngineArg {
    /// io_uring when available, else threads.
    Auto,
    /// io_uring only.
    IoUring,
    /// pread/pwrite threads.
    Threads,
}

/// Arguments.
#[derive(clap::Args)]
pub struct Args {
    /// Directory on the disk to measure (a scratch subdirectory is created and removed).
    #[arg(long)]
    path: PathBuf,
    /// Bytes per tensor.
    #[arg(long, default_value_t = 1 << 30)]
    bytes: usize,
    /// Request size (aio.block_size), a multiple of 4096.
    #[arg(long, default_value_t = 1 << 20)]
    block_size: usize,
    /// Requests in flight (aio.queue_depth).
    #[arg(long, default_value_t = 8)]
    queue_depth: usize,
    /// Lanes per tensor (aio.intra_op_parallelism).
    #[arg(long, default_value_t = 1)]
    intra_op: usize,
    /// I/O engine.
    #[arg(long, value_enum, default_value_t = EngineArg::Auto)]
    engine: EngineArg,
    /// Timed write+read rounds, after one untimed warm-up round; the median is reported.
    #[arg(long, default_value_t = 3)]
    loops: u32,
    /// One JSON object per result.
    #[arg(long)]
    json: bool,
}

/// Runs the subcommand.
pub fn run(args: Args) -> ExitCode {
    let settings = AioSettings {
        block_size: args.block_size,
        queue_depth: args.queue_depth,
        intra_op_parallelism: args.intra_op,
        submit: Submit::Batched,
        overlap: Overlap::Overlapped,
        engine: match args.engine {
            EngineArg::Auto => EngineChoice::Auto,
            EngineArg::IoUring => EngineChoice::IoUring,
            EngineArg::Threads => EngineChoice::Threads,
        },
    };
    let results = match bench::swap(&args.path, args.bytes, &settings, args.loops) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    for r in results {
        if args.json {
            let obj = serde_json::json!({
                "bench": "ferrozero_swap", "op": r.op.name(), "bytes": r.bytes, "gbps": r.gbps,
                "best_gbps": r.best_gbps, "warmup_gbps": r.warmup_gbps, "engine": r.engine.name(), "direct": r.direct,
                "block_size": settings.block_size, "queue_depth": settings.queue_depth,
                "intra_op": settings.intra_op_parallelism,
            });
            println!("{obj}");
        } else {
            println!(
                "{:5} {} bytes: {:.2} GB/s median, {:.2} best, {:.2} warm-up ({}, {})",
                r.op.name(),
                r.bytes,
                r.gbps,
                r.best_gbps,
                r.warmup_gbps,
                r.engine.name(),
                if r.direct { "O_DIRECT" } else { "buffered" }
            );
        }
    }
    ExitCode::SUCCESS
}
