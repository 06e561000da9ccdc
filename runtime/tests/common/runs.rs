//! One toy training run at a world size, as the sharding tests compare them: rank 0's
//! parameters and losses, its parameter and optimizer bytes and device peak, and every
//! rank's cross-group bytes per step.

use std::time::Duration;

use super::toy;
use ferrozero_config::resolved::ResolvedConfig;
use ferrozero_runtime::comm::local::run_ranks;
use ferrozero_runtime::engine::ledger::{Category, Location};
use ferrozero_runtime::engine::{Engine, NamedTensor};

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
    let world = cfg.world_size;
    let (micro, gas) = (
        cfg.train_micro_batch_size_per_gpu,
        cfg.gradient_accumulation_steps,
    );
    let out = run_ranks(world, Duration::from_secs(60), |comm| {
        let rank = comm.rank();
        let mut e = Engine::new(toy::model(V, D, T, LAYERS), cfg.clone(), comm)?;
        let (mut losses, mut cross, mut reduced) = (Vec::new(), Vec::new(), Vec::new());
        for s in 0..steps {
            let batches: Vec<_> = (0..gas)
                .map(|m| toy::batch(V, T, ((s * gas + m) * world + rank) * micro, micro))
                .collect();
            let r = e.train_batch(&batches)?;
            losses.push(r.loss);
            cross.push(r.cross_group_bytes);
            reduced.push(r.reduced_bytes);
        }
        let l = e.ledger();
        Ok(Run {
            param_bytes: l.current(Location::Device, Category::Parameters),
            optim_bytes: l.current(Location::Device, Category::OptimizerState),
            device_peak: l.peak_total(Location::Device),
            params: e.parameters()?,
            losses,
            cross: vec![cross],
            reduced,
        })
    })
    .expect("training failed");
    // Rank 0's run, with every rank's cross-group bytes.
    let cross = out.iter().flat_map(|r| r.cross.clone()).collect();
    let mut first = out.into_iter().next().unwrap();
    first.cross = cross;
    first
}

/// Each parameter's name and value bits, for comparing runs to the last bit.
pub fn named_bits(p: &[NamedTensor]) -> Vec<(String, Vec<u32>)> {
    p.iter()
        .map(|t| (t.name.clone(), t.data.iter().map(|x| x.to_bits()).collect()))
        .collect()
}
