//! `initialize`: from a model and a config file to a ready engine on this rank, with the
//! config's `"auto"` values resolved against the real world size and model, and a one-screen
//! summary logged by rank 0.

use std::path::{Path, PathBuf};

use ferrozero_config::{Config, ResolveContext};

use super::core::Engine;
use super::host_limits::{check_device_host_ram, check_locked_memory, ranks_here, HostRam};
use super::optimizer_overlap::{overlap_on_host, OptimizerOverlap};
use crate::backend::memory_is_host_ram;
use crate::comm::local::LocalComm;
use crate::comm::Communicator;
use crate::nn::Model;
use crate::{Error, Result};

/// Builds an engine step by step: `EngineBuilder::new(model).config_file(path)?.build()`.
pub struct EngineBuilder {
    model: Model,
    config: Option<Config>,
    comm: Option<Box<dyn Communicator>>,
    hidden_size: Option<usize>,
    micro_batch_hint: Option<usize>,
    seq_len: Option<usize>,
    host_ram: Option<HostRam>,
}

impl EngineBuilder {
    /// Starts from a model.
    pub fn new(model: Model) -> Self {
        Self {
            model,
            config: None,
            comm: None,
            hidden_size: None,
            micro_batch_hint: None,
            seq_len: None,
            host_ram: None,
        }
    }

    /// Loads and validates a config file (TOML or DeepSpeed JSON); every problem is reported
    /// at once, rustc-style.
    pub fn config_file(mut self, path: impl AsRef<Path>) -> Result<Self> {
        let loaded =
            ferrozero_config::load(path.as_ref()).map_err(|e| Error::Config(e.to_string()))?;
        for w in &loaded.warnings {
            tracing::warn!("{}", w.render(ferrozero_config::RenderStyle::Plain));
        }
        self.config = Some(loaded.config);
        Ok(self)
    }

    /// Uses an already-parsed config.
    pub fn config(mut self, config: Config) -> Self {
        self.config = Some(config);
        self
    }

    /// The communicator for this rank (default: a single local rank).
    pub fn comm(mut self, comm: Box<dyn Communicator>) -> Self {
        self.comm = Some(comm);
        self
    }

    /// The model's hidden size, for `"auto"` bucket sizes (Hugging Face's rules).
    pub fn hidden_size(mut self, h: usize) -> Self {
        self.hidden_size = Some(h);
        self
    }

    /// The micro-batch to use where the config says `"auto"`.
    pub fn micro_batch(mut self, b: usize) -> Self {
        self.micro_batch_hint = Some(b);
        self
    }

    /// The sequence length the run will use: enables the pre-flight check, which refuses a
    /// run whose memory (estimated by the same rules as the ledger), locked memory or NVMe
    /// space cannot fit this machine, before anything is allocated.
    pub fn sequence_length(mut self, seq: usize) -> Self {
        self.seq_len = Some(seq);
        self
    }

    /// The host memory figures the device run's host-RAM check compares with, instead of
    /// this machine's (`HostRam::probe`).
    pub fn host_ram(mut self, ram: HostRam) -> Self {
        self.host_ram = Some(ram);
        self
    }

    /// Resolves the config for the communicator's world and builds the engine.
    pub fn build(self) -> Result<Engine> {
        let config = self
            .config
            .ok_or_else(|| Error::Config("no config given (use config_file or config)".into()))?;
        let comm = match self.comm {
            Some(c) => c,
            None => single_rank(&config)?,
        };
        if comm.rank() == 0 {
            tracing::info!(
                "communicator: {} ({} ranks)",
                super::topology::backend_name(comm.backend()),
                comm.world_size()
            );
        }
        let ctx = ResolveContext {
            world_size: comm.world_size(),
            hidden_size: self.hidden_size,
            micro_batch_hint: self.micro_batch_hint,
        };
        let mut resolution = config
            .resolve_explained(&ctx)
            .map_err(|e| Error::Config(e.to_string()))?;
        // Before anything is allocated: mlocked buffers need a locked-memory limit that holds
        // them (raised here when the hard limit allows, else refused or, where the config
        // allows it, pinning turned off); a device run's page-locked and pageable host
        // memory must fit in the host's RAM.
        let seq = self.seq_len.unwrap_or(1);
        let (overlap, mut priced) = overlap_for_host(&self.model, &resolution.config, seq)?;
        let cfg = &mut resolution.config;
        let pinned = cfg.zero.offload_optimizer.pin_memory || cfg.zero.offload_param.pin_memory;
        let on_device = !memory_is_host_ram(cfg.device);
        if priced && (pinned || on_device) {
            let mb = cfg.train_micro_batch_size_per_gpu;
            let e = super::estimate::estimate_with_overlap(&self.model, cfg, mb, seq, &overlap);
            match unless_size_only(e)? {
                Some(e) => check_host(cfg, &e, on_device, self.host_ram)?,
                None => priced = false,
            }
        }
        if let (Some(seq), true) = (self.seq_len, priced) {
            preflight(&self.model, &resolution.config, seq, &overlap)?;
        }
        if comm.rank() == 0 {
            for d in &resolution.decisions {
                tracing::info!("config: {} = {} ({})", d.path, d.value, d.rule);
            }
        }
        let engine = Engine::with_overlap(self.model, resolution.config, comm, Some(overlap))?;
        if engine.rank() == 0 {
            tracing::info!("{}", engine.summary());
        }
        Ok(engine)
    }
}

/// The estimate `r`, or `None` when the model cannot run on the size-only device the
/// estimate runs the step on (a module computing with host loops, [`Error::SizeOnly`]):
/// `initialize` then goes on without checking memory, and says so once. Any other error
/// (a config the engine refuses, a step that does not fit) is returned.
fn unless_size_only<T>(r: Result<T>) -> Result<Option<T>> {
    match r {
        Err(Error::SizeOnly(why)) => {
            tracing::warn!(
                "memory not checked: the estimate runs the model on a size-only device, which \
                 it cannot run on ({why}); initialize goes on without the pre-flight's memory \
                 checks"
            );
            Ok(None)
        }
        r => r.map(Some),
    }
}

/// The host checks of a run that page-locks memory or runs on a device, from its estimate
/// `e`: the locked-memory limit (raised, or pinning turned off where the config allows it)
/// and, on a device, the host RAM its page-locked and pageable memory need.
fn check_host(
    cfg: &mut ferrozero_config::ResolvedConfig,
    e: &super::estimate::Estimate,
    on_device: bool,
    ram: Option<HostRam>,
) -> Result<()> {
    check_locked_memory(cfg, e)?;
    if on_device {
        let ram = ram.map(Ok).unwrap_or_else(HostRam::probe);
        check_device_host_ram(cfg, e, ram.ok())?;
    }
    Ok(())
}

/// Compares what this process's ranks need with what the machine has (RAM, locked memory,
/// NVMe free space) and with `device_memory_limit`, and refuses with every shortfall and its
/// numbers; goes on unchecked for a model the estimate cannot run ([`unless_size_only`]).
fn preflight(
    model: &Model,
    cfg: &ferrozero_config::ResolvedConfig,
    seq: usize,
    overlap: &OptimizerOverlap,
) -> Result<()> {
    let mb = cfg.train_micro_batch_size_per_gpu;
    let e = super::estimate::estimate_with_overlap(model, cfg, mb, seq, overlap);
    let Some(e) = unless_size_only(e)? else {
        return Ok(());
    };
    super::estimate::check_device_cap(model, cfg, seq, &e)?;
    // Local ranks share this process's machine; other backends run one rank per process.
    let here = ranks_here(cfg);
    let device_in_ram = memory_is_host_ram(cfg.device);
    let req = requirement(&e, cfg, here, device_in_ram);
    ferrozero_offload::preflight::preflight(&req)
        .map_err(|err| Error::Config(format!("pre-flight: {err}")))?;
    tracing::info!(
        "pre-flight: {} ranks here need {:.1} MiB of RAM ({:.1} MiB locked) and {:.1} MiB of NVMe: fits",
        here,
        req.host_bytes as f64 / 1048576.0,
        req.locked_bytes as f64 / 1048576.0,
        req.nvme.iter().map(|n| n.1).sum::<u64>() as f64 / 1048576.0
    );
    Ok(())
}

/// The optimizer overlap for this machine: the config's, unless it is speculative and its
/// snapshots do not fit in `MemAvailable` beside everything else the pre-flight counts
/// (then bounded to the groups that fit, or off when none does, the reason giving the
/// numbers). Where the host cannot be measured the config
/// decides (the pre-flight, when asked for, refuses such a host anyway). Second: false when
/// the estimate could not run the model ([`unless_size_only`]; the config decided).
fn overlap_for_host(
    model: &Model,
    cfg: &ferrozero_config::ResolvedConfig,
    seq: usize,
) -> Result<(OptimizerOverlap, bool)> {
    let decided = OptimizerOverlap::decide(cfg);
    if !matches!(decided, OptimizerOverlap::Speculative(..)) {
        return Ok((decided, true));
    }
    let mb = cfg.train_micro_batch_size_per_gpu;
    let ranks = (ranks_here(cfg), memory_is_host_ram(cfg.device));
    match ferrozero_offload::sys::mem_available() {
        Ok(available) => {
            let on_host = overlap_on_host(model, cfg, (mb, seq), ranks, available);
            Ok(match unless_size_only(on_host)? {
                Some((o, _)) => (o, true),
                None => (decided, false),
            })
        }
        Err(err) => {
            tracing::warn!("speculative optimizer overlap: host memory unknown ({err})");
            Ok((decided, true))
        }
    }
}

/// What `here` ranks need of this machine: RAM for their host state, and for their device
/// working set too when the device's memory is the host's (a CPU run; a GPU's is not counted:
/// it would refuse a run DeepSpeed starts), locked memory, NVMe space.
fn requirement(
    e: &super::estimate::Estimate,
    cfg: &ferrozero_config::ResolvedConfig,
    here: u64,
    device_in_ram: bool,
) -> ferrozero_offload::preflight::Requirement {
    let mut nvme = Vec::new();
    for off in [&cfg.zero.offload_optimizer, &cfg.zero.offload_param] {
        if let ferrozero_config::resolved::OffloadTarget::Nvme(p) = &off.target {
            nvme.push((p.clone(), e.nvme.peak_bytes * here));
        }
    }
    ferrozero_offload::preflight::Requirement {
        host_bytes: (e.host_total_bytes()
            + if device_in_ram {
                e.device.peak_bytes
            } else {
                0
            })
        .saturating_mul(here),
        locked_bytes: e.mlocked_host_bytes * here,
        nvme,
    }
}

/// The default communicator, from the config's `comms` section: the MPI world (with the
/// section's timeout and reduction) for `backend = "mpi"`, else one local rank, unless the
/// environment describes a multi-process job, which needs a backend that crosses processes.
fn single_rank(config: &Config) -> Result<Box<dyn Communicator>> {
    use ferrozero_config::resolved::CommBackend;
    let comms = config.resolve_comms();
    let world: usize = std::env::var("WORLD_SIZE")
        .ok()
        .and_then(|w| w.parse().ok())
        .unwrap_or(1);
    match comms.backend {
        CommBackend::Mpi => crate::comm::open_rank(&comms),
        _ if world > 1 => Err(Error::Unavailable {
            what: "multi-process communicator",
            why: format!(
                "WORLD_SIZE={world} but no communicator was given and comms.backend is {:?}; set \
                 comms.backend = \"mpi\" (build with --features mpi), pass one with \
                 EngineBuilder::comm, or run ranks in one process with comm::local::run_ranks",
                comms.backend
            ),
        }),
        // One rank needs no transport: every backend is the same there.
        _ => {
            let mut group = LocalComm::group(1, comms.timeout);
            Ok(Box::new(group.remove(0)))
        }
    }
}

/// Loads `config` and builds an engine for `model` on a single local rank (or fails with a
/// clear message when the environment describes a multi-process job without a communicator).
pub fn initialize(model: Model, config: impl AsRef<Path>) -> Result<Engine> {
    EngineBuilder::new(model).config_file(config)?.build()
}

/// A config path from the command line or the default preset.
pub fn default_config_path() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../configs/default.toml"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::estimate::{estimate, shape::preset};
    use ferrozero_config::Device;

    fn resolved(device: &str) -> ferrozero_config::ResolvedConfig {
        let src = format!(
            "device = \"{device}\"\ntrain_micro_batch_size_per_gpu = 1\n\
             [optimizer]\ntype = \"AdamW\"\nparams.lr = 1e-4\n\
             [zero_optimization]\nstage = 3\n\
             [zero_optimization.offload_optimizer]\ndevice = \"cpu\"\n"
        );
        crate::engine::test_config(&src, None)
    }

    /// A GPU's working set is not RAM: counting it refused 7B runs on hosts with less RAM than
    /// the GPU holds (GPT-2 124M on an H100 asked for 23.9 GiB of RAM for a 7 GiB device peak).
    #[test]
    fn only_a_cpu_run_counts_its_device_working_set_as_ram() {
        let shape = preset("llama-7b").unwrap();
        let (cpu, gpu) = (resolved("cpu"), resolved("cuda"));
        assert_eq!(cpu.device, Device::Cpu);
        let e = estimate(&shape.model, &gpu, 1, 1024).unwrap();
        let host = e.host_total_bytes();
        assert!(host > 0 && e.device.peak_bytes > 0);
        assert!(crate::backend::memory_is_host_ram(cpu.device));
        assert!(!crate::backend::memory_is_host_ram(gpu.device));
        let on_gpu = requirement(&e, &gpu, 2, false);
        assert_eq!(on_gpu.host_bytes, 2 * host);
        assert_eq!(on_gpu.locked_bytes, 2 * e.mlocked_host_bytes);
        let on_cpu = requirement(&e, &cpu, 2, true);
        assert_eq!(on_cpu.host_bytes, 2 * (host + e.device.peak_bytes));
    }
}
