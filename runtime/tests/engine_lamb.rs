//! LAMB in the engine: each parameter tensor's trust ratio from partial norms over the
//! shards that cut it, combined in shard order, so ZeRO stages 0-3 give bitwise-identical
//! parameters at one world size, with the optimizer state in place or offloaded to the host;
//! what LAMB does not support is refused at build, naming the key.

mod common;

use std::time::Duration;

use common::runs::toy_batches;
use common::scratch::Scratch;
use common::{config, lamb, toy};
use ferrozero_config::resolved::{Bf16State, OffloadTarget, Precision, ResolvedConfig, ZeroStage};
use ferrozero_runtime::comm::local::run_ranks;
use ferrozero_runtime::engine::checkpoint::Tag;
use ferrozero_runtime::engine::optimizer_overlap::OptimizerOverlap;
use ferrozero_runtime::engine::{Engine, NamedTensor};

const V: usize = 11;
const D: usize = 6;
const T: usize = 5;
const LAYERS: usize = 2;
fn lamb_config(stage: ZeroStage, world: usize, precision: Precision) -> ResolvedConfig {
    let mut cfg = config(stage, world, 2, 2, precision);
    cfg.optimizer = lamb(2e-2);
    cfg
}

/// Rank 0's parameters and losses after `steps` steps of the toy model (`common::runs`).
fn train(cfg: &ResolvedConfig, steps: usize) -> (Vec<NamedTensor>, Vec<f64>) {
    let r = common::runs::train_steps(cfg, steps);
    (r.params, r.losses)
}

use common::runs::named_bits as bits;

/// Every stage, with and without overlapped communication and optimizer offload, against the
/// first run.
fn check_stages_identical(world: usize, precision: Precision) {
    let mut reference = None;
    for stage in common::STAGES {
        for (overlap, offload) in [(false, false), (true, false), (false, true), (true, true)] {
            let mut cfg = lamb_config(stage, world, precision.clone());
            cfg.zero.overlap_comm = overlap;
            if offload {
                cfg.zero.offload_optimizer.target = OffloadTarget::Cpu;
            }
            let what = format!(
                "stage {stage:?} world {world} {precision:?} overlap {overlap} offload {offload}"
            );
            let (params, losses) = train(&cfg, 12);
            assert!(losses.iter().all(|l| l.is_finite()), "{what}: {losses:?}");
            match &reference {
                None => reference = Some((bits(&params), losses)),
                Some((rb, rl)) => {
                    assert_eq!(rl, &losses, "losses differ: {what}");
                    assert!(rb == &bits(&params), "parameters differ: {what}");
                }
            }
        }
    }
}

#[test]
fn lamb_stages_bitwise_identical_f32() {
    check_stages_identical(2, Precision::F32);
}

#[test]
fn lamb_stages_bitwise_identical_bf16() {
    check_stages_identical(2, Precision::Bf16);
}

#[test]
fn lamb_one_rank_matches_its_stages_too() {
    check_stages_identical(1, Precision::F32);
}

#[test]
fn lamb_is_not_adam() {
    // The same run with AdamW's moments and no trust ratio ends elsewhere.
    let cfg = lamb_config(ZeroStage::Stage2, 2, Precision::F32);
    let mut adam = cfg.clone();
    adam.optimizer = common::config(ZeroStage::Stage2, 2, 2, 2, Precision::F32).optimizer;
    assert!(bits(&train(&cfg, 3).0) != bits(&train(&adam, 3).0));
}

fn build_error(cfg: &ResolvedConfig) -> String {
    let r = run_ranks(cfg.world_size, Duration::from_secs(30), |comm| {
        Engine::new(toy::model(V, D, T, LAYERS), cfg.clone(), comm).map(|_| ())
    });
    match r {
        Ok(_) => panic!("the engine was built"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn unsupported_placements_are_refused_by_name() {
    let scratch = Scratch::new();
    let mut nvme = lamb_config(ZeroStage::Stage3, 1, Precision::Bf16);
    nvme.zero.offload_optimizer.target = OffloadTarget::Nvme(scratch.dir());
    let e = build_error(&nvme);
    assert!(
        e.contains("optimizer.type = \"Lamb\"") && e.contains("NVMe"),
        "{e}"
    );

    let mut params = lamb_config(ZeroStage::Stage3, 1, Precision::Bf16);
    params.zero.offload_param.target = OffloadTarget::Nvme(scratch.dir());
    let e = build_error(&params);
    assert!(e.contains("offload_param.device"), "{e}");

    let mut bf16 = lamb_config(ZeroStage::Stage2, 1, Precision::Bf16);
    bf16.zero.offload_optimizer.target = OffloadTarget::Cpu;
    bf16.bf16_state = Bf16State {
        master_weights_and_grads: true,
        optimizer_states: false,
    };
    let e = build_error(&bf16);
    assert!(e.contains("bf16_master_weights_and_grads"), "{e}");
    // bf16 states where the optimizer runs, as the device's Adam keeps them: not LAMB's.
    let mut states = lamb_config(ZeroStage::Stage2, 1, Precision::Bf16);
    states.bf16_state = Bf16State {
        master_weights_and_grads: true,
        optimizer_states: true,
    };
    let e = build_error(&states);
    assert!(
        e.contains("optimizer.type") && e.contains("bf16_optimizer_states"),
        "{e}"
    );

    // The optimizer lane, forced on, is refused rather than run without the global norms.
    let mut lane = lamb_config(ZeroStage::Stage2, 1, Precision::F32);
    lane.zero.offload_optimizer.target = OffloadTarget::Cpu;
    let r = run_ranks(1, Duration::from_secs(30), |comm| {
        let be = ferrozero_runtime::backend::cpu();
        let model = toy::model(V, D, T, LAYERS);
        Engine::with_backend_and_overlap(model, lane.clone(), comm, be, OptimizerOverlap::On)
            .map(|_| ())
    });
    let e = r.expect_err("the lane was armed").to_string();
    assert!(e.contains("does not overlap"), "{e}");
}

/// LAMB's state is Adam's two moments in the same layout: a checkpoint saved at stage 1
/// resumes at stage 3 (each rank reading its new shard) to the bits of the run that never
/// stopped.
#[test]
fn lamb_checkpoint_resumes_exactly_across_stages() {
    let save_cfg = lamb_config(ZeroStage::Stage1, 2, Precision::Bf16);
    let load_cfg = lamb_config(ZeroStage::Stage3, 2, Precision::Bf16);
    let (whole, _) = train(&save_cfg, 4);
    let dir = tempfile::tempdir().unwrap();
    // Both configs have the same world, micro-batch and accumulation: the same rows.
    let step = |e: &mut Engine, s: usize, rank: usize| {
        e.train_batch(&toy_batches(&save_cfg, (V, T), s, rank))
            .map(|_| ())
    };
    run_ranks(2, Duration::from_secs(60), |comm| {
        let rank = comm.rank();
        let mut e = Engine::new(toy::model(V, D, T, LAYERS), save_cfg.clone(), comm)?;
        step(&mut e, 0, rank)?;
        step(&mut e, 1, rank)?;
        e.save_checkpoint(dir.path(), "two", 2).map(|_| ())
    })
    .expect("save failed");
    let resumed = run_ranks(2, Duration::from_secs(60), |comm| {
        let rank = comm.rank();
        let mut f = Engine::new(toy::model(V, D, T, LAYERS), load_cfg.clone(), comm)?;
        f.load_checkpoint(dir.path(), &Tag::Latest)?;
        step(&mut f, 2, rank)?;
        step(&mut f, 3, rank)?;
        f.parameters()
    })
    .expect("resume failed");
    assert!(bits(&whole) == bits(&resumed[0]), "the resumed run differs");
}

/// The shard group is where LAMB's partials are gathered: under MiCS (`mics_shard_size` 2
/// at world 4: two groups of two) each tensor's norm comes from its group's two shards, and
/// the run trains like plain stage 3 at world 4 (within 1e-5: only the gradients' sum order
/// differs); under hpZ (state sharded over all four) it is plain stage 3's bits.
#[test]
fn lamb_under_mics_and_hpz_gathers_within_the_shard_group() {
    let plain = lamb_config(ZeroStage::Stage3, 4, Precision::F32);
    let (p_plain, l_plain) = train(&plain, 6);
    let mut mics = plain.clone();
    mics.zero.mics_shard_size = 2;
    let (p_mics, l_mics) = train(&mics, 6);
    for (a, b) in l_plain.iter().zip(&l_mics) {
        assert!((a - b).abs() <= 1e-5 * a.abs(), "losses {a} vs {b}");
    }
    for (x, y) in p_plain.iter().zip(&p_mics) {
        for (a, b) in x.data.iter().zip(&y.data) {
            let tol = 1e-5 * a.abs().max(b.abs()).max(1e-2);
            assert!((a - b).abs() <= tol, "{}: {a} vs {b}", x.name);
        }
    }
    let mut hpz = plain.clone();
    hpz.zero.hpz_partition_size = 2;
    assert!(
        bits(&p_plain) == bits(&train(&hpz, 6).0),
        "hpZ changed LAMB's bits"
    );
}
