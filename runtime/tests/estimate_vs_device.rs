//! The estimator against a device's own allocator: GPT-2 and Llama (small configs) trained on
//! the CUDA backend over the CPU emulator of the device (bf16 activations), at stages 0-3,
//! with optimizer offload, parameter offload and activation checkpointing on and off, over two
//! optimizer steps as the estimate measures them; the estimate's device peak is the peak the
//! caching allocator measured (`Backend::memory_stats`), byte for byte, except where a comm
//! worker issues device work beside the compute thread (`overlap_comm` at two ranks): there
//! the emulator's own peak moves with the two threads' timing (a few allocator blocks between
//! runs, `device_meta.rs`), and the estimate is held within 2%.
#![cfg(feature = "cuda")]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::models::{build, Which, MICRO, VOCAB};
use common::{checkpointing, config, toy};
use ferrozero_config::resolved::{
    LossScaling, OffloadTarget, Precision, ResolvedConfig, ZeroStage,
};
use ferrozero_config::Device;
use ferrozero_runtime::backend::{self, Backend};
use ferrozero_runtime::comm::local::run_ranks;
use ferrozero_runtime::engine::estimate::estimate;
use ferrozero_runtime::engine::ledger::Category;
use ferrozero_runtime::engine::Engine;
use ferrozero_runtime::tensor::DType;

const SEQ: usize = 32;
/// Optimizer steps a run measures: the estimate's (the second step holds what the first
/// leaves for it).
const STEPS: usize = 2;
/// Where a comm worker issues device work beside the compute thread, the local communicator's
/// reduction scratch (`backend/cuda/peer.rs`, up to three blocks) and a chunked
/// reduce-scatter's input, allocated on the worker's thread while the collective waits for the
/// peer rank, land beside backward's buffers or not as the threads' timing falls; the size-only
/// communicator waits for no one and allocates nothing. So the emulator's peak may sit above
/// the estimate (never below) by 2% or by a few allocator blocks, whichever is more: 0 to 4
/// blocks of 512 bytes were seen, up to 2.17% of these toy models' 77-94 KB peaks, a share
/// that shrinks with the model.
const THREADED: f64 = 0.02;
/// The blocks of [`THREADED`]'s timing-dependent scratch a run may hold beyond 2%.
const THREADED_BLOCKS: u64 = 8;

/// The allocator's peak on rank 0 after [`STEPS`] optimizer steps of two micro-batches, each
/// rank on its own fresh emulated device (so the peak is that rank's alone).
fn measure(which: Which, cfg: &ResolvedConfig) -> u64 {
    let (world, gas) = (cfg.world_size, cfg.gradient_accumulation_steps);
    let out = run_ranks(world, Duration::from_secs(300), |comm| {
        let rank = comm.rank();
        let be: Arc<dyn Backend> = backend::cuda::emulated(DType::Bf16)?;
        let mut e = Engine::with_backend(build(which), cfg.clone(), comm, be)?;
        for s in 0..STEPS {
            let batches: Vec<_> = (0..gas)
                .map(|m| toy::batch(VOCAB, SEQ, ((s * gas + m) * world + rank) * MICRO, MICRO))
                .collect();
            e.train_batch(&batches)?;
        }
        let stats = e.backend().memory_stats();
        Ok(stats.map_or(0, |m| m.peak))
    })
    .unwrap();
    out[0]
}

#[derive(Clone, Copy, Debug)]
enum Offload {
    None,
    Optimizer,
    OptimizerAndParams,
}

fn make_config(stage: ZeroStage, world: usize, offload: Offload, ckpt: bool) -> ResolvedConfig {
    let mut cfg = config(stage, world, MICRO, 2, Precision::Bf16);
    // The estimate describes the device from the config alone, as on a machine without one.
    cfg.device = Device::Cuda(None);
    if matches!(offload, Offload::Optimizer | Offload::OptimizerAndParams) {
        cfg.zero.offload_optimizer.target = OffloadTarget::Cpu;
    }
    if matches!(offload, Offload::OptimizerAndParams) {
        cfg.zero.offload_param.target = OffloadTarget::Cpu;
    }
    cfg.activation_checkpointing = ckpt.then(|| checkpointing(false));
    cfg
}

fn check(which: Which, cfg: &ResolvedConfig, failures: &mut Vec<String>) {
    let est = estimate(&build(which), cfg, MICRO, SEQ)
        .unwrap()
        .device
        .peak_bytes;
    let got = measure(which, cfg);
    let off = (est as f64 - got as f64).abs() / (got as f64).max(1.0);
    let what = format!(
        "{which:?} stage {} world {} offload {:?}/{:?} ckpt {} overlap {}",
        cfg.zero.stage.number(),
        cfg.world_size,
        cfg.zero.offload_optimizer.target,
        cfg.zero.offload_param.target,
        cfg.activation_checkpointing.is_some(),
        cfg.zero.overlap_comm
    );
    // One row per configuration, for the record (`--nocapture` shows the table).
    eprintln!("| {what} | {est} | {got} | {:.2}% |", off * 100.0);
    if !within(cfg, est, got) {
        failures.push(format!("{what}: estimate {est} vs allocator peak {got}"));
    }
}

/// Whether the estimate `est` prices the emulator's peak `got` under `cfg`: exactly, unless a
/// comm worker's timing moves that peak, and then only upward, by at most [`slack`].
fn within(cfg: &ResolvedConfig, est: u64, got: u64) -> bool {
    est <= got && got - est <= slack(cfg, got)
}

/// How far above the estimate a peak of `got` bytes may sit under `cfg` ([`THREADED`]).
fn slack(cfg: &ResolvedConfig, got: u64) -> u64 {
    match cfg.zero.overlap_comm && cfg.world_size > 1 {
        true => ((THREADED * got as f64) as u64).max(THREADED_BLOCKS * 512),
        false => 0,
    }
}

fn sweep(which: Which) {
    let mut failures = Vec::new();
    let mut runs = 0;
    for stage in [
        ZeroStage::Stage0,
        ZeroStage::Stage1,
        ZeroStage::Stage2,
        ZeroStage::Stage3,
    ] {
        for world in [1, 2] {
            for offload in [
                Offload::None,
                Offload::Optimizer,
                Offload::OptimizerAndParams,
            ] {
                if matches!(offload, Offload::OptimizerAndParams) && stage != ZeroStage::Stage3 {
                    continue;
                }
                for ckpt in [false, true] {
                    let cfg = make_config(stage, world, offload, ckpt);
                    check(which, &cfg, &mut failures);
                    runs += 1;
                    if world > 1 {
                        // The comm worker: queued reductions and stage-3 prefetch.
                        let mut overlapped = cfg;
                        overlapped.zero.overlap_comm = true;
                        check(which, &overlapped, &mut failures);
                        runs += 1;
                    }
                }
            }
        }
    }
    assert_eq!(runs, 54);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The same run priced with the CPU's figures (f32 activations and working copies, attention
/// probabilities, full logits, exact sizes) misses the device's peak: the sweep above can fail.
#[test]
fn cpu_figures_would_misprice_the_device() {
    let gpu = make_config(ZeroStage::Stage3, 1, Offload::None, false);
    let mut cpu = gpu.clone();
    cpu.device = Device::Cpu;
    let got = measure(Which::Gpt2, &gpu);
    let (est_gpu, est_cpu) = (
        estimate(&build(Which::Gpt2), &gpu, MICRO, SEQ)
            .unwrap()
            .device
            .peak_bytes,
        estimate(&build(Which::Gpt2), &cpu, MICRO, SEQ)
            .unwrap()
            .device
            .peak_bytes,
    );
    let off = |e: u64| (e as f64 - got as f64).abs() / got as f64;
    assert_eq!(est_gpu, got, "the device's figures");
    assert!(off(est_cpu) > 0.05, "CPU figures {est_cpu} vs device {got}");
}

#[test]
fn gpt2_device_peak_is_the_allocators() {
    sweep(Which::Gpt2);
}

#[test]
fn llama_device_peak_is_the_allocators() {
    sweep(Which::Llama);
}

/// Units below the backward floor: their saved state lives only through their own forward.
#[test]
fn gpt2_frozen_below_the_backward_floor_is_the_allocators() {
    sweep(Which::Gpt2BottomFrozen);
}

/// Frozen parameters and the adapters' transient buffers priced as the allocator sees them.
#[test]
fn llama_lora_device_peak_is_the_allocators() {
    sweep(Which::LlamaLoraDropout);
}

/// bf16 master weights and moments in the device's memory (`bf16_optimizer_states`): the
/// allocator's peak priced as the sweep prices it, and the bytes the allocator saved against
/// f32 state (the f32 master weights, half of the moments) are the bytes the estimate saved.
#[test]
fn bf16_optimizer_states_on_the_device_are_priced() {
    let mut failures = Vec::new();
    for stage in [ZeroStage::Stage1, ZeroStage::Stage2, ZeroStage::Stage3] {
        for world in [1, 2] {
            let mut f32_state = make_config(stage, world, Offload::None, false);
            f32_state.zero.overlap_comm = world > 1;
            let mut cfg = f32_state.clone();
            cfg.bf16_state.master_weights_and_grads = true;
            cfg.bf16_state.optimizer_states = true;
            check(Which::Gpt2, &cfg, &mut failures);
            let est = |c: &ResolvedConfig| estimate(&build(Which::Gpt2), c, MICRO, SEQ).unwrap();
            let (e16, e32) = (est(&cfg), est(&f32_state));
            let opt = |e: &ferrozero_runtime::engine::estimate::Estimate| {
                e.device.category(Category::OptimizerState)
            };
            // A third (every entry's bytes a whole number of the allocator's blocks in both
            // dtypes here).
            let (o16, o32) = (opt(&e16), opt(&e32));
            assert_eq!(
                o16 * 3,
                o32,
                "stage {stage:?} world {world}: optimizer bytes {o16} vs f32 state {o32}"
            );
            let saved_est = e32.device.peak_bytes as f64 - e16.device.peak_bytes as f64;
            let (m32, m16) = (measure(Which::Gpt2, &f32_state), measure(Which::Gpt2, &cfg));
            let saved = m32 as f64 - m16 as f64;
            eprintln!("stage {stage:?} world {world}: saved {saved} bytes, estimated {saved_est}");
            assert!(saved > 0.0, "stage {stage:?} world {world}: nothing saved");
            // A difference of two peaks: exact, or where a comm worker's timing moves them
            // (two ranks overlap here), within both peaks' slack.
            assert!(
                (saved - saved_est).abs() <= (slack(&cfg, m32) + slack(&cfg, m16)) as f64,
                "stage {stage:?} world {world}: saved {saved}, estimated {saved_est}"
            );
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// One run of two steps on a fresh emulated device with activations in `act`: the allocator's
/// peak, the ledger's peak of page-locked bytes (the engine's registrations and the driver's),
/// the first step's gradient norm and whether it was skipped, and how many groups the steps
/// rolled back.
struct Staged {
    peak: u64,
    page_locked: u64,
    norm: f64,
    skipped: bool,
    rolled_back: usize,
}

fn measure_staged(which: Which, cfg: &ResolvedConfig, act: DType) -> Staged {
    let out = run_ranks(1, Duration::from_secs(300), |comm| {
        let be: Arc<dyn Backend> = backend::cuda::emulated(act)?;
        let mut e = Engine::with_backend(build(which), cfg.clone(), comm, be)?;
        e.trace_schedule(true);
        let mut first = None;
        for s in 0..2 {
            let batches: Vec<_> = (0..cfg.gradient_accumulation_steps)
                .map(|m| toy::batch(VOCAB, SEQ, (s * 2 + m) * MICRO, MICRO))
                .collect();
            let r = e.train_batch(&batches)?;
            first.get_or_insert((r.grad_norm, r.skipped));
        }
        let spans = e.take_schedule_trace();
        let (norm, skipped) = first.unwrap_or_default();
        Ok(Staged {
            peak: e.backend().memory_stats().map_or(0, |m| m.peak),
            page_locked: e.ledger().report().peak_page_locked_bytes,
            norm,
            skipped,
            rolled_back: spans.iter().filter(|s| s.op == "rollback").count(),
        })
    })
    .unwrap();
    out.into_iter().next().unwrap()
}

/// The estimate's device peak and page-locked bytes against the run's: the same bytes (one
/// rank, no comm worker).
fn check_staged(which: Which, what: &str, cfg: &ResolvedConfig, run: &Staged) {
    let est = estimate(&build(which), cfg, MICRO, SEQ).unwrap();
    let off = |e: u64, got: u64| (e as f64 - got as f64).abs() / (got as f64).max(1.0);
    let (peak, locked) = (est.device.peak_bytes, est.page_locked.total());
    eprintln!(
        "| {which:?} {what} | peak {peak} vs {} ({:.2}%) | page-locked {locked} vs {} ({:.2}%) |",
        run.peak,
        off(peak, run.peak) * 100.0,
        run.page_locked,
        off(locked, run.page_locked) * 100.0
    );
    assert_eq!(peak, run.peak, "{which:?} {what}: device peak");
    assert_eq!(locked, run.page_locked, "{which:?} {what}: page-locked");
}

fn offloaded(stage: ZeroStage, precision: Precision) -> ResolvedConfig {
    let mut cfg = config(stage, 1, MICRO, 2, precision);
    cfg.device = Device::Cuda(None);
    cfg.zero.offload_optimizer.target = OffloadTarget::Cpu;
    cfg
}

/// `cpu_checkpointing` (checkpoints down after each unit's forward, up one unit ahead of the
/// recompute) and the speculative overlap, on a step where clipping binds after the lane
/// stepped groups (undone from its snapshots) and on an fp16 step that overflows (the lane
/// stops at the first non-finite group, before saving it, so that step undoes nothing).
fn staged_sweep(which: Which) {
    for stage in [ZeroStage::Stage0, ZeroStage::Stage3] {
        let mut cfg = offloaded(stage, Precision::Bf16);
        cfg.activation_checkpointing = Some(checkpointing(true));
        let run = measure_staged(which, &cfg, DType::Bf16);
        check_staged(
            which,
            &format!("stage {stage:?} cpu_checkpointing"),
            &cfg,
            &run,
        );
        // The speculative overlap with a threshold just under the first step's norm: the lane
        // steps groups until the sum crosses it, and the step undoes them.
        let mut spec = offloaded(stage, Precision::Bf16);
        spec.zero.overlap_comm = true;
        let free = measure_staged(which, &spec, DType::Bf16);
        spec.gradient_clipping = 0.999 * free.norm;
        let run = measure_staged(which, &spec, DType::Bf16);
        assert!(
            run.rolled_back > 0,
            "{which:?} {stage:?}: clipping rolled nothing back"
        );
        check_staged(
            which,
            &format!("stage {stage:?} clipping binds"),
            &spec,
            &run,
        );
    }
    // fp16 from a loss scale whose gradients overflow: the first step is skipped.
    let mut fp16 = offloaded(
        ZeroStage::Stage2,
        Precision::Fp16(LossScaling::Dynamic {
            initial_scale_power: 24,
            loss_scale_window: 1000,
            hysteresis: 1,
            consecutive_hysteresis: false,
            min_loss_scale: 1.0,
        }),
    );
    fp16.zero.overlap_comm = true;
    fp16.gradient_clipping = 1.0;
    let run = measure_staged(which, &fp16, DType::F16);
    assert!(run.skipped, "{which:?}: the fp16 step did not overflow");
    eprintln!(
        "{which:?} fp16 overflow: {} groups rolled back",
        run.rolled_back
    );
    check_staged(which, "fp16 overflow", &fp16, &run);
}

#[test]
fn gpt2_staging_for_checkpoints_and_snapshots_is_priced() {
    staged_sweep(Which::Gpt2);
}

#[test]
fn llama_staging_for_checkpoints_and_snapshots_is_priced() {
    staged_sweep(Which::Llama);
}

/// f32 accumulators in a bf16 run (`data_types.grad_accum_dtype = "fp32"`) priced as the
/// emulated device's allocator sees them, its staging included.
#[test]
fn f32_gradient_accumulators_are_the_allocators() {
    let mut failures = Vec::new();
    for (stage, offload) in [
        (ZeroStage::Stage0, Offload::None),
        (ZeroStage::Stage2, Offload::None),
        (ZeroStage::Stage2, Offload::Optimizer),
        (ZeroStage::Stage3, Offload::OptimizerAndParams),
    ] {
        for world in [1, 2] {
            let mut cfg = make_config(stage, world, offload, false);
            cfg.grad_accum_f32 = true;
            check(Which::Gpt2, &cfg, &mut failures);
        }
    }
    let mut cfg = offloaded(ZeroStage::Stage2, Precision::Bf16);
    cfg.grad_accum_f32 = true;
    let run = measure_staged(Which::Gpt2, &cfg, DType::Bf16);
    check_staged(Which::Gpt2, "f32 accumulators", &cfg, &run);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
