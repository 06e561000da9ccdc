//! Offload changes where bytes live, not the math: optimizer state and stage-3 parameters on
//! the host or on NVMe give bitwise-identical parameters to the run without offload.

mod common;

use std::time::Duration;

use common::scratch::Scratch;
use common::{config, toy};
use ferrozero_config::resolved::{OffloadTarget, Precision, ResolvedConfig, ZeroStage};
use ferrozero_runtime::comm::local::run_ranks;
use ferrozero_runtime::engine::ledger::{Category, Location};
use ferrozero_runtime::engine::Engine;

fn train(cfg: &ResolvedConfig, steps: usize) -> (Vec<Vec<u32>>, u64) {
    let world = cfg.world_size;
    let out = run_ranks(world, Duration::from_secs(60), |comm| {
        let rank = comm.rank();
        let mut e = Engine::new(toy::model(11, 6, 5, 2), cfg.clone(), comm)?;
        for s in 0..steps {
            e.train_batch(&[toy::batch(11, 5, (s * world + rank) * 2, 2)])?;
        }
        let bits: Vec<u32> = e
            .parameters()?
            .iter()
            .flat_map(|t| t.data.iter().map(|x| x.to_bits()))
            .collect();
        Ok((
            bits,
            e.ledger().peak(Location::Device, Category::OptimizerState),
        ))
    })
    .expect("training failed");
    let dev = out[0].1;
    (out.into_iter().map(|o| o.0).collect(), dev)
}

#[test]
fn every_offload_combination_is_bitwise_identical() {
    let scratch = Scratch::new();
    for world in [1, 2] {
        let base = config(ZeroStage::Stage3, world, 2, 1, Precision::Bf16);
        let (reference, dev_none) = train(&base, 20);
        let targets = || {
            [
                OffloadTarget::None,
                OffloadTarget::Cpu,
                OffloadTarget::Nvme(scratch.dir()),
            ]
        };
        let combos = targets()
            .into_iter()
            .flat_map(|o| targets().into_iter().map(move |p| (o.clone(), p)))
            .filter(|c| *c != (OffloadTarget::None, OffloadTarget::None));
        for (opt, param) in combos {
            let mut cfg = base.clone();
            cfg.zero.offload_optimizer.target = opt.clone();
            cfg.zero.offload_param.target = param.clone();
            let (got, dev) = train(&cfg, 20);
            assert!(got == reference, "world {world}: offload_optimizer {opt:?} offload_param {param:?} changed the result");
            if opt != OffloadTarget::None {
                assert_eq!(dev, 0, "optimizer state still counted on the device");
                assert!(dev_none > 0);
            }
        }
    }
}

#[test]
fn nvme_parameters_in_f32_and_with_overlap_and_checkpointing() {
    let scratch = Scratch::new();
    // f32 has no master copy, so the step reads each shard before updating it in place;
    // overlap and checkpointing change when shards are read ahead and re-gathered.
    // max_in_cpu = 0 turns read-ahead off: every shard is read when its gather needs it.
    for (precision, overlap, max_in_cpu) in [
        (Precision::F32, false, 1 << 30),
        (Precision::Bf16, true, 1 << 30),
        (Precision::Bf16, false, 0),
    ] {
        let mut base = config(ZeroStage::Stage3, 2, 2, 1, precision.clone());
        base.zero.overlap_comm = overlap;
        base.zero.max_reuse_distance = 0;
        if overlap {
            base.activation_checkpointing = Some(common::checkpointing(false));
        }
        let mut nv = base.clone();
        nv.zero.offload_param.target = OffloadTarget::Nvme(scratch.dir());
        nv.zero.offload_param.buffer_count = 2;
        nv.zero.offload_param.max_in_cpu = max_in_cpu;
        assert!(
            train(&base, 8).0 == train(&nv, 8).0,
            "{precision:?} overlap {overlap} max_in_cpu {max_in_cpu}"
        );
    }
}

#[test]
fn nvme_parameter_shards_larger_than_a_swap_buffer_are_refused() {
    let scratch = Scratch::new();
    let mut cfg = config(ZeroStage::Stage3, 1, 2, 1, Precision::Bf16);
    cfg.zero.offload_param.target = OffloadTarget::Nvme(scratch.dir());
    cfg.zero.offload_param.buffer_size = 8;
    let err = run_ranks(1, Duration::from_secs(10), |comm| {
        Engine::new(toy::model(11, 6, 5, 1), cfg.clone(), comm).map(|_| ())
    })
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("offload_param.buffer_size = 8") && err.contains("raise buffer_size"),
        "{err}"
    );
}

#[test]
fn nvme_optimizer_offload_in_stage_1_and_2() {
    let scratch = Scratch::new();
    for stage in [ZeroStage::Stage1, ZeroStage::Stage2] {
        let base = config(stage, 2, 2, 1, Precision::Bf16);
        let mut nv = base.clone();
        nv.zero.offload_optimizer.target = OffloadTarget::Nvme(scratch.dir());
        assert!(train(&base, 8).0 == train(&nv, 8).0, "{stage:?}");
    }
}

#[test]
fn unsupported_offload_is_refused_clearly() {
    let scratch = Scratch::new();
    let mut cfg = config(ZeroStage::Stage3, 1, 2, 1, Precision::F32);
    cfg.zero.offload_optimizer.target = OffloadTarget::Nvme(scratch.dir());
    let err = run_ranks(1, Duration::from_secs(10), |comm| {
        Engine::new(toy::model(11, 6, 5, 1), cfg.clone(), comm).map(|_| ())
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("bf16 or fp16"), "{err}");
}

#[test]
fn nvme_parameters_leave_memory_and_the_ledger_says_so() {
    let scratch = Scratch::new();
    let dir = scratch.dir();
    let mut cfg = config(ZeroStage::Stage3, 2, 2, 1, Precision::Bf16);
    cfg.zero.offload_param.target = OffloadTarget::Nvme(dir.clone());
    cfg.zero.offload_param.buffer_count = 2;
    let out = run_ranks(2, Duration::from_secs(60), |comm| {
        let rank = comm.rank();
        let mut e = Engine::new(toy::model(11, 6, 5, 2), cfg.clone(), comm)?;
        for s in 0..3 {
            e.train_batch(&[toy::batch(11, 5, s * 2 + rank, 2)])?;
        }
        let files = std::fs::read_dir(dir.join("params").join(format!("rank{rank}")))
            .map(|d| d.count())
            .unwrap_or(0);
        let l = e.ledger();
        Ok((
            files,
            l.peak(Location::Device, Category::Parameters),
            l.peak(Location::Nvme, Category::Parameters),
            l.peak(Location::Host, Category::Prefetch),
            l.current(Location::Host, Category::Prefetch),
        ))
    })
    .expect("training failed");
    for (rank, (files, dev, nvme, host_peak, host_now)) in out.into_iter().enumerate() {
        // One swap file per group (3 units) plus the directory's lock file.
        assert!(
            files >= 3,
            "rank {rank}: {files} files in the swap directory"
        );
        assert_eq!(
            dev, 0,
            "rank {rank}: parameters still counted on the device"
        );
        assert!(nvme > 0, "rank {rank}: no parameters counted on NVMe");
        // Shards pass through at most buffer_count host buffers, and none stay after a step.
        assert!(
            host_peak > 0 && host_peak <= 2 * nvme,
            "rank {rank}: {host_peak}"
        );
        assert_eq!(
            host_now, 0,
            "rank {rank}: swap buffers still held after the step"
        );
    }
}

/// Parameters' bits and rank 0's (device, host) gradient-accumulator bytes after `steps`
/// steps of `gradient_accumulation_steps` micro-batches each.
fn train_accumulating(cfg: &ResolvedConfig, steps: usize) -> (Vec<Vec<u32>>, (u64, u64)) {
    let (world, gas) = (cfg.world_size, cfg.gradient_accumulation_steps);
    let out = run_ranks(world, Duration::from_secs(60), |comm| {
        let rank = comm.rank();
        let mut e = Engine::new(toy::model(11, 6, 5, 2), cfg.clone(), comm)?;
        // Accumulators on the device even at one micro-step per step (there the gradient
        // would otherwise move into place: `device_grad_move.rs`).
        e.accumulate_gradients()?;
        for s in 0..steps {
            let batches: Vec<_> = (0..gas)
                .map(|m| toy::batch(11, 5, ((s * gas + m) * world + rank) * 2, 2))
                .collect();
            e.train_batch(&batches)?;
        }
        let bits = e
            .parameters()?
            .iter()
            .flat_map(|t| t.data.iter().map(|x| x.to_bits()))
            .collect();
        let grads = |l| e.ledger().peak(l, Category::Gradients);
        Ok((bits, (grads(Location::Device), grads(Location::Host))))
    })
    .expect("training failed");
    let grads = out[0].1;
    (out.into_iter().map(|o| o.0).collect(), grads)
}

/// With the optimizer in host memory the gradient accumulators are there too (they leave the
/// device bucket by bucket in backward), and the bits are those of the run that accumulates
/// on the device: stages 1-3, one and two ranks, one and three micro-steps, with and without
/// `overlap_comm` (clipping at DeepSpeed's 1.0, so the optimizer overlap is speculative).
#[test]
fn host_gradient_accumulators_change_no_bit() {
    for stage in [ZeroStage::Stage1, ZeroStage::Stage2, ZeroStage::Stage3] {
        for (world, gas, overlap) in [(1, 1, false), (1, 3, true), (2, 1, true), (2, 3, false)] {
            let what = format!("{stage:?} world {world} gas {gas} overlap {overlap}");
            let mut base = config(stage, world, 2, gas, Precision::Bf16);
            base.zero.overlap_comm = overlap;
            let (reference, (dev, host)) = train_accumulating(&base, 4);
            assert!(dev > 0 && host == 0, "{what}: accumulators {dev} {host}");
            let mut cfg = base.clone();
            cfg.zero.offload_optimizer.target = OffloadTarget::Cpu;
            let (got, moved) = train_accumulating(&cfg, 4);
            assert_eq!(
                moved,
                (0, dev),
                "{what}: the accumulators are not in host memory"
            );
            assert!(got == reference, "{what}: offload changed the result");
        }
    }
}
