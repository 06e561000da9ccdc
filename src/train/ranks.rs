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
    check_not_launched(std::env::var("WORLD_SIZE").ok().as_deref())?;
    run_ranks(ranks, Duration::from_secs(600), body)?;
    Ok(())
}

/// Local ranks in a process that `ferrozero launch` started as one of several would train
/// alone, each process its own job writing the same outputs: refused, with what would work.
fn check_not_launched(world_size: Option<&str>) -> Result<()> {
    match world_size.and_then(|w| w.parse::<usize>().ok()) {
        Some(w) if w > 1 => Err(ferrozero_runtime::Error::Config(format!(
            "this process is one of {w} ranks (WORLD_SIZE={w}, as `ferrozero launch` sets it) \
             but comms.backend is \"local\" (ranks as threads): set comms.backend = \"nccl\" \
             for one rank per process, or run without the launcher and use --ranks"
        ))),
        _ => Ok(()),
    }
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

#[cfg(test)]
mod tests {
    use super::check_not_launched;

    #[test]
    fn local_ranks_under_a_launched_world_are_refused() {
        assert!(check_not_launched(None).is_ok());
        assert!(check_not_launched(Some("1")).is_ok());
        let e = check_not_launched(Some("4")).unwrap_err().to_string();
        assert!(e.contains("one of 4 ranks (WORLD_SIZE=4"), "{e}");
        assert!(e.contains("comms.backend = \"nccl\""), "{e}");
    }
}
