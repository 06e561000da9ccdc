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
}

/// Trains the toy model `STEPS` steps under `cfg` on local ranks.
pub fn train(cfg: &ResolvedConfig) -> Run {
    let world = cfg.world_size;
    let (micro, gas) = (
        cfg.train_micro_batch_size_per_gpu,
        cfg.gradient_accumulation_steps,
    );
    let out = run_ranks(world, Duration::from_secs(60), |comm| {
        let rank = comm.rank();
        let mut e = Engine::new(toy::model(V, D, T, LAYERS), cfg.clone(), comm)?;
        let (mut losses, mut cross) = (Vec::new(), Vec::new());
        for s in 0..STEPS {
            let batches: Vec<_> = (0..gas)
                .map(|m| toy::batch(V, T, ((s * gas + m) * world + rank) * micro, micro))
                .collect();
            let r = e.train_batch(&batches)?;
            losses.push(r.loss);
            cross.push(r.cross_group_bytes);
        }
        let l = e.ledger();
        let (param_bytes, optim_bytes, device_peak) = (
            l.current(Location::Device, Category::Parameters),
            l.current(Location::Device, Category::OptimizerState),
            l.peak_total(Location::Device),
        );
        Ok((
            e.parameters()?,
            losses,
            param_bytes,
            optim_bytes,
            device_peak,
            cross,
        ))
    })
    .expect("training failed");
    let cross = out.iter().map(|o| o.5.clone()).collect();
    let (params, losses, param_bytes, optim_bytes, device_peak, _) =
        out.into_iter().next().unwrap();
    Run {
        params,
        losses,
        param_bytes,
        optim_bytes,
        device_peak,
        cross,
    }
}
