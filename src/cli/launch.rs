//! `ferrozero launch`: starts this node's ranks of a job, torchrun-style (see
//! `ferrozero_runtime::comm::launch`).

use std::process::ExitCode;
use std::time::Duration;

use ferrozero_runtime::comm::launch::{launch, LaunchOutcome, LaunchSpec};

/// Arguments.
#[derive(clap::Args)]
pub struct Args {
    /// Ranks to start on this node.
    #[arg(long, default_value_t = 1)]
    nproc_per_node: usize,
    /// Nodes in the job.
    #[arg(long, default_value_t = 1)]
    nnodes: usize,
    /// This node's index, 0-based.
    #[arg(long, default_value_t = 0)]
    node_rank: usize,
    /// Host where rank 0 serves the rendezvous store.
    #[arg(long, default_value = "127.0.0.1")]
    master_addr: String,
    /// Port of the rendezvous store.
    #[arg(long, default_value_t = 29500)]
    master_port: u16,
    /// Seconds ranks get to exit after SIGTERM before they are killed.
    #[arg(long, default_value_t = 10)]
    grace_secs: u64,
    /// The program and its arguments, after `--`.
    #[arg(last = true, required = true, value_name = "PROGRAM ARGS")]
    command: Vec<String>,
}

/// Runs the subcommand.
pub fn run(args: Args) -> ExitCode {
    let mut command = args.command.into_iter();
    let spec = LaunchSpec {
        nproc_per_node: args.nproc_per_node,
        nnodes: args.nnodes,
        node_rank: args.node_rank,
        master_addr: args.master_addr,
        master_port: args.master_port,
        program: command.next().unwrap_or_default(),
        args: command.collect(),
        grace: Duration::from_secs(args.grace_secs),
    };
    match launch(&spec) {
        Ok(LaunchOutcome::Success) => ExitCode::SUCCESS,
        Ok(LaunchOutcome::RankFailed {
            rank,
            status,
            code,
            stopped,
        }) => {
            eprintln!("ferrozero launch: rank {rank} failed ({status}); stopped ranks {stopped:?}");
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
