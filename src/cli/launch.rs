//! `ferrozero launch`: starts this node's ranks of a job, torchrun-style (see
//! `ferrozero_runtime::comm::launch`).

use std::process::ExitCode;
use std::time::Duration;

use ferrozero_runtime::comm::launch::slurm::SlurmJob;
use ferrozero_runtime::comm::launch::{launch, LaunchOutcome, LaunchSpec};
use ferrozero_runtime::comm::store::{JobSecret, SECRET_VAR};

/// Arguments.
#[derive(clap::Args)]
pub struct Args {
    /// Ranks to start on this node [default: Slurm's GPUs (or tasks) per node, else the
    /// GPUs this node has (CUDA build), else 1]. Each rank's GPU is its `LOCAL_RANK`.
    #[arg(long)]
    nproc_per_node: Option<usize>,
    /// Nodes in the job [default: `SLURM_NNODES`, else 1].
    #[arg(long)]
    nnodes: Option<usize>,
    /// This node's index, 0-based [default: `SLURM_NODEID`, else 0].
    #[arg(long)]
    node_rank: Option<usize>,
    /// Host where rank 0 serves the rendezvous store [default: the first host of
    /// `SLURM_JOB_NODELIST`, else 127.0.0.1]. The store listens on this address only
    /// (`FERROZERO_STORE_BIND` names another, e.g. 0.0.0.0) and admits only ranks holding the
    /// job's secret, `FERROZERO_STORE_SECRET`: taken from the environment when set (needed,
    /// the same on every node, for a job of several nodes), else drawn afresh.
    #[arg(long)]
    master_addr: Option<String>,
    /// Port of the rendezvous store.
    #[arg(long, default_value_t = 29500)]
    master_port: u16,
    /// Seconds ranks get to exit after SIGTERM before they are killed.
    #[arg(long, default_value_t = 10)]
    grace_secs: u64,
    /// Do not pin each rank to its share of a NUMA node's cores (by default the ranks are
    /// spread over the nodes in blocks and split each node's cores; `FERROZERO_CPUS` tells a
    /// rank its cores).
    #[arg(long)]
    no_cpu_bind: bool,
    /// The program and its arguments, after `--`.
    #[arg(last = true, required = true, value_name = "PROGRAM ARGS")]
    command: Vec<String>,
}

/// The GPUs on this node, when the build has CUDA and the driver sees some.
#[cfg(feature = "cuda")]
fn gpu_count() -> Option<usize> {
    ferrozero_runtime::backend::cuda::driver::device_count()
        .ok()
        .filter(|&n| n > 0)
}

#[cfg(not(feature = "cuda"))]
fn gpu_count() -> Option<usize> {
    None
}

/// Runs the subcommand.
pub fn run(args: Args) -> ExitCode {
    let slurm = SlurmJob::from_env();
    let nproc = args
        .nproc_per_node
        .or(slurm.nproc_per_node)
        .or_else(gpu_count)
        .unwrap_or(1);
    let secret = match std::env::var(SECRET_VAR)
        .ok()
        .map(JobSecret::new)
        .transpose()
    {
        Ok(s) => s,
        Err(e) => {
            eprintln!("ferrozero launch: {e}");
            return ExitCode::from(2);
        }
    };
    let mut command = args.command.into_iter();
    let spec = LaunchSpec {
        nproc_per_node: nproc,
        nnodes: args.nnodes.or(slurm.nnodes).unwrap_or(1),
        node_rank: args.node_rank.or(slurm.node_rank).unwrap_or(0),
        master_addr: args
            .master_addr
            .or(slurm.master_addr)
            .unwrap_or_else(|| "127.0.0.1".into()),
        master_port: args.master_port,
        program: command.next().unwrap_or_default(),
        args: command.collect(),
        grace: Duration::from_secs(args.grace_secs),
        cpu_binding: !args.no_cpu_bind,
        secret,
    };
    match launch(&spec) {
        Ok(LaunchOutcome::Success) => ExitCode::SUCCESS,
        Ok(LaunchOutcome::RankFailed {
            rank,
            status,
            code,
            stopped,
            last_words,
        }) => {
            eprintln!("ferrozero launch: rank {rank} failed ({status}); stopped ranks {stopped:?}");
            match last_words.is_empty() {
                true => eprintln!("  (rank {rank} wrote nothing to stderr)"),
                false => eprintln!("  rank {rank} said:\n    {}", last_words.join("\n    ")),
            }
            ExitCode::from(code)
        }
        Ok(LaunchOutcome::Interrupted { signal }) => {
            eprintln!("ferrozero launch: interrupted by signal {signal}; forwarded to every rank");
            ExitCode::from(u8::try_from(128 + signal).unwrap_or(1))
        }
        Err(e) => {
            eprintln!("ferrozero launch: {e}");
            ExitCode::from(2)
        }
    }
}
