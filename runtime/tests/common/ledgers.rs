//! One optimizer step of a model on the CPU (every rank run) against the same step on the
//! size-only device (`MetaBackend` with a `MetaComm`: rank 0 alone, standing for the world)
//! and against the estimate, which is by construction that size-only step: every location and
//! category of the ledger equal, to the byte. A configuration with NVMe swaps to a real
//! directory on the CPU and to one that does not exist on the size-only device, which must
//! not create it.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use super::models::{batches, build, Which, MICRO};
use super::scratch::Scratch;
use super::{checkpointing, config};
use ferrozero_config::resolved::{OffloadTarget, Precision, ResolvedConfig, ZeroStage};
use ferrozero_runtime::backend::MetaBackend;
use ferrozero_runtime::comm::local::run_ranks;
use ferrozero_runtime::comm::meta::MetaComm;
use ferrozero_runtime::engine::estimate::{estimate, Estimate, Placement};
use ferrozero_runtime::engine::ledger::{Category, Ledger, Location};
use ferrozero_runtime::engine::Engine;

/// Tokens per row.
pub const SEQ: usize = 8;

const LOCATIONS: [Location; 3] = [Location::Device, Location::Host, Location::Nvme];

/// Every (location, category) peak and every location's total peak (category `None`).
pub type Peaks = Vec<(Location, Option<Category>, u64)>;

/// A ledger's [`Peaks`].
pub fn peaks(l: &Ledger) -> Peaks {
    let by = |loc| Placement {
        peak_bytes: l.peak_total(loc),
        by_category: Category::ALL.iter().map(|&c| (c, l.peak(loc, c))).collect(),
    };
    LOCATIONS
        .iter()
        .flat_map(|&loc| placed(loc, &by(loc)))
        .collect()
}

/// An estimate's [`Peaks`], in the order of [`peaks`].
fn estimated(e: &Estimate) -> Peaks {
    let at = [&e.device, &e.host, &e.nvme];
    (LOCATIONS.iter().zip(at))
        .flat_map(|(&loc, p)| placed(loc, p))
        .collect()
}

fn placed(loc: Location, p: &Placement) -> Peaks {
    let cats = p.by_category.iter().map(|&(c, b)| (loc, Some(c), b));
    cats.chain([(loc, None, p.peak_bytes)]).collect()
}

/// Rank 0's ledger after one step on the CPU, every rank run.
pub fn real(which: Which, cfg: &ResolvedConfig) -> Peaks {
    let out = run_ranks(cfg.world_size, Duration::from_secs(60), |comm| {
        let rank = comm.rank();
        let mut e = Engine::new(build(which), cfg.clone(), comm)?;
        e.train_batch(&batches(cfg, SEQ, 0, rank))?;
        Ok(peaks(e.ledger()))
    })
    .unwrap();
    out.into_iter().next().unwrap()
}

/// Rank 0's ledger after one step on the size-only device, rank 0 alone simulated.
pub fn meta(which: Which, cfg: &ResolvedConfig) -> ferrozero_runtime::Result<Peaks> {
    let comm = MetaComm::new(0, cfg.world_size, cfg.comms.backend)?;
    let be = Arc::new(MetaBackend);
    let mut e = Engine::with_backend(build(which), cfg.clone(), Box::new(comm), be)?;
    e.train_batch(&batches(cfg, SEQ, 0, 0))?;
    Ok(peaks(e.ledger()))
}

/// The configuration in one line, for failure messages and the record.
pub fn describe(which: Which, cfg: &ResolvedConfig) -> String {
    let z = &cfg.zero;
    format!(
        "{which:?} | stage {} | world {} | {:?} | offload {:?}/{:?} | ckpt {:?} | overlap {} \
         reuse {} | hpz {} mics {} | gas {} | qw {} qg {} qnt {} | f32 acc {} | bf16 state {:?}",
        z.stage.number(),
        cfg.world_size,
        cfg.precision,
        z.offload_optimizer.target,
        z.offload_param.target,
        cfg.activation_checkpointing
            .as_ref()
            .map(|a| a.cpu_checkpointing),
        z.overlap_comm,
        z.max_reuse_distance,
        z.hpz_partition_size,
        z.mics_shard_size,
        cfg.gradient_accumulation_steps,
        z.quantized_weights,
        z.quantized_gradients,
        z.quantized_nontrainable_weights,
        cfg.grad_accum_f32,
        cfg.bf16_state,
    )
}

/// Each of `stages` at one rank and at two, stages outermost: the `(stage, world)` pairs
/// [`Sweep::config`] takes.
pub fn one_and_two_ranks(stages: &[ZeroStage]) -> Vec<(ZeroStage, usize)> {
    (stages.iter())
        .flat_map(|&stage| [(stage, 1), (stage, 2)])
        .collect()
}

/// Where optimizer state and parameters live.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Offload {
    None,
    Optimizer,
    OptimizerAndParams,
    /// Stage 3's parameter shards on NVMe, the optimizer's state on the host, two swap
    /// buffers (so that the read-ahead and write-behind limits bind).
    ParamsOnNvme,
}

/// Activation checkpointing: off, checkpoints on the device, or on the host.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Ckpt {
    Off,
    Device,
    Cpu,
}

/// A sweep: its scratch directory for NVMe swaps, the failures it collected (one line per
/// difference, so that one run shows them all) and the configurations it compared.
pub struct Sweep {
    scratch: Scratch,
    failures: Vec<String>,
    runs: usize,
}

impl Sweep {
    /// A sweep with a fresh scratch directory.
    pub fn new() -> Self {
        Sweep {
            scratch: Scratch::new(),
            failures: Vec::new(),
            runs: 0,
        }
    }

    /// The scratch directory NVMe configurations swap to.
    pub fn dir(&self) -> PathBuf {
        self.scratch.dir()
    }

    /// Two micro-steps of `MICRO` rows at `stage` on `world` ranks, in `precision`, offloaded
    /// and checkpointed as told.
    pub fn config(
        &self,
        (stage, world): (ZeroStage, usize),
        precision: Precision,
        offload: Offload,
        ckpt: Ckpt,
    ) -> ResolvedConfig {
        let mut cfg = config(stage, world, MICRO, 2, precision);
        let z = &mut cfg.zero;
        match offload {
            Offload::None => {}
            Offload::Optimizer => z.offload_optimizer.target = OffloadTarget::Cpu,
            Offload::OptimizerAndParams => {
                z.offload_optimizer.target = OffloadTarget::Cpu;
                z.offload_param.target = OffloadTarget::Cpu;
            }
            Offload::ParamsOnNvme => {
                z.offload_optimizer.target = OffloadTarget::Cpu;
                z.offload_param.target = OffloadTarget::Nvme(self.dir());
                z.offload_param.buffer_count = 2;
            }
        }
        cfg.activation_checkpointing = match ckpt {
            Ckpt::Off => None,
            Ckpt::Device => Some(checkpointing(false)),
            Ckpt::Cpu => Some(checkpointing(true)),
        };
        cfg
    }

    /// `cfg`, then `cfg` with overlapped communication (the comm worker's queued reductions
    /// and stage-3 prefetch) and the opposite stage-3 reuse rule.
    pub fn check_overlapped(&mut self, which: Which, cfg: &ResolvedConfig) {
        self.check(which, cfg);
        let mut overlapped = cfg.clone();
        overlapped.zero.overlap_comm = true;
        overlapped.zero.max_reuse_distance = match cfg.zero.max_reuse_distance {
            0 => 1 << 30,
            _ => 0,
        };
        self.check(which, &overlapped);
    }

    /// The CPU's ledger against the size-only run's and the estimate's, every peak.
    pub fn check(&mut self, which: Which, cfg: &ResolvedConfig) {
        let what = describe(which, cfg);
        // Each engine owns and locks its swap directory: a fresh one per run.
        let swaps = swaps_nvme(cfg);
        let absent = swaps.then(|| self.dir().join("never-made"));
        let sized = absent
            .as_ref()
            .map_or_else(|| cfg.clone(), |a| nvme_at(cfg, a));
        let want = match swaps {
            true => real(which, &nvme_at(cfg, &self.dir())),
            false => real(which, cfg),
        };
        if swaps {
            let on_nvme = want.iter().any(|p| p.0 == Location::Nvme && p.2 > 0);
            assert!(on_nvme, "{what}: nothing on NVMe");
        }
        self.compare(&what, "meta run", &want, meta(which, &sized));
        let est = estimate(&build(which), &sized, MICRO, SEQ);
        self.compare(&what, "estimate", &want, est.map(|e| estimated(&e)));
        if let Some(a) = absent {
            assert!(
                !a.exists(),
                "{what}: the size-only run made {}",
                a.display()
            );
        }
        self.runs += 1;
    }

    /// Each peak of the CPU's run against the size-only one's; a failed run is a failure.
    fn compare(
        &mut self,
        what: &str,
        side: &str,
        want: &Peaks,
        got: ferrozero_runtime::Result<Peaks>,
    ) {
        let got = match got {
            Ok(got) => got,
            Err(e) => return self.fail(format!("{what}: {side} failed: {e}")),
        };
        for (w, g) in want.iter().zip(&got) {
            if w != g {
                self.fail(format!(
                    "{what}: {:?}/{:?} CPU {} {side} {}",
                    w.0, w.1, w.2, g.2
                ));
            }
        }
    }

    /// Records a failure, to be reported with the others at the end.
    pub fn fail(&mut self, line: String) {
        self.failures.push(line);
    }

    /// Asserts that at least `at_least` configurations were compared and none differed.
    pub fn finish(self, at_least: usize) {
        eprintln!("compared {} configurations", self.runs);
        assert!(self.failures.is_empty(), "{}", self.failures.join("\n"));
        assert!(
            self.runs >= at_least,
            "swept only {} configurations",
            self.runs
        );
    }
}

/// Whether `cfg` swaps anything to NVMe.
fn swaps_nvme(cfg: &ResolvedConfig) -> bool {
    let z = &cfg.zero;
    [&z.offload_optimizer.target, &z.offload_param.target]
        .iter()
        .any(|t| matches!(t, OffloadTarget::Nvme(_)))
}

/// `cfg` with every NVMe path at `dir`.
pub fn nvme_at(cfg: &ResolvedConfig, dir: &Path) -> ResolvedConfig {
    let mut c = cfg.clone();
    for t in [
        &mut c.zero.offload_optimizer.target,
        &mut c.zero.offload_param.target,
    ] {
        if let OffloadTarget::Nvme(p) = t {
            *p = dir.to_path_buf();
        }
    }
    c
}
