//! The torchrun-style launcher behind `ferrozero launch`: starts this node's ranks with the
//! rendezvous environment, prefixes their output with `[rank N]`, forwards SIGINT/SIGTERM,
//! and stops every rank as soon as one fails. The ranks get the job's store secret in
//! `FERROZERO_STORE_SECRET` (the store admits no one else). Each rank is bound to cores of a NUMA node
//! unless `cpu_binding` is off (`affinity.rs`).

pub mod affinity;
mod output;
mod signals;
pub mod slurm;

use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::comm::store::{JobSecret, SECRET_VAR};
use crate::{Error, Result};

/// What to launch.
#[derive(Debug, Clone)]
pub struct LaunchSpec {
    /// Ranks started on this node.
    pub nproc_per_node: usize,
    /// Nodes in the job.
    pub nnodes: usize,
    /// This node's index, `0..nnodes`.
    pub node_rank: usize,
    /// Host of rank 0's rendezvous store.
    pub master_addr: String,
    /// Port of rank 0's rendezvous store.
    pub master_port: u16,
    /// The program every rank runs.
    pub program: String,
    /// Its arguments.
    pub args: Vec<String>,
    /// How long ranks get to exit after SIGTERM before they are killed.
    pub grace: Duration,
    /// Pins each rank to its share of a NUMA node's cores (see [`affinity`]).
    pub cpu_binding: bool,
    /// The job's rendezvous store secret, handed to every rank; `None` draws a fresh one,
    /// which only a job of one node may (see [`JobSecret::for_launch`]).
    pub secret: Option<JobSecret>,
}

/// How a launch ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LaunchOutcome {
    /// Every rank exited with status 0.
    Success,
    /// A rank failed first; the others were stopped.
    RankFailed {
        /// Global rank of the first failure.
        rank: usize,
        /// Its exit status, as the OS describes it.
        status: String,
        /// Exit code for the launcher: the rank's own code, or 128 + signal.
        code: u8,
        /// Ranks that were still running and had to be stopped.
        stopped: Vec<usize>,
        /// The failing rank's last stderr lines (its error, or its panic's message), so the
        /// verdict says why and not only who.
        last_words: Vec<String>,
    },
    /// The launcher received a signal, forwarded it, and the ranks exited.
    Interrupted {
        /// The signal number.
        signal: i32,
    },
}

impl LaunchSpec {
    /// Checks the arguments before anything starts.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Invalid(m));
        if self.nproc_per_node == 0 {
            return bad("--nproc-per-node must be at least 1".into());
        }
        if self.nnodes == 0 {
            return bad("--nnodes must be at least 1".into());
        }
        if self.node_rank >= self.nnodes {
            return bad(format!(
                "--node-rank {} is not below --nnodes {}",
                self.node_rank, self.nnodes
            ));
        }
        if self.nnodes.checked_mul(self.nproc_per_node).is_none() {
            return bad("world size overflows".into());
        }
        if self.program.is_empty() {
            return bad(
                "no program given (usage: ferrozero launch [OPTIONS] -- PROGRAM ARGS)".into(),
            );
        }
        Ok(())
    }

    /// Global rank of local rank `local`.
    fn global_rank(&self, local: usize) -> usize {
        self.node_rank * self.nproc_per_node + local
    }

    /// Each local rank's cores, when binding is on.
    fn cores(&self) -> Result<Option<Vec<Vec<usize>>>> {
        if !self.cpu_binding {
            return Ok(None);
        }
        let nodes = affinity::numa_nodes(std::path::Path::new(affinity::NODE_ROOT))?;
        let allowed = affinity::allowed_cpus()?;
        Ok(Some(affinity::plan(&nodes, &allowed, self.nproc_per_node)))
    }

    fn command(&self, local: usize, cores: Option<&[usize]>, secret: &JobSecret) -> Command {
        let mut c = Command::new(&self.program);
        if let Some(cores) = cores {
            use std::os::unix::process::CommandExt;
            let set = affinity::cpu_set(cores);
            c.env("FERROZERO_CPUS", affinity::format_cpu_list(cores));
            // SAFETY: the closure only makes one system call (no allocation, no lock), which
            // is what may run between fork and exec.
            unsafe {
                c.pre_exec(move || {
                    let size = std::mem::size_of::<libc::cpu_set_t>();
                    match libc::sched_setaffinity(0, size, &set) {
                        0 => Ok(()),
                        _ => Err(std::io::Error::last_os_error()),
                    }
                })
            };
        }
        c.args(&self.args)
            .env("RANK", self.global_rank(local).to_string())
            .env("LOCAL_RANK", local.to_string())
            .env(
                "WORLD_SIZE",
                (self.nnodes * self.nproc_per_node).to_string(),
            )
            .env("LOCAL_WORLD_SIZE", self.nproc_per_node.to_string())
            .env("GROUP_RANK", self.node_rank.to_string())
            .env("MASTER_ADDR", &self.master_addr)
            .env("MASTER_PORT", self.master_port.to_string())
            .env(SECRET_VAR, secret.as_env_value())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c
    }
}

/// Runs the job to completion and says how it ended.
pub fn launch(spec: &LaunchSpec) -> Result<LaunchOutcome> {
    spec.validate()?;
    let secret = match &spec.secret {
        Some(s) => s.clone(),
        None => JobSecret::for_launch(spec.nnodes, |_| None)?,
    };
    let cores = spec.cores()?;
    if let Some(cores) = &cores {
        let list: Vec<String> = cores
            .iter()
            .enumerate()
            .map(|(l, c)| {
                format!(
                    "rank {} on CPUs {}",
                    spec.global_rank(l),
                    affinity::format_cpu_list(c)
                )
            })
            .collect();
        eprintln!(
            "ferrozero launch: {} (--no-cpu-bind to turn off)",
            list.join(", ")
        );
    }
    signals::install();
    let mut ranks: Vec<(usize, Child)> = Vec::with_capacity(spec.nproc_per_node);
    let mut pumps = Vec::new();
    let mut tails = Vec::new();
    for local in 0..spec.nproc_per_node {
        let rank = spec.global_rank(local);
        let mine = cores.as_ref().map(|c| c[local].as_slice());
        let mut child = match spec.command(local, mine, &secret).spawn() {
            Ok(c) => c,
            Err(source) => {
                stop(&mut ranks, spec.grace);
                return Err(Error::Io {
                    context: format!("starting rank {rank}: {}", spec.program),
                    source,
                });
            }
        };
        let (done, tail) = output::pump(rank, &mut child);
        pumps.extend(done);
        tails.push(tail);
        ranks.push((rank, child));
    }
    let mut outcome = supervise(&mut ranks, spec.grace);
    output::drain(pumps, Duration::from_secs(2));
    if let Ok(LaunchOutcome::RankFailed {
        rank, last_words, ..
    }) = &mut outcome
    {
        let local = *rank - spec.global_rank(0);
        *last_words = output::last_words(&tails[local]);
    }
    outcome
}

/// Polls the ranks until all succeeded, one failed, or a signal arrived.
fn supervise(ranks: &mut [(usize, Child)], grace: Duration) -> Result<LaunchOutcome> {
    let mut running: Vec<bool> = vec![true; ranks.len()];
    loop {
        if let Some(sig) = signals::take() {
            signals::forward(ranks, sig);
            wait_all(ranks, grace);
            return Ok(LaunchOutcome::Interrupted { signal: sig });
        }
        for (i, (rank, child)) in ranks.iter_mut().enumerate() {
            if !running[i] {
                continue;
            }
            let status = child.try_wait().map_err(|source| Error::Io {
                context: format!("waiting for rank {rank}"),
                source,
            })?;
            let Some(status) = status else { continue };
            running[i] = false;
            if !status.success() {
                let rank = *rank;
                let stopped: Vec<usize> = ranks
                    .iter()
                    .zip(&running)
                    .filter(|(_, r)| **r)
                    .map(|((k, _), _)| *k)
                    .collect();
                stop(ranks, grace);
                return Ok(failed(rank, status, stopped));
            }
        }
        if running.iter().all(|r| !r) {
            return Ok(LaunchOutcome::Success);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn failed(rank: usize, status: ExitStatus, stopped: Vec<usize>) -> LaunchOutcome {
    use std::os::unix::process::ExitStatusExt;
    let code = match (status.code(), status.signal()) {
        (Some(c), _) => u8::try_from(c).ok().filter(|c| *c != 0).unwrap_or(1),
        (None, Some(s)) => u8::try_from(128 + s).unwrap_or(1),
        (None, None) => 1,
    };
    LaunchOutcome::RankFailed {
        rank,
        status: status.to_string(),
        code,
        stopped,
        last_words: Vec::new(),
    }
}

/// SIGTERM to every rank still running, SIGKILL after `grace`, then reaps them all.
fn stop(ranks: &mut [(usize, Child)], grace: Duration) {
    signals::forward(ranks, libc::SIGTERM);
    wait_all(ranks, grace);
}

/// Waits up to `grace` for every rank, then kills and reaps the rest.
fn wait_all(ranks: &mut [(usize, Child)], grace: Duration) {
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline {
        if ranks
            .iter_mut()
            .all(|(_, c)| matches!(c.try_wait(), Ok(Some(_)) | Err(_)))
        {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for (_, c) in ranks.iter_mut() {
        // Already-exited children make kill fail harmlessly.
        let _ = c.kill();
        let _ = c.wait();
    }
}
