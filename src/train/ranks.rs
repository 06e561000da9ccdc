//! The ranks a job runs on: threads in this process, or (with `comms.backend = "nccl"`) this
//! process as one rank of a job `ferrozero launch` started.

use std::time::Duration;

use ferrozero_config::Config;
use ferrozero_runtime::comm::local::run_ranks;
use ferrozero_runtime::comm::Communicator;
use ferrozero_runtime::Result;

/// Runs `body` once per rank: `ranks` threads over the local communicator, or, when the
/// config picks NCCL, once in this process with the rank `ferrozero launch` gave it.
pub fn run_job<F>(config: &Config, ranks: usize, body: F) -> Result<()>
where
    F: Fn(Box<dyn Communicator>) -> Result<()> + Sync,
{
    if config.comms.backend == ferrozero_config::Backend::Nccl {
        return nccl_rank(config, ranks, body);
    }
    run_ranks(ranks, Duration::from_secs(600), body)?;
    Ok(())
}

#[cfg(feature = "cuda")]
fn nccl_rank<F>(config: &Config, ranks: usize, body: F) -> Result<()>
where
    F: Fn(Box<dyn Communicator>) -> Result<()> + Sync,
{
    use ferrozero_runtime::comm::nccl::{NcclComm, NcclOptions};
    if ranks != 1 {
        return Err(ferrozero_runtime::Error::Invalid(format!(
            "--ranks {ranks} with comms.backend = \"nccl\": each process is one rank; start \
             {ranks} processes with `ferrozero launch --nproc-per-node {ranks}`"
        )));
    }
    let opts = NcclOptions {
        timeout: Duration::from_secs(config.comms.timeout),
        deterministic: config.comms.reduction == ferrozero_config::Reduction::RankOrdered,
    };
    body(Box::new(NcclComm::from_env(opts)?))
}

/// Without the CUDA build there is no NCCL: the local ranks run and the engine refuses the
/// mismatch with what would work.
#[cfg(not(feature = "cuda"))]
fn nccl_rank<F>(_config: &Config, ranks: usize, body: F) -> Result<()>
where
    F: Fn(Box<dyn Communicator>) -> Result<()> + Sync,
{
    run_ranks(ranks, Duration::from_secs(600), body)?;
    Ok(())
}
