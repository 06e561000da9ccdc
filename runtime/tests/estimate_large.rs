//! The estimator on models too big to allocate (Llama 7B/13B): it answers from parameter specs
//! alone, its model-state bytes follow the ZeRO formulas, and its suggestions are the
//! cheapest change that really fits.

mod common;

use std::time::Instant;

use common::{checkpointing, config};
use ferrozero_config::resolved::{OffloadTarget, Precision, ZeroStage};
use ferrozero_runtime::engine::estimate::shape::preset;
use ferrozero_runtime::engine::estimate::{estimate, suggest, Budget, Change};
use ferrozero_runtime::engine::ledger::Category;

const GIB: u64 = 1 << 30;

/// DeepSpeed's bucket and tile sizes (the tests' common config tiles by 17 elements, which a
/// 13B step would take hundreds of millions of tiles to run).
fn big_buckets(cfg: &mut ferrozero_config::resolved::ResolvedConfig) {
    cfg.zero.reduce_bucket_size = 500_000_000;
    cfg.zero.allgather_bucket_size = 500_000_000;
    cfg.zero.sub_group_size = 1_000_000_000;
}

#[test]
fn llama_13b_model_states_follow_the_zero_formulas_without_allocating() {
    let shape = preset("llama-13b").unwrap();
    let n = shape.model.num_params() as f64;
    let t = Instant::now();
    for world in [1usize, 8] {
        let w = world as f64;
        for (stage, per_param) in [
            (ZeroStage::Stage0, 16.0),
            (ZeroStage::Stage1, 4.0 + 12.0 / w),
            (ZeroStage::Stage2, 2.0 + 14.0 / w),
            (ZeroStage::Stage3, 16.0 / w),
        ] {
            // Two micro-batches per step: the formulas count a bf16 gradient accumulator (at
            // one, one rank holds the f32 gradient to the step instead).
            let mut cfg = config(stage, world, 1, 2, Precision::Bf16);
            big_buckets(&mut cfg);
            let e = estimate(&shape.model, &cfg, 1, 2048).unwrap();
            let states: u64 = [
                Category::Parameters,
                Category::Gradients,
                Category::OptimizerState,
            ]
            .iter()
            .map(|&c| e.device.category(c))
            .sum();
            let want = per_param * n;
            assert!(
                (states as f64 - want).abs() / want < 0.01,
                "{stage:?} x{world}: {states} vs {want}"
            );
            // Peak adds activations, buffers and working copies on top, never less.
            assert!(e.device.peak_bytes > states);
        }
    }
    // 16 estimates (32 steps run on the size-only device) of a 13B model: quick.
    assert!(t.elapsed().as_secs_f64() < 10.0, "{:?}", t.elapsed());
}

#[test]
fn offload_moves_state_to_host_and_nvme() {
    let shape = preset("llama-7b").unwrap();
    let mut cfg = config(ZeroStage::Stage3, 8, 1, 1, Precision::Bf16);
    big_buckets(&mut cfg);
    let base = estimate(&shape.model, &cfg, 1, 1024).unwrap();
    cfg.zero.offload_optimizer.target = OffloadTarget::Cpu;
    cfg.zero.offload_optimizer.pin_memory = true;
    let cpu = estimate(&shape.model, &cfg, 1, 1024).unwrap();
    let opt = base.device.category(Category::OptimizerState);
    assert_eq!(cpu.device.category(Category::OptimizerState), 0);
    assert_eq!(cpu.host.category(Category::OptimizerState), opt);
    assert_eq!(cpu.pinned_host_bytes, opt);
    // The gradient accumulators follow the optimizer state off the device.
    let grads = base.device.category(Category::Gradients);
    assert!(grads > 0);
    assert_eq!(cpu.device.category(Category::Gradients), 0);
    assert_eq!(cpu.host.category(Category::Gradients), grads);
    cfg.zero.offload_optimizer.target = OffloadTarget::Nvme("/nvme".into());
    cfg.zero.offload_param.target = OffloadTarget::Nvme("/nvme".into());
    let nvme = estimate(&shape.model, &cfg, 1, 1024).unwrap();
    assert_eq!(nvme.nvme.category(Category::OptimizerState), opt);
    assert!(nvme.nvme.category(Category::Parameters) > 0);
    assert_eq!(nvme.device.category(Category::Parameters), 0);
    // NVMe swaps need pinned staging on the host even though the state is on disk.
    assert!(nvme.swap_buffer_bytes > 0);
    assert_eq!(nvme.pinned_host_bytes, nvme.swap_buffer_bytes);
}

#[test]
fn cpu_checkpointing_moves_unit_inputs_to_the_host() {
    let shape = preset("llama-7b").unwrap();
    let mut cfg = config(ZeroStage::Stage3, 8, 1, 1, Precision::Bf16);
    big_buckets(&mut cfg);
    cfg.activation_checkpointing = Some(checkpointing(true));
    let e = estimate(&shape.model, &cfg, 1, 1024).unwrap();
    // 32 block inputs, 1024 x 4096 f32 each; the head runs its forward and backward at once
    // in `train_batch`, so it keeps no input.
    let inputs = 32 * 1024 * 4096 * 4;
    assert_eq!(e.host.category(Category::Activations), inputs);
    assert!(e.activations.with_checkpointing < e.activations.without_checkpointing);
}

#[test]
fn suggestion_is_the_first_single_change_that_fits() {
    let shape = preset("llama-7b").unwrap();
    let mut cfg = config(ZeroStage::Stage0, 8, 1, 1, Precision::Bf16);
    big_buckets(&mut cfg);
    let e = estimate(&shape.model, &cfg, 1, 256).unwrap();
    let budget = Budget {
        device_bytes: 40 * GIB,
        host_bytes: 64 * GIB,
    };
    assert!(!budget.fits(&e), "stage 0 7B must not fit 40 GiB");
    let s = suggest(&shape.model, &cfg, 1, 256, budget).expect("something fits");
    assert!(budget.fits(&s.estimate));
    // Checkpointing alone leaves 16 B/param of model state (> 100 GiB): not enough, so the
    // first single change that fits is a higher stage, and the lowest one that fits.
    assert!(budget.fits(
        &estimate(
            &shape.model,
            &{
                let mut c = cfg.clone();
                c.zero.stage = ZeroStage::Stage3;
                c
            },
            1,
            256
        )
        .unwrap()
    ));
    assert_eq!(s.changes.len(), 1, "{:?}", s.changes);
    let Change::Stage(st) = s.changes[0] else {
        panic!("expected a stage change, got {:?}", s.changes);
    };
    for lower in 1..st {
        let mut c = cfg.clone();
        c.zero.stage = [ZeroStage::Stage1, ZeroStage::Stage2][lower as usize - 1];
        assert!(!budget.fits(&estimate(&shape.model, &c, 1, 256).unwrap()));
    }
}

#[test]
fn combined_changes_when_no_single_one_fits_and_none_when_nothing_does() {
    let shape = preset("llama-13b").unwrap();
    // Eight ranks: at one rank the engine keeps 2 B/param of gradients on the device even
    // with every offload, which no 24 GiB device holds for 13B.
    let mut cfg = config(ZeroStage::Stage0, 8, 4, 1, Precision::Bf16);
    big_buckets(&mut cfg);
    let budget = Budget {
        device_bytes: 24 * GIB,
        host_bytes: 1024 * GIB,
    };
    let s = suggest(&shape.model, &cfg, 4, 4096, budget).expect("offload + checkpointing fits");
    assert!(s.changes.len() > 1, "{:?}", s.changes);
    assert!(budget.fits(&s.estimate));
    let tiny = Budget {
        device_bytes: GIB / 4,
        host_bytes: GIB,
    };
    assert!(suggest(&shape.model, &cfg, 4, 4096, tiny).is_none());
}

#[test]
fn preflight_passes_what_fits_and_explains_what_does_not() {
    let shape = preset("llama-7b").unwrap();
    let mut cfg = config(ZeroStage::Stage0, 8, 1, 1, Precision::Bf16);
    big_buckets(&mut cfg);
    let roomy = Budget {
        device_bytes: 1024 * GIB,
        host_bytes: 1024 * GIB,
    };
    let e =
        ferrozero_runtime::engine::estimate::preflight(&shape.model, &cfg, 1, 256, roomy).unwrap();
    assert!(e.device.peak_bytes > 100 * GIB);
    let small = Budget {
        device_bytes: 40 * GIB,
        host_bytes: 64 * GIB,
    };
    let err = ferrozero_runtime::engine::estimate::preflight(&shape.model, &cfg, 1, 256, small)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("per rank") && err.contains("zero_optimization.stage"),
        "{err}"
    );
}
