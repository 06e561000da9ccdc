//! `ferrozero bench comm`: collective bandwidth, nccl-tests style, on the `local` backend
//! (ranks as threads) or over MPI (run under `mpirun`, builds with the `mpi` feature).

use std::process::ExitCode;
use std::time::Duration;

use ferrozero_config::resolved::{CommBackend, CommReduction, CommsConfig};
use ferrozero_runtime::comm;
use ferrozero_runtime::comm::bench::{self, BenchOp, BenchRow};

/// Communicator backend to measure.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum Backend {
    /// Ranks as threads of this process.
    Local,
    /// One rank per MPI process (start with `mpirun -n N ferrozero bench comm --backend mpi`).
    Mpi,
    /// One rank per GPU over NCCL (start with `ferrozero launch -- ferrozero bench comm
    /// --backend nccl`; CUDA build). Compare busbw with nccl-tests' `all_reduce_perf -g 1`;
    /// host buffers are staged through the GPU, so the figures include the PCIe copies.
    Nccl,
}

/// How the MPI and NCCL backends form sums (see `comms.reduction`).
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum ReductionArg {
    /// The library's own reductions for f32 sums (the default).
    Native,
    /// Rank-ordered sums, bitwise equal to the local backend.
    RankOrdered,
}

/// Arguments.
#[derive(clap::Args)]
pub struct Args {
    /// Ranks (local backend; MPI takes the world size from mpirun).
    #[arg(long, default_value_t = 2)]
    ranks: usize,
    /// Backend.
    #[arg(long, value_enum, default_value_t = Backend::Local)]
    backend: Backend,
    /// One JSON object per row instead of a table.
    #[arg(long)]
    json: bool,
    /// Smallest size (bytes; K, M, G suffixes are powers of 1024).
    #[arg(long, default_value = "1K", value_parser = parse_size)]
    min_bytes: usize,
    /// Largest size.
    #[arg(long, default_value = "256M", value_parser = parse_size)]
    max_bytes: usize,
    /// Seconds before a stuck collective is reported.
    #[arg(long, default_value_t = 300)]
    timeout_secs: u64,
    /// How the MPI backend forms sums (the local backend always sums in rank order).
    #[arg(long, value_enum, default_value_t = ReductionArg::Native)]
    reduction: ReductionArg,
    /// Collectives to measure (default: all).
    #[arg(long, value_delimiter = ',')]
    ops: Vec<OpArg>,
}

/// A collective to measure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum OpArg {
    /// all_reduce.
    AllReduce,
    /// reduce_scatter.
    ReduceScatter,
    /// all_gather.
    AllGather,
    /// broadcast.
    Broadcast,
}

impl OpArg {
    fn op(self) -> BenchOp {
        match self {
            OpArg::AllReduce => BenchOp::AllReduce,
            OpArg::ReduceScatter => BenchOp::ReduceScatter,
            OpArg::AllGather => BenchOp::AllGather,
            OpArg::Broadcast => BenchOp::Broadcast,
        }
    }
}

/// Parses `4096`, `4K`, `64M`, `1G`.
fn parse_size(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let (num, mult) = match t.char_indices().last() {
        Some((i, 'K' | 'k')) => (&t[..i], 1usize << 10),
        Some((i, 'M' | 'm')) => (&t[..i], 1 << 20),
        Some((i, 'G' | 'g')) => (&t[..i], 1 << 30),
        _ => (t, 1),
    };
    let n: usize = num
        .parse()
        .map_err(|_| format!("{s:?} is not a size (e.g. 4096, 64K, 256M)"))?;
    n.checked_mul(mult)
        .filter(|v| *v > 0)
        .ok_or_else(|| format!("{s:?} is not a positive size that fits in memory"))
}

/// Runs the subcommand.
pub fn run(args: Args) -> ExitCode {
    if args.min_bytes > args.max_bytes {
        eprintln!("error: --min-bytes is larger than --max-bytes");
        return ExitCode::from(2);
    }
    let sizes = bench::sizes(args.min_bytes, args.max_bytes);
    let timeout = Duration::from_secs(args.timeout_secs);
    let ops: Vec<BenchOp> = if args.ops.is_empty() {
        BenchOp::ALL.to_vec()
    } else {
        args.ops.iter().map(|o| o.op()).collect()
    };
    let comms = CommsConfig {
        backend: match args.backend {
            Backend::Local => CommBackend::Local,
            Backend::Mpi => CommBackend::Mpi,
            Backend::Nccl => CommBackend::Nccl,
        },
        timeout,
        reduction: match args.reduction {
            ReductionArg::Native => CommReduction::Native,
            ReductionArg::RankOrdered => CommReduction::RankOrdered,
        },
        data_type: None,
    };
    // `--ranks` counts threads of the local backend; the others take the launcher's world.
    let ranks = matches!(args.backend, Backend::Local).then_some(args.ranks);
    let result = bench(&comms, ranks, &ops, &sizes);
    match result {
        Ok(Some(rows)) => {
            print(&rows, args.json);
            ExitCode::SUCCESS
        }
        Ok(None) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
    }
}

/// Runs on every rank of this process; only rank 0's rows come back to print.
fn bench(
    comms: &CommsConfig,
    ranks: Option<usize>,
    ops: &[BenchOp],
    sizes: &[usize],
) -> ferrozero_runtime::Result<Option<Vec<BenchRow>>> {
    let rows = comm::open(comms, ranks, |c| {
        let rows = bench::run(&*c, ops, sizes)?;
        Ok((c.rank() == 0).then_some(rows))
    })?;
    Ok(rows.into_iter().flatten().next())
}

fn print(rows: &[BenchRow], json: bool) {
    if json {
        for r in rows {
            // Serializing plain numbers and a unit enum cannot fail.
            println!("{}", serde_json::to_string(r).unwrap_or_default());
        }
        return;
    }
    if let Some(r) = rows.first() {
        println!("# ferrozero bench comm: {} ranks, f32, sum", r.ranks);
    }
    println!(
        "#{:>15} {:>12} {:>12} {:>9} {:>9}",
        "op", "size", "time", "algbw", "busbw"
    );
    println!(
        "#{:>15} {:>12} {:>12} {:>9} {:>9}",
        "", "(B)", "(us)", "(GB/s)", "(GB/s)"
    );
    for r in rows {
        println!(
            "{:>16} {:>12} {:>12.1} {:>9.2} {:>9.2}",
            r.op.name(),
            r.bytes,
            r.time_us,
            r.algbw_gbps,
            r.busbw_gbps
        );
    }
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes_parse_with_binary_suffixes_and_reject_garbage() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("1K"), Ok(1024));
        assert_eq!(parse_size("256M"), Ok(256 << 20));
        assert_eq!(parse_size("2g"), Ok(2 << 30));
        for bad in ["", "0", "K", "1X", "-1", "99999999999999999999G"] {
            assert!(parse_size(bad).is_err(), "{bad:?}");
        }
    }
}
