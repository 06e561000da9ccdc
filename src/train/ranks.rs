//! The ranks a job runs on: threads in this process, or (with `comms.backend = "nccl"` or
//! `"mpi"`) this process as one rank of a job `ferrozero launch` or `mpirun` started.

use ferrozero_config::Config;
use ferrozero_runtime::comm::{self, Communicator};
use ferrozero_runtime::Result;

/// Runs `body` once per rank of the communicator the config's `comms` section names
/// ([`comm::open`]): `ranks` threads over the local communicator, or once in this process
/// with the rank the launcher gave it.
pub fn run_job<F>(config: &Config, ranks: usize, body: F) -> Result<()>
where
    F: Fn(Box<dyn Communicator>) -> Result<()> + Sync,
{
    comm::open(&config.resolve_comms(), Some(ranks), body)?;
    Ok(())
}
