//! The ledger's model-state bytes per rank follow the ZeRO formulas (mixed precision:
//! stage 0: 16 B/param, 1: 4 + 12/N, 2: 2 + 14/N, 3: 16/N), and offload moves exactly the
//! optimizer state off the device. The formulas count a gradient accumulator in the storage
//! dtype (two micro-batches per step); at one, one rank holds the f32 micro-step gradient to
//! the step instead (2 B/param more, and no accumulator between steps).

mod common;

use std::time::Duration;

use common::{config, toy};
use ferrozero_config::resolved::{OffloadTarget, Precision, ZeroStage};
use ferrozero_runtime::comm::local::run_ranks;
use ferrozero_runtime::engine::ledger::{Category, Location};
use ferrozero_runtime::engine::Engine;

const V: usize = 97;
const D: usize = 64;
const T: usize = 8;
const L: usize = 4;

fn model_state_bytes(stage: ZeroStage, world: usize, offload: bool) -> (f64, f64, usize) {
    model_state_bytes_at(stage, world, offload, 2)
}

/// As [`model_state_bytes`] with `gas` micro-batches per step.
fn model_state_bytes_at(
    stage: ZeroStage,
    world: usize,
    offload: bool,
    gas: usize,
) -> (f64, f64, usize) {
    let mut cfg = config(stage, world, 1, gas, Precision::Bf16);
    if offload {
        cfg.zero.offload_optimizer.target = OffloadTarget::Cpu;
    }
    let out = run_ranks(world, Duration::from_secs(30), |comm| {
        let rank = comm.rank();
        let mut e = Engine::new(toy::model(V, D, T, L), cfg.clone(), comm)?;
        let batches: Vec<_> = (0..gas)
            .map(|m| toy::batch(V, T, m * world + rank, 1))
            .collect();
        e.train_batch(&batches)?;
        let l = e.ledger();
        let dev: u64 = [
            Category::Parameters,
            Category::Gradients,
            Category::OptimizerState,
        ]
        .iter()
        .map(|&c| l.peak(Location::Device, c))
        .sum();
        Ok((
            dev as f64,
            l.peak(Location::Host, Category::OptimizerState) as f64,
            e.model().num_params(),
        ))
    })
    .unwrap();
    out[0]
}

#[test]
fn model_states_match_the_zero_formulas() {
    for world in [1, 2, 4] {
        let n = world as f64;
        for (stage, per_param) in [
            (ZeroStage::Stage0, 16.0),
            (ZeroStage::Stage1, 4.0 + 12.0 / n),
            (ZeroStage::Stage2, 2.0 + 14.0 / n),
            (ZeroStage::Stage3, 16.0 / n),
        ] {
            let (dev, host, params) = model_state_bytes(stage, world, false);
            let want = per_param * params as f64;
            assert!(
                (dev - want).abs() / want < 0.02,
                "{stage:?} world {world}: ledger {dev} formula {want}"
            );
            assert_eq!(host, 0.0);
        }
    }
}

/// One micro-batch per step at one rank: the gradient held to the step is the f32 micro-step
/// gradient, 4 bytes per parameter instead of the bf16 accumulator's 2, at every stage.
#[test]
fn one_micro_batch_per_step_holds_the_f32_gradient() {
    for stage in [ZeroStage::Stage0, ZeroStage::Stage3] {
        let (dev, _, params) = model_state_bytes_at(stage, 1, false, 1);
        let want = 18.0 * params as f64;
        assert!(
            (dev - want).abs() / want < 0.02,
            "{stage:?}: ledger {dev}, 18 B/param {want}"
        );
    }
}

/// The optimizer state (12 bytes per parameter, sharded over the two ranks) goes to the host,
/// and the gradient accumulator follows it off the device (2 bytes per parameter at stage 1,
/// the rank's half at stage 3).
#[test]
fn optimizer_offload_moves_its_state_and_the_gradients_to_the_host() {
    for (stage, grad_bytes) in [(ZeroStage::Stage1, 2.0), (ZeroStage::Stage3, 1.0)] {
        let (dev_on, _, _) = model_state_bytes(stage, 2, false);
        let (dev_off, host_off, params) = model_state_bytes(stage, 2, true);
        let moved = 12.0 / 2.0 * params as f64;
        let left = moved + grad_bytes * params as f64;
        assert!(
            (dev_on - dev_off - left).abs() / left < 0.02,
            "{stage:?}: {dev_on} -> {dev_off}"
        );
        assert!(
            (host_off - moved).abs() / moved < 0.02,
            "{stage:?}: host {host_off}"
        );
    }
}
