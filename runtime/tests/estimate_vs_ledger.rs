//! The estimate, and the size-only ("meta") engine run it is, against the CPU engine's ledger:
//! for GPT-2 and Llama (LoRA and frozen variants too), one step on the CPU (every rank run)
//! and the same step on `MetaBackend` with `MetaComm` (rank 0 alone, standing for the world)
//! hold the same bytes, every location and category of the ledger equal, and the estimate
//! reports those bytes, not close ones: stages 0-3, one and two ranks, offload (NVMe for the
//! optimizer's tiles and stage 3's parameter shards included, whose directory the size-only
//! run never creates), activation checkpointing on the device and the CPU, overlap, hpZ,
//! MiCS, gradient accumulation, f32/bf16/fp16, LAMB, ZeRO++, f32 accumulators, bf16 optimizer
//! states and large buckets. Then what only the estimate reports: both checkpointing modes'
//! activations, a bounded overlap's snapshots, and how its figures move with the config.
//! (Modules that compute with host loops, like the tests' toy, run on the CPU backend only,
//! so the estimate cannot price them.)

mod common;

use std::time::Duration;

use common::ledgers::{one_and_two_ranks, Ckpt, Offload, Sweep, SEQ};
use common::models::{batches, build, Which, MICRO};
use common::{comms_logger, config, lamb, STAGES};
use ferrozero_config::resolved::{
    CommDataType, OffloadTarget, Precision, ResolvedConfig, ZeroStage,
};
use ferrozero_runtime::comm::local::run_ranks;
use ferrozero_runtime::engine::estimate::estimate;
use ferrozero_runtime::engine::ledger::{Category, Location};
use ferrozero_runtime::engine::Engine;

/// Stages 0-3 at one and two ranks in each of `precisions`, every offload that applies (the
/// NVMe one in bf16), checkpointing off, on the device and on the CPU, each without and with
/// overlap (and the opposite stage-3 reuse rule).
fn sweep(which: Which, precisions: &[Precision]) {
    let mut s = Sweep::new();
    for (stage, world) in one_and_two_ranks(&STAGES) {
        for p in precisions {
            for offload in [
                Offload::None,
                Offload::Optimizer,
                Offload::OptimizerAndParams,
                Offload::ParamsOnNvme,
            ] {
                let stage3_only = !matches!(offload, Offload::None | Offload::Optimizer);
                let nvme = offload == Offload::ParamsOnNvme;
                if stage3_only && stage != ZeroStage::Stage3 || nvme && *p != Precision::Bf16 {
                    continue;
                }
                for ckpt in [Ckpt::Off, Ckpt::Device, Ckpt::Cpu] {
                    let cfg = s.config((stage, world), p.clone(), offload, ckpt);
                    s.check_overlapped(which, &cfg);
                }
            }
        }
    }
    s.finish(108 * precisions.len() + 12);
}

#[test]
fn gpt2_matches_the_cpu_ledger_in_every_mode() {
    sweep(Which::Gpt2, &[Precision::Bf16, Precision::F32]);
}

#[test]
fn llama_matches_the_cpu_ledger_in_every_mode() {
    sweep(Which::Llama, &[Precision::Bf16, Precision::F32]);
}

/// Frozen parameters hold no gradient, master weights or moments, whatever the stage and
/// offload.
#[test]
fn llama_with_lora_and_a_frozen_base_matches_the_cpu_ledger_in_every_mode() {
    sweep(Which::LlamaLora, &[Precision::Bf16]);
}

/// Units below the backward floor keep nothing for backward and run none.
#[test]
fn gpt2_frozen_below_the_backward_floor_matches_the_cpu_ledger_in_every_mode() {
    assert_eq!(build(Which::Gpt2BottomFrozen).backward_floor(), 2);
    sweep(Which::Gpt2BottomFrozen, &[Precision::Bf16]);
}

fn fp16() -> Precision {
    Precision::Fp16(common::dynamic_scaling(16, 1000, 2))
}

/// `cfg` with one micro-step per step.
fn one_micro_step(mut cfg: ResolvedConfig) -> ResolvedConfig {
    cfg.gradient_accumulation_steps = 1;
    cfg.train_batch_size = MICRO * cfg.world_size;
    cfg
}

/// fp16 with its dynamic loss scale (optimizer offloaded), with two micro-steps and one. One
/// micro-step per step in f32 and bf16: the reduced gradient moves into place (f32 at one rank,
/// the wire dtype at two) and is held to the step instead of an accumulator living throughout;
/// beside offloaded optimizer state it still goes down bucket by bucket; with and without
/// overlap. An fp16 wire under bf16 storage rounds twice, so its accumulator stays.
#[test]
fn precisions_and_single_micro_steps_match_the_cpu_ledger() {
    let mut s = Sweep::new();
    for which in [Which::Gpt2, Which::Llama] {
        for (stage, world) in one_and_two_ranks(&STAGES) {
            let cfg = s.config((stage, world), fp16(), Offload::Optimizer, Ckpt::Off);
            s.check(which, &cfg);
            s.check(which, &one_micro_step(cfg));
            for p in [Precision::F32, Precision::Bf16] {
                for offload in [Offload::None, Offload::Optimizer] {
                    let c = s.config((stage, world), p.clone(), offload, Ckpt::Off);
                    let mut cfg = one_micro_step(c);
                    s.check(which, &cfg);
                    cfg.zero.overlap_comm = true;
                    s.check(which, &cfg);
                }
            }
        }
    }
    for world in [1, 2] {
        let c = s.config(
            (ZeroStage::Stage2, world),
            Precision::Bf16,
            Offload::None,
            Ckpt::Off,
        );
        let mut cfg = one_micro_step(c);
        cfg.comms.data_type = Some(CommDataType::Fp16);
        s.check(Which::Gpt2, &cfg);
    }
    s.finish(162);
}

/// The gradient held to the step at one rank with one micro-step is the f32 one: GPT-2 tiny's
/// padded parameters (its bf16 accumulators' bytes over 2) at 4 bytes each.
#[test]
fn one_micro_step_holds_the_f32_gradient_at_one_rank() {
    let s = Sweep::new();
    let at = (ZeroStage::Stage0, 1);
    let cfg = s.config(at, Precision::Bf16, Offload::None, Ckpt::Off);
    let grads = |c: &ResolvedConfig| {
        let e = estimate(&build(Which::Gpt2), c, MICRO, SEQ).unwrap();
        e.device.category(Category::Gradients)
    };
    let params = grads(&cfg) / 2;
    let mut moved = one_micro_step(cfg);
    moved.zero.overlap_comm = true;
    assert_eq!(grads(&moved), params * 4, "f32 gradients held at one rank");
}

/// hpZ's secondary partition and MiCS's groups at four ranks, with and without overlap.
#[test]
fn hpz_and_mics_match_the_cpu_ledger() {
    let mut s = Sweep::new();
    for which in [Which::Gpt2, Which::Llama] {
        for overlap in [false, true] {
            let at = (ZeroStage::Stage3, 4);
            let mut hpz = s.config(at, Precision::Bf16, Offload::None, Ckpt::Off);
            hpz.zero.hpz_partition_size = 2;
            hpz.zero.overlap_comm = overlap;
            s.check(which, &hpz);
            let mut mics = s.config(at, Precision::Bf16, Offload::Optimizer, Ckpt::Off);
            mics.zero.mics_shard_size = 2;
            mics.zero.overlap_comm = overlap;
            s.check(which, &mics);
        }
    }
    s.finish(8);
}

/// LAMB's two passes, on the device's state and offloaded (where the host backend runs them:
/// the meta device's host is itself).
#[test]
fn lamb_matches_the_cpu_ledger() {
    let mut s = Sweep::new();
    for (stage, world) in one_and_two_ranks(&STAGES) {
        for offload in [Offload::None, Offload::Optimizer] {
            let mut cfg = s.config((stage, world), Precision::Bf16, offload, Ckpt::Off);
            cfg.optimizer = lamb(2e-2);
            s.check(Which::Llama, &cfg);
        }
    }
    s.finish(16);
}

/// ZeRO++ qwZ and qgZ hold packed words (and qgZ f32 sums) while a gather or reduction runs,
/// quantized frozen weights alone too, on the device and everything offloaded with overlap;
/// the staging is priced at all: qgZ's raises the reductions' peak, qwZ's (and the frozen
/// parameters' alone) raises it in forward where a LoRA base's frozen parameters are gathered
/// (GPT-2's forward gathers stay below backward's reduction peak). And the communication
/// logger's decorator over the meta communicator, its splits included (MiCS).
#[test]
fn zeropp_and_logged_communication_match_the_cpu_ledger() {
    let mut s = Sweep::new();
    for which in [Which::Llama, Which::Gpt2, Which::LlamaLora] {
        for (w, g, frozen) in [
            (true, false, false),
            (false, true, false),
            (true, true, false),
            (false, false, true),
        ] {
            for (offload, overlap) in [(Offload::None, false), (Offload::OptimizerAndParams, true)]
            {
                let at = (ZeroStage::Stage3, 2);
                let mut plain = s.config(at, Precision::Bf16, offload, Ckpt::Off);
                plain.zero.overlap_comm = overlap;
                let mut cfg = plain.clone();
                (cfg.zero.quantized_weights, cfg.zero.quantized_gradients) = (w, g);
                cfg.zero.quantized_nontrainable_weights = frozen;
                s.check(which, &cfg);
                let comm = |c: &ResolvedConfig| {
                    let e = estimate(&build(which), c, MICRO, SEQ).unwrap();
                    e.device.category(Category::CommBuffers)
                };
                let must_grow = g || which == Which::LlamaLora;
                if must_grow && comm(&cfg) <= comm(&plain) {
                    s.fail(format!("{which:?} qwZ {w} qgZ {g}: staging not priced"));
                }
            }
        }
    }
    for which in [Which::Gpt2, Which::LlamaLora] {
        let at = (ZeroStage::Stage3, 4);
        let mut logged = s.config(at, Precision::Bf16, Offload::None, Ckpt::Off);
        logged.zero.mics_shard_size = 2;
        logged.monitor.comms_logger = Some(comms_logger());
        s.check(which, &logged);
    }
    s.finish(26);
}

/// NVMe: optimizer tiles on NVMe (stages 1-3), the pool locked or not, few or many swap
/// buffers, tiles small enough that a group's state spans several (the last one short); and
/// stage 3's parameter shards on NVMe with the optimizer in memory, on the host or on NVMe too,
/// read-ahead on and off; each without and with overlap.
#[test]
fn nvme_matches_the_cpu_ledger_and_the_size_only_run_touches_no_file() {
    let mut s = Sweep::new();
    let mut configs = Vec::new();
    for world in [1, 2] {
        for stage in [ZeroStage::Stage1, ZeroStage::Stage2, ZeroStage::Stage3] {
            for (pin, count) in [(false, 4), (true, 2)] {
                let mut cfg = s.config((stage, world), Precision::Bf16, Offload::None, Ckpt::Off);
                let o = &mut cfg.zero.offload_optimizer;
                (o.target, o.pin_memory, o.buffer_count) = (nvme(&s), pin, count);
                cfg.zero.sub_group_size = if pin { 1000 } else { 1 << 20 };
                configs.push(cfg);
            }
        }
        for (opt, count, max_in_cpu, ckpt) in [
            (OffloadTarget::None, 2, 1_000_000_000, Ckpt::Off),
            (OffloadTarget::Cpu, 5, 0, Ckpt::Device),
            (nvme(&s), 3, 1_000_000_000, Ckpt::Cpu),
        ] {
            let at = (ZeroStage::Stage3, world);
            let mut cfg = s.config(at, Precision::Bf16, Offload::None, ckpt);
            cfg.zero.offload_optimizer.target = opt;
            let p = &mut cfg.zero.offload_param;
            (p.target, p.buffer_count, p.max_in_cpu) = (nvme(&s), count, max_in_cpu);
            p.pin_memory = count == 5;
            configs.push(cfg);
        }
    }
    for which in [Which::Llama, Which::Gpt2] {
        for cfg in &configs {
            for overlap in [false, true] {
                let mut cfg = cfg.clone();
                cfg.zero.overlap_comm = overlap;
                s.check(which, &cfg);
            }
        }
    }
    s.finish(72);
}

fn nvme(s: &Sweep) -> OffloadTarget {
    OffloadTarget::Nvme(s.dir())
}

/// Buckets above every group size take the unchunked paths; the persistence threshold keeps
/// small stage-3 groups whole.
#[test]
fn large_buckets_and_persistence_threshold_match_the_cpu_ledger() {
    let mut s = Sweep::new();
    for threshold in [0, 2_000, 100_000] {
        for which in [Which::Llama, Which::Gpt2] {
            let at = (ZeroStage::Stage3, 2);
            let mut cfg = s.config(at, Precision::Bf16, Offload::Optimizer, Ckpt::Off);
            cfg.zero.reduce_bucket_size = 50_000_000;
            cfg.zero.allgather_bucket_size = 50_000_000;
            cfg.zero.param_persistence_threshold = threshold;
            s.check(which, &cfg);
        }
    }
    s.finish(6);
}

/// f32 accumulators in a bf16 run (`data_types.grad_accum_dtype = "fp32"`): twice the gradient
/// bytes on the device or, with the optimizer offloaded, on the host, and the reduced sums cast
/// to f32 before their way down.
#[test]
fn f32_gradient_accumulators_match_the_cpu_ledger() {
    let mut s = Sweep::new();
    for (stage, world) in
        one_and_two_ranks(&[ZeroStage::Stage0, ZeroStage::Stage2, ZeroStage::Stage3])
    {
        for offload in [
            Offload::None,
            Offload::Optimizer,
            Offload::OptimizerAndParams,
        ] {
            if offload == Offload::OptimizerAndParams && stage != ZeroStage::Stage3 {
                continue;
            }
            let mut cfg = s.config((stage, world), Precision::Bf16, offload, Ckpt::Off);
            cfg.grad_accum_f32 = true;
            s.check(Which::Llama, &cfg);
            cfg.zero.overlap_comm = true;
            s.check(Which::Llama, &cfg);
        }
    }
    s.finish(28);
}

/// bf16 master weights and moments (`bf16_optimizer_states`) where the optimizer runs (on the
/// device: here the CPU's memory) or offloaded: every peak the ledger's, and the optimizer
/// bytes a third of what f32 state takes.
#[test]
fn bf16_optimizer_states_match_the_cpu_ledger() {
    let mut s = Sweep::new();
    for (stage, world) in
        one_and_two_ranks(&[ZeroStage::Stage1, ZeroStage::Stage2, ZeroStage::Stage3])
    {
        for offload in [Offload::None, Offload::Optimizer] {
            let mut cfg = s.config((stage, world), Precision::Bf16, offload, Ckpt::Off);
            cfg.zero.overlap_comm = world > 1;
            cfg.bf16_state.master_weights_and_grads = true;
            cfg.bf16_state.optimizer_states = true;
            s.check(Which::Gpt2, &cfg);
            let opt = |c: &ResolvedConfig| {
                let e = estimate(&build(Which::Gpt2), c, MICRO, SEQ).unwrap();
                let at = match offload {
                    Offload::None => &e.device,
                    _ => &e.host,
                };
                at.category(Category::OptimizerState)
            };
            // The state alone (no optimizer overlap's snapshots of it): a third.
            let mut plain = cfg.clone();
            plain.zero.overlap_comm = false;
            let mut f32_state = plain.clone();
            f32_state.bf16_state = Default::default();
            let (bf16, full) = (opt(&plain), opt(&f32_state));
            assert_eq!(bf16 * 3, full, "stage {stage:?} world {world} {offload:?}");
        }
    }
    s.finish(12);
}

#[test]
fn checkpointing_lowers_device_activations_and_the_figures_say_so() {
    let model = build(Which::Gpt2);
    let s = Sweep::new();
    let at = (ZeroStage::Stage2, 1);
    let off = s.config(at, Precision::Bf16, Offload::None, Ckpt::Off);
    let on = s.config(at, Precision::Bf16, Offload::None, Ckpt::Device);
    let (a, b) = (
        estimate(&model, &off, MICRO, SEQ).unwrap(),
        estimate(&model, &on, MICRO, SEQ).unwrap(),
    );
    assert!(b.device.category(Category::Activations) < a.device.category(Category::Activations));
    // Both estimates carry both figures, whichever mode the config chose.
    assert_eq!(a.activations, b.activations);
    assert!(a.activations.with_checkpointing < a.activations.without_checkpointing);
}

/// A speculative overlap bounded to some groups' snapshots: the ledger's host peak is the
/// estimate's to the byte, and the snapshots it counts are those of the planned groups alone
/// (between none and every group's), for GPT-2 and Llama at stage 3 with the optimizer offloaded.
#[test]
fn bounded_snapshots_match_the_ledger() {
    use ferrozero_runtime::engine::estimate::estimate_with_overlap;
    use ferrozero_runtime::engine::optimizer_overlap::OptimizerOverlap;
    for which in [Which::Gpt2, Which::Llama] {
        let mut cfg = config(ZeroStage::Stage3, 1, MICRO, 2, Precision::Bf16);
        cfg.zero.offload_optimizer.target = OffloadTarget::Cpu;
        cfg.zero.overlap_comm = true;
        let full = estimate(&build(which), &cfg, MICRO, SEQ).unwrap();
        let groups = &full.snapshot_group_bytes;
        let units = build(which).units.len();
        let bound: u64 = groups[units / 2..units].iter().sum();
        let overlap = OptimizerOverlap::Speculative("test".into(), Some(bound));
        let e = estimate_with_overlap(&build(which), &cfg, MICRO, SEQ, &overlap).unwrap();
        assert_eq!(e.snapshot_host_bytes, bound, "{which:?}");
        assert!(bound > 0 && bound < full.snapshot_host_bytes, "{which:?}");
        let host = run_ranks(1, Duration::from_secs(60), |comm| {
            let mut e =
                Engine::with_overlap(build(which), cfg.clone(), comm, Some(overlap.clone()))?;
            e.train_batch(&batches(&cfg, SEQ, 0, 0))?;
            e.train_batch(&batches(&cfg, SEQ, 0, 0))?;
            Ok(e.ledger().peak_total(Location::Host))
        })
        .unwrap()[0];
        assert_eq!(
            e.host.peak_bytes, host,
            "{which:?}: estimate against ledger"
        );
        assert_eq!(
            full.host.peak_bytes - e.host.peak_bytes,
            full.snapshot_host_bytes - bound
        );
    }
}
