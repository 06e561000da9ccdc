//! Bit-exact resume: 2k steps straight equal k steps, save, fresh engines, load, k steps,
//! in losses, loss scales and parameter bits, for every stage, offload mode and precision.

mod common;

use std::path::Path;
use std::time::Duration;

use common::{config, toy};
use ferrozero_config::resolved::{OffloadTarget, Precision, ResolvedConfig, ZeroStage};
use ferrozero_runtime::comm::local::run_ranks;
use ferrozero_runtime::engine::checkpoint::Tag;
use ferrozero_runtime::engine::Engine;
use ferrozero_runtime::nn::Batch;

const V: usize = 13;
const D: usize = 8;
const SEQ: usize = 5;
const WORLD: usize = 2;
const K: u64 = 3;

fn fp16() -> Precision {
    // High enough to overflow at first, so the scaler's state moves.
    Precision::Fp16(common::dynamic_scaling(24, 2, 2))
}

fn micro_batches(cfg: &ResolvedConfig, step: u64, rank: usize) -> Vec<Batch> {
    let (micro, gas) = (
        cfg.train_micro_batch_size_per_gpu,
        cfg.gradient_accumulation_steps,
    );
    (0..gas)
        .map(|j| {
            let first = ((step as usize * gas + j) * WORLD + rank) * micro;
            toy::batch(V, SEQ, first, micro)
        })
        .collect()
}

/// (loss, loss scale) per step and the final parameter bits of rank 0.
type Trace = (Vec<(u64, u64)>, Vec<Vec<u32>>);

/// Trains `steps` steps, optionally loading from `load` first and saving to `save` after.
fn train(cfg: &ResolvedConfig, steps: u64, load: Option<&Path>, save: Option<&Path>) -> Trace {
    let out = run_ranks(WORLD, Duration::from_secs(60), |comm| {
        let rank = comm.rank();
        let mut e = Engine::new(toy::model(V, D, SEQ, 2), cfg.clone(), comm)?;
        let mut start = 0;
        if let Some(dir) = load {
            let l = e.load_checkpoint(dir, &Tag::Latest)?;
            assert_eq!(l.step, e.global_steps());
            start = l.data_position;
        }
        let mut trace = Vec::new();
        for s in start..start + steps {
            let r = e.train_batch(&micro_batches(cfg, s, rank))?;
            trace.push((r.loss.to_bits(), r.loss_scale.to_bits()));
        }
        if let Some(dir) = save {
            e.save_checkpoint(dir, &format!("step-{}", start + steps), start + steps)?;
        }
        let bits = e
            .parameters()?
            .into_iter()
            .map(|p| p.data.iter().map(|x| x.to_bits()).collect())
            .collect();
        Ok((trace, bits))
    })
    .unwrap();
    out.into_iter().next().unwrap()
}

fn check(cfg: ResolvedConfig, what: &str) {
    let dir = tempfile::tempdir().unwrap();
    let (straight, final_bits) = train(&cfg, 2 * K, None, None);
    let (first, _) = train(&cfg, K, None, Some(dir.path()));
    let (second, resumed_bits) = train(&cfg, K, Some(dir.path()), None);
    let resumed: Vec<_> = first.into_iter().chain(second).collect();
    assert_eq!(straight, resumed, "{what}: losses / loss scales differ");
    assert_eq!(final_bits, resumed_bits, "{what}: parameter bits differ");
}

#[test]
fn resume_is_bit_exact_in_every_stage_and_offload_target_fp16() {
    for stage in common::STAGES {
        // NVMe-resident optimizer state is refused by checkpoints (see the test below).
        for offload in [OffloadTarget::None, OffloadTarget::Cpu] {
            let mut cfg = config(stage, WORLD, 2, 2, fp16());
            cfg.zero.offload_optimizer.target = offload.clone();
            if stage == ZeroStage::Stage3 {
                cfg.zero.offload_param.target = offload.clone();
            }
            check(cfg, &format!("{stage:?} {offload:?}"));
        }
    }
}

#[test]
fn resume_is_bit_exact_in_bf16_and_f32() {
    check(
        config(ZeroStage::Stage2, WORLD, 2, 1, Precision::Bf16),
        "bf16 stage 2",
    );
    check(
        config(ZeroStage::Stage3, WORLD, 1, 2, Precision::F32),
        "f32 stage 3",
    );
}

#[test]
fn the_scaler_state_really_moves_during_the_run() {
    // Guards the test above: a scaler that never changed would make its restore untested.
    let (trace, _) = train(
        &config(ZeroStage::Stage1, WORLD, 2, 2, fp16()),
        2 * K,
        None,
        None,
    );
    let scales: std::collections::BTreeSet<u64> = trace.iter().map(|t| t.1).collect();
    assert!(scales.len() > 1, "loss scale never changed: {trace:?}");
}

#[test]
fn nvme_resident_optimizer_state_resumes_bit_exactly_and_moves_between_placements() {
    // Removed when the test ends, pass or fail (swap files are preallocated).
    let scratch = tempfile::tempdir().unwrap();
    let swap = |tag: &str| scratch.path().join(format!("nvme-{tag}"));
    for stage in [ZeroStage::Stage1, ZeroStage::Stage2, ZeroStage::Stage3] {
        for precision in [Precision::Bf16, fp16()] {
            let mut cfg = config(stage, WORLD, 2, 1, precision.clone());
            cfg.zero.offload_optimizer.target = OffloadTarget::Nvme(swap("a"));
            check(cfg, &format!("nvme {stage:?} {precision:?}"));
        }
    }
    // Stage-3 parameter shards on NVMe as well (alone and with the optimizer state there).
    for opt in [OffloadTarget::Cpu, OffloadTarget::Nvme(swap("c"))] {
        let mut cfg = config(ZeroStage::Stage3, WORLD, 2, 1, Precision::Bf16);
        cfg.zero.offload_optimizer.target = opt.clone();
        cfg.zero.offload_param.target = OffloadTarget::Nvme(swap("d"));
        check(cfg, &format!("nvme params, optimizer {opt:?}"));
    }
    // Saved with NVMe-resident state, resumed in memory, and the reverse: same training.
    let dir = scratch.path().join("mix");
    let mut nvme = config(ZeroStage::Stage3, WORLD, 2, 1, Precision::Bf16);
    nvme.zero.offload_optimizer.target = OffloadTarget::Nvme(swap("b"));
    nvme.zero.offload_param.target = OffloadTarget::Nvme(swap("e"));
    let memory = config(ZeroStage::Stage3, WORLD, 2, 1, Precision::Bf16);
    let straight = train(&memory, 6, None, None);
    for (first, second) in [(&nvme, &memory), (&memory, &nvme)] {
        let _ = std::fs::remove_dir_all(&dir);
        train(first, 3, None, Some(&dir));
        let resumed = train(second, 3, Some(&dir), None);
        assert_eq!(
            straight.0[3..],
            resumed.0[..],
            "losses after a placement change"
        );
        assert!(
            straight.1 == resumed.1,
            "parameters after a placement change"
        );
    }
}
