//! `ferrozero bench comm`: collective bandwidth, nccl-tests style, on the `local` backend
//! (ranks as threads) or over MPI (run under `mpirun`, builds with the `mpi` feature).

use std::process::ExitCode;
use std::time::Duration;

use ferrozero_runtime::comm::bench::{self, BenchOp, BenchRow};
use ferrozero_runtime::comm::local::run_ranks;

/// Communicator backend to measure.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum Backend {
    /// Ranks as threads of this process.
    Local,
    /// One rank per MPI process (start with `mpirun -n N ferrozero bench comm --backend mpi`).
    Mpi,
    /// One rank per GPU over NCCL (start with `ferrozero launch -- ferrozero bench comm
    /// --backend nccl`; CUDA build). Compare busbw with nccl-tests' `all_reduce_perf -g 1`.
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
    let result = match args.backend {
        Backend::Local => local(args.ranks, timeout, &ops, &sizes),
        Backend::Mpi => mpi(timeout, args.reduction, &ops, &sizes),
        Backend::Nccl => nccl(timeout, args.reduction, &ops, &sizes),
    };
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

fn local(
    ranks: usize,
    timeout: Duration,
    ops: &[BenchOp],
    sizes: &[usize],
) -> ferrozero_runtime::Result<Option<Vec<BenchRow>>> {
    let mut all = run_ranks(ranks, timeout, |c| bench::run(&*c, ops, sizes))?;
    Ok(Some(all.swap_remove(0)))
}

/// Runs on every MPI process; only rank 0 returns rows to print.
#[cfg(feature = "mpi")]
fn mpi(
    timeout: Duration,
    reduction: ReductionArg,
    ops: &[BenchOp],
    sizes: &[usize],
) -> ferrozero_runtime::Result<Option<Vec<BenchRow>>> {
    use ferrozero_runtime::comm::mpi::MpiComm;
    use ferrozero_runtime::comm::{Communicator, Reduction};
    let reduction = match reduction {
        ReductionArg::Native => Reduction::Native,
        ReductionArg::RankOrdered => Reduction::RankOrdered,
    };
    let comm = MpiComm::world(timeout)?.with_reduction(reduction);
    let rows = bench::run(&comm, ops, sizes)?;
    Ok((comm.rank() == 0).then_some(rows))
}

#[cfg(not(feature = "mpi"))]
fn mpi(
    _timeout: Duration,
    _reduction: ReductionArg,
    _ops: &[BenchOp],
    _sizes: &[usize],
) -> ferrozero_runtime::Result<Option<Vec<BenchRow>>> {
    Err(ferrozero_runtime::Error::Unavailable {
        what: "the MPI backend",
        why: "this ferrozero was built without the `mpi` feature (cargo build --features mpi)"
            .into(),
    })
}

/// Runs on every launched process; only rank 0 returns rows to print. Host buffers are
/// staged through the GPU today, so these figures include the PCIe copies.
#[cfg(feature = "cuda")]
fn nccl(
    timeout: Duration,
    reduction: ReductionArg,
    ops: &[BenchOp],
    sizes: &[usize],
) -> ferrozero_runtime::Result<Option<Vec<BenchRow>>> {
    use ferrozero_runtime::comm::nccl::{NcclComm, NcclOptions};
    use ferrozero_runtime::comm::Communicator;
    let opts = NcclOptions {
        timeout,
        deterministic: matches!(reduction, ReductionArg::RankOrdered),
    };
    let comm = NcclComm::from_env(opts)?;
    let rows = bench::run(&comm, ops, sizes)?;
    Ok((comm.rank() == 0).then_some(rows))
}

#[cfg(not(feature = "cuda"))]
fn nccl(
    _timeout: Duration,
    _reduction: ReductionArg,
    _ops: &[BenchOp],
    _sizes: &[usize],
) -> ferrozero_runtime::Result<Option<Vec<BenchRow>>> {
    Err(ferrozero_runtime::Error::Unavailable {
        what: "the NCCL backend",
        why: "this ferrozero was built without the `cuda` feature (cargo build --features cuda)"
            .into(),
    })
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
