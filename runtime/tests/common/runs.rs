//! One toy training run at a world size, as the sharding tests compare them: rank 0's
//! parameters and losses, its parameter and optimizer bytes and device peak, and every
//! rank's cross-group bytes per step.

use std::time::Duration;

use super::toy;
use ferrozero_config::resolved::ResolvedConfig;
use ferrozero_runtime::comm::local::run_ranks;
use ferrozero_runtime::comm::logger::OpSummary;
use ferrozero_runtime::comm::Communicator;
use ferrozero_runtime::engine::ledger::{Category, Location};
use ferrozero_runtime::engine::{Engine, NamedTensor, StepReport};
use ferrozero_runtime::nn::{Batch, Model};
use ferrozero_runtime::Result;

pub const V: usize = 11;
pub const D: usize = 6;
pub const T: usize = 5;
pub const LAYERS: usize = 2;
pub const STEPS: usize = 12;

/// What one run leaves: rank 0's parameters, losses, parameter and optimizer bytes, and
/// every rank's cross-group bytes per step.
pub struct Run {
    pub params: Vec<NamedTensor>,
    pub losses: Vec<f64>,
    pub param_bytes: u64,
    pub optim_bytes: u64,
    pub device_peak: u64,
    pub cross: Vec<Vec<u64>>,
    /// Rank 0's reduced gradient bytes per step (`StepReport::reduced_bytes`).
    pub reduced: Vec<u64>,
}

/// Trains the toy model `STEPS` steps under `cfg` on local ranks.
pub fn train(cfg: &ResolvedConfig) -> Run {
    train_steps(cfg, STEPS)
}

/// Trains the toy model `steps` steps under `cfg` on local ranks.
pub fn train_steps(cfg: &ResolvedConfig, steps: usize) -> Run {
    let out = run_ranks(cfg.world_size, Duration::from_secs(60), |comm| {
        let rank = comm.rank();
        let mut e = Engine::new(toy::model(V, D, T, LAYERS), cfg.clone(), comm)?;
        let reports = toy_steps(&mut e, cfg, (V, T), steps, rank)?;
        let l = e.ledger();
        Ok(Run {
            param_bytes: l.current(Location::Device, Category::Parameters),
            optim_bytes: l.current(Location::Device, Category::OptimizerState),
            device_peak: l.peak_total(Location::Device),
            params: e.parameters()?,
            losses: reports.iter().map(|r| r.loss).collect(),
            cross: vec![reports.iter().map(|r| r.cross_group_bytes).collect()],
            reduced: reports.iter().map(|r| r.reduced_bytes).collect(),
        })
    })
    .expect("training failed");
    // Rank 0's run, with every rank's cross-group bytes.
    let cross = out.iter().flat_map(|r| r.cross.clone()).collect();
    let mut first = out.into_iter().next().unwrap();
    first.cross = cross;
    first
}

/// Rank `rank`'s micro-batches of step `step` under `cfg`, from the toy stream of `vocab`
/// token ids in rows of `seq`: micro-batch `m` starts at row
/// `((step * gas + m) * world + rank) * micro`, so no two ranks or micro-steps share a row.
pub fn toy_batches(
    cfg: &ResolvedConfig,
    (vocab, seq): (usize, usize),
    step: usize,
    rank: usize,
) -> Vec<Batch> {
    let (world, gas) = (cfg.world_size, cfg.gradient_accumulation_steps);
    let micro = cfg.train_micro_batch_size_per_gpu;
    (0..gas)
        .map(|m| toy::batch(vocab, seq, ((step * gas + m) * world + rank) * micro, micro))
        .collect()
}

/// Trains `e` (rank `rank` of `cfg`'s world) `steps` steps on [`toy_batches`]; the reports.
pub fn toy_steps(
    e: &mut Engine,
    cfg: &ResolvedConfig,
    shape: (usize, usize),
    steps: usize,
    rank: usize,
) -> Result<Vec<StepReport>> {
    (0..steps)
        .map(|s| e.train_batch(&toy_batches(cfg, shape, s, rank)))
        .collect()
}

/// The reports' losses.
pub fn losses(reports: &[StepReport]) -> Vec<f64> {
    reports.iter().map(|r| r.loss).collect()
}

/// Runs `f` on each rank of a local world of `world` (on its own thread); rank 0's result.
pub fn rank0<T: Send>(
    world: usize,
    f: impl Fn(Box<dyn Communicator>) -> Result<T> + Sync,
) -> Result<T> {
    let out = run_ranks(world, Duration::from_secs(300), f)?;
    Ok(out.into_iter().next().unwrap())
}

/// What a run leaves on rank 0: each step's loss, the parameters, and the communication
/// logger's records (when the config has a logger).
pub struct Logged {
    pub losses: Vec<f64>,
    pub params: Vec<NamedTensor>,
    pub comms: Option<Vec<OpSummary>>,
}

/// Trains `build`'s model `steps` steps under `cfg` on local ranks, rows of [`T`] tokens below
/// `vocab` ([`toy_batches`]).
pub fn train_logged(
    cfg: &ResolvedConfig,
    build: impl Fn() -> Model + Sync,
    vocab: usize,
    steps: usize,
) -> Logged {
    rank0(cfg.world_size, |comm| {
        let rank = comm.rank();
        let mut e = Engine::new(build(), cfg.clone(), comm)?;
        let reports = toy_steps(&mut e, cfg, (vocab, T), steps, rank)?;
        // The records of training alone: reading the parameters gathers them.
        let comms = e.comm_stats().map(|s| s.snapshot());
        Ok(Logged {
            losses: losses(&reports),
            params: e.parameters()?,
            comms,
        })
    })
    .expect("training failed")
}

/// Each parameter's name and value bits, for comparing runs to the last bit.
pub fn named_bits(p: &[NamedTensor]) -> Vec<(String, Vec<u32>)> {
    p.iter()
        .map(|t| (t.name.clone(), t.data.iter().map(|x| x.to_bits()).collect()))
        .collect()
}
