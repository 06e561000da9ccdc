//! ZeRO stages 0-3 give bitwise-identical parameters for one world size, with and without
//! activation checkpointing, in f32 and bf16; different world sizes agree within tolerance.

mod common;

use std::time::Duration;

use common::{config, toy};
use ferrozero_config::resolved::{Precision, ResolvedConfig, ZeroStage};
use ferrozero_runtime::comm::local::run_ranks;
use ferrozero_runtime::engine::{Engine, NamedTensor};

const V: usize = 11;
const D: usize = 6;
const T: usize = 5;
const LAYERS: usize = 2;
const STAGES: [ZeroStage; 4] = [
    ZeroStage::Stage0,
    ZeroStage::Stage1,
    ZeroStage::Stage2,
    ZeroStage::Stage3,
];

/// Trains `steps` steps; rank r takes rows in the order steps, micro-steps, ranks, micro-batch.
fn train(cfg: &ResolvedConfig, steps: usize) -> (Vec<NamedTensor>, Vec<f64>) {
    let world = cfg.world_size;
    let (micro, gas) = (
        cfg.train_micro_batch_size_per_gpu,
        cfg.gradient_accumulation_steps,
    );
    let out = run_ranks(world, Duration::from_secs(30), |comm| {
        let rank = comm.rank();
        let mut e = Engine::new(toy::model(V, D, T, LAYERS), cfg.clone(), comm)?;
        let mut losses = Vec::new();
        for s in 0..steps {
            let batches: Vec<_> = (0..gas)
                .map(|m| toy::batch(V, T, ((s * gas + m) * world + rank) * micro, micro))
                .collect();
            losses.push(e.train_batch(&batches)?.loss);
        }
        Ok((e.parameters()?, losses))
    })
    .expect("training failed");
    out.into_iter().next().unwrap()
}

fn bits(p: &[NamedTensor]) -> Vec<(String, Vec<u32>)> {
    p.iter()
        .map(|t| (t.name.clone(), t.data.iter().map(|x| x.to_bits()).collect()))
        .collect()
}

fn check_stages_identical(world: usize, precision: Precision, ckpt: bool) {
    let mut reference = None;
    for (stage, overlap) in STAGES.iter().flat_map(|&s| [(s, false), (s, true)]) {
        let mut cfg = config(stage, world, 2, 2, precision.clone());
        cfg.zero.overlap_comm = overlap;
        // Alternate the reuse rule so stage 3 runs both with and without keeping units gathered.
        cfg.zero.max_reuse_distance = if overlap { 1_000_000 } else { 0 };
        if ckpt {
            cfg.activation_checkpointing = Some(common::checkpointing(false));
        }
        let (params, losses) = train(&cfg, 20);
        assert!(losses.iter().all(|l| l.is_finite()));
        match &reference {
            None => reference = Some((bits(&params), losses)),
            Some((rb, rl)) => {
                assert_eq!(
                    rl, &losses,
                    "losses differ: stage {stage:?} world {world} {precision:?} ckpt {ckpt}"
                );
                assert!(
                    rb == &bits(&params),
                    "parameters differ: stage {stage:?} world {world} {precision:?} ckpt {ckpt}"
                );
            }
        }
    }
}

#[test]
fn stages_bitwise_identical_f32() {
    for world in [1, 2, 4] {
        check_stages_identical(world, Precision::F32, false);
    }
}

#[test]
fn stages_bitwise_identical_bf16() {
    for world in [1, 2, 4] {
        check_stages_identical(world, Precision::Bf16, false);
    }
}

#[test]
fn stages_bitwise_identical_with_activation_checkpointing() {
    for world in [1, 2, 4] {
        check_stages_identical(world, Precision::F32, true);
        check_stages_identical(world, Precision::Bf16, true);
    }
}

#[test]
fn checkpointing_does_not_change_results() {
    let cfg = config(ZeroStage::Stage3, 2, 2, 1, Precision::F32);
    let mut ck = cfg.clone();
    ck.activation_checkpointing = Some(common::checkpointing(true));
    assert!(bits(&train(&cfg, 5).0) == bits(&train(&ck, 5).0));
}

#[test]
fn world_sizes_agree_within_tolerance() {
    // World 4 with micro-batch b == world 1 with micro-batch 4b == world 1 with accumulation 4.
    let a = train(&config(ZeroStage::Stage2, 4, 1, 1, Precision::F32), 10);
    let b = train(&config(ZeroStage::Stage0, 1, 4, 1, Precision::F32), 10);
    let c = train(&config(ZeroStage::Stage3, 1, 1, 4, Precision::F32), 10);
    for other in [&b, &c] {
        for (x, y) in a.0.iter().zip(&other.0) {
            for (p, q) in x.data.iter().zip(&y.data) {
                let tol = 1e-5 * p.abs().max(q.abs()).max(1e-2);
                assert!((p - q).abs() <= tol, "{}: {p} vs {q}", x.name);
            }
        }
        for (l1, l2) in a.1.iter().zip(&other.1) {
            assert!((l1 - l2).abs() <= 1e-5 * l1.abs(), "loss {l1} vs {l2}");
        }
    }
}

#[test]
fn training_reduces_the_loss() {
    let (_, losses) = train(&config(ZeroStage::Stage2, 2, 4, 1, Precision::F32), 30);
    // ln(11) = 2.40 is chance; the toy data is only partly predictable.
    let first = (losses[0] + losses[1]) / 2.0;
    let last = losses[25..].iter().sum::<f64>() / 5.0;
    assert!(last < 0.85 * first, "{losses:?}");
}
