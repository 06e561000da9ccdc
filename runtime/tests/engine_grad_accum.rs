//! `data_types.grad_accum_dtype = "fp32"` in a bf16 run: the accumulator is f32, so the step's
//! gradient is the f32 sum of each micro-step's reduced (bf16) gradient, where the default
//! accumulator rounds to bf16 after every addition. Checked against gradients computed one
//! micro-step at a time and summed here; training is bitwise equal across stages, offload and
//! overlap; the ledger holds 4 bytes of gradient per element.

mod common;

use std::time::Duration;

use common::runs::{train_steps, Run, D, LAYERS, T, V};
use common::{config, toy};
use ferrozero_config::resolved::{OffloadTarget, Precision, ResolvedConfig, ZeroStage};
use ferrozero_runtime::comm::local::run_ranks;
use ferrozero_runtime::engine::ledger::{Category, Location};
use ferrozero_runtime::engine::Engine;
use half::bf16;

const MICRO: usize = 2;
const GAS: usize = 4;

fn cfg(stage: ZeroStage, world: usize, gas: usize, f32_acc: bool) -> ResolvedConfig {
    let mut c = config(stage, world, MICRO, gas, Precision::Bf16);
    c.grad_accum_f32 = f32_acc;
    c
}

/// Rank 0's accumulated gradient (every group's shard, concatenated) after backward over
/// micro-steps `first..first + n`, and the gradient ledger's device and host bytes.
fn gradients(c: &ResolvedConfig, first: usize, n: usize) -> (Vec<f32>, u64) {
    let world = c.world_size;
    let out = run_ranks(world, Duration::from_secs(60), |comm| {
        let rank = comm.rank();
        let mut e = Engine::new(toy::model(V, D, T, LAYERS), c.clone(), comm)?;
        for m in first..first + n {
            e.forward(&toy::batch(V, T, (m * world + rank) * MICRO, MICRO))?;
            e.backward()?;
        }
        let g: Vec<f32> = e
            .gradient_shards()?
            .into_iter()
            .flat_map(|s| s.data)
            .collect();
        let l = e.ledger();
        let bytes = [Location::Device, Location::Host]
            .iter()
            .map(|&at| l.current(at, Category::Gradients))
            .sum();
        Ok((g, bytes))
    })
    .expect("backward failed");
    out.into_iter().next().unwrap()
}

/// What each accumulator makes of the same micro-step gradients, summed in micro-step order.
fn summed(parts: &[Vec<f32>], round: fn(f32) -> f32) -> Vec<f32> {
    let mut acc = vec![0f32; parts[0].len()];
    for p in parts {
        for (a, &x) in acc.iter_mut().zip(p) {
            *a = round(*a + x);
        }
    }
    acc
}

fn to_bf16(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}

#[test]
fn f32_accumulators_sum_the_reduced_micro_gradients_in_f32() {
    for (stage, world) in [
        (ZeroStage::Stage0, 1),
        (ZeroStage::Stage1, 2),
        (ZeroStage::Stage3, 2),
    ] {
        let at = format!("{stage:?}, world {world}");
        // Each micro-step's reduced gradient alone (bf16 values; an f32 accumulator holds
        // them exactly), divided by the accumulation steps as the loss gradient is: by a
        // power of two, so exactly, before or after the rounding.
        let parts: Vec<Vec<f32>> = (0..GAS)
            .map(|m| gradients(&cfg(stage, world, 1, true), m, 1).0)
            .map(|g| g.into_iter().map(|x| x / GAS as f32).collect())
            .collect();
        let (f32_acc, f32_bytes) = gradients(&cfg(stage, world, GAS, true), 0, GAS);
        let (bf16_acc, bf16_bytes) = gradients(&cfg(stage, world, GAS, false), 0, GAS);
        assert_eq!(f32_acc, summed(&parts, |x| x), "{at}: f32 accumulation");
        assert_eq!(bf16_acc, summed(&parts, to_bf16), "{at}: bf16 accumulation");
        assert_ne!(
            f32_acc, bf16_acc,
            "{at}: the accumulator's dtype made no difference"
        );
        // Same elements, twice the bytes (at stage 1 the accumulator is whole, the shard
        // read above a part of it).
        assert_eq!(f32_bytes, 2 * bf16_bytes, "{at}: gradient bytes");
        if stage != ZeroStage::Stage1 {
            assert_eq!(f32_bytes, 4 * f32_acc.len() as u64, "{at}: gradient bytes");
        }
    }
}

fn train(c: &ResolvedConfig) -> Run {
    train_steps(c, 6)
}

fn same_bits(a: &Run, b: &Run, at: &str) {
    assert_eq!(a.losses, b.losses, "{at}: losses");
    for (x, y) in a.params.iter().zip(&b.params) {
        assert_eq!(x.data, y.data, "{at}: {}", x.name);
    }
}

#[test]
fn f32_accumulation_trains_to_the_same_bits_at_every_stage_and_offload() {
    let world = 2;
    let base = train(&cfg(ZeroStage::Stage0, world, GAS, true));
    let bf16_acc = train(&cfg(ZeroStage::Stage0, world, GAS, false));
    assert_ne!(base.params[0].data, bf16_acc.params[0].data, "no effect");
    for stage in [ZeroStage::Stage1, ZeroStage::Stage2, ZeroStage::Stage3] {
        for (offload, overlap) in [(false, false), (false, true), (true, false), (true, true)] {
            let mut c = cfg(stage, world, GAS, true);
            c.zero.overlap_comm = overlap;
            if offload {
                c.zero.offload_optimizer.target = OffloadTarget::Cpu;
                if stage == ZeroStage::Stage3 {
                    c.zero.offload_param.target = OffloadTarget::Cpu;
                }
            }
            let at = format!("{stage:?}, offload {offload}, overlap {overlap}");
            same_bits(&train(&c), &base, &at);
        }
    }
}
