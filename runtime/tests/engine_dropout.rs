//! GPT-2 as transformers ships it (every dropout 0.1, attention probabilities included) trains
//! to the same bits at every ZeRO stage, and to the same losses (up to summation order) at
//! every world size and accumulation split: a mask is drawn from the seed, the unit, the site
//! and the sample's global index alone, never from how parameters are partitioned or which
//! rank or micro-step holds the sample.

mod common;

use common::config;
use common::runs::{losses as losses_of, rank0, toy_steps};
use ferrozero_config::resolved::{Precision, ZeroStage};
use ferrozero_runtime::comm::Communicator;
use ferrozero_runtime::engine::Engine;
use ferrozero_runtime::nn::{gpt2, llama, Model};

const T: usize = 8;

/// Tiny GPT-2 with residual and embedding dropout `p` and attention dropout `attn`.
fn gpt2_with_dropout(p: f32, attn: f32) -> Model {
    let cfg = gpt2::Gpt2Config::from_json(&format!(
        r#"{{"n_layer": 2, "n_head": 2, "n_embd": 16, "vocab_size": 61, "n_positions": 16,
            "model_type": "gpt2", "activation_function": "gelu_new", "resid_pdrop": {p},
            "embd_pdrop": {p}, "attn_pdrop": {attn}}}"#
    ))
    .expect("valid GPT-2 config");
    gpt2::build(&cfg).expect("GPT-2 builds")
}

/// The tiny Llama preset (vocabulary 64) with attention dropout `attn`.
fn llama_with_dropout(attn: f32) -> Model {
    let cfg = llama::LlamaConfig {
        attention_dropout: attn,
        ..llama::LlamaConfig::preset("tiny").expect("a preset")
    };
    llama::build(&cfg).expect("Llama builds")
}

/// The losses of 3 steps at `stage` on `world` ranks (rank 0's view of the global mean).
fn losses((p, attn): (f32, f32), stage: ZeroStage, world: usize) -> Vec<u64> {
    train(|| gpt2_with_dropout(p, attn), stage, world)
}

/// The losses of 3 steps of the model `build` makes, at `stage` on `world` ranks.
fn train(build: impl Fn() -> Model + Sync, stage: ZeroStage, world: usize) -> Vec<u64> {
    let cfg = config(stage, world, 2, 2, Precision::F32);
    let run = |comm: Box<dyn Communicator>| {
        let rank = comm.rank();
        let mut e = Engine::new(build(), cfg.clone(), comm)?;
        toy_steps(&mut e, &cfg, (61, T), 3, rank)
    };
    let reports = rank0(world, run).expect("training failed");
    reports.iter().map(|r| r.loss.to_bits()).collect()
}

#[test]
fn dropout_trains_to_the_same_bits_at_every_stage() {
    for world in [1, 2] {
        let s0 = losses((0.1, 0.1), ZeroStage::Stage0, world);
        let s3 = losses((0.1, 0.1), ZeroStage::Stage3, world);
        assert_eq!(s0, s3, "world {world}: stage 0 vs 3");
    }
}

#[test]
fn attention_dropout_alone_changes_training_and_is_stage_independent() {
    let off = losses((0.0, 0.0), ZeroStage::Stage0, 1);
    let on = losses((0.0, 0.1), ZeroStage::Stage0, 1);
    assert_ne!(on, off, "attention dropout 0.1 drops something");
    assert_eq!(on, losses((0.0, 0.1), ZeroStage::Stage3, 1));
}

#[test]
fn llama_attention_dropout_is_stage_independent() {
    let off = train(|| llama_with_dropout(0.0), ZeroStage::Stage0, 1);
    let on = train(|| llama_with_dropout(0.1), ZeroStage::Stage0, 1);
    assert_ne!(on, off, "attention_dropout 0.1 drops something");
    for world in [1, 2] {
        let s0 = train(|| llama_with_dropout(0.1), ZeroStage::Stage0, world);
        let s3 = train(|| llama_with_dropout(0.1), ZeroStage::Stage3, world);
        assert_eq!(s0, s3, "world {world}: stage 0 vs 3");
    }
}

/// The per-step losses of 3 steps of a GPT-2 with residual and embedding dropout `p` and
/// attention dropout `p` on `world` ranks of micro-batch `micro` with `gas` micro-steps, fed
/// the engine's global order (micro-step, then rank, then row).
fn split_losses(p: f32, (world, micro, gas): (usize, usize, usize)) -> Vec<f64> {
    let cfg = config(ZeroStage::Stage0, world, micro, gas, Precision::F32);
    let run = |comm: Box<dyn Communicator>| {
        let rank = comm.rank();
        let mut e = Engine::new(gpt2_with_dropout(p, p), cfg.clone(), comm)?;
        toy_steps(&mut e, &cfg, (61, T), 3, rank)
    };
    losses_of(&rank0(world, run).expect("training failed"))
}

/// The largest relative difference between two runs' per-step losses.
fn rel_diff(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(a, b)| ((a - b) / b).abs())
        .fold(0.0, f64::max)
}

/// Without dropout these layouts differ by summation order only: 6.7e-8 relative at most over
/// the 3 steps, so 1e-5 leaves room for other platforms' orders. With dropout 0.1 they differ
/// by the same 6.7e-8 (masks drawn per rank and micro-step instead differed by 6.3e-3), and
/// their losses move from dropout 0's by up to 1.3e-2.
#[test]
fn dropout_masks_follow_the_sample_across_worlds_and_splits() {
    const TOL: f64 = 1e-5;
    let layouts = [(1, 4, 1), (2, 2, 1), (1, 2, 2)];
    let plain: Vec<_> = layouts.iter().map(|&l| split_losses(0.0, l)).collect();
    let dropped: Vec<_> = layouts.iter().map(|&l| split_losses(0.1, l)).collect();
    for l in 1..layouts.len() {
        let (w, m, g) = layouts[l];
        let d = rel_diff(&plain[l], &plain[0]);
        assert!(
            d < TOL,
            "dropout 0: world {w} micro {m} gas {g} differs by {d:.2e}"
        );
        let d = rel_diff(&dropped[l], &dropped[0]);
        assert!(
            d < TOL,
            "dropout 0.1: world {w} micro {m} gas {g} differs by {d:.2e}"
        );
    }
    for (l, (plain, dropped)) in plain.iter().zip(&dropped).enumerate() {
        let d = rel_diff(dropped, plain);
        assert!(
            d > 100.0 * TOL,
            "{:?}: dropout 0.1 changes the losses by only {d:.2e}",
            layouts[l]
        );
    }
}
