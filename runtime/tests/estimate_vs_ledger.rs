//! The estimator against the engine: for small GPT-2 and Llama models, at stages 0-3, with
//! and without optimizer/parameter offload and activation checkpointing (on the device and on
//! the CPU), in f32 and bf16, on 1 and 2 ranks, the estimated per-rank peak device and host
//! bytes are the peaks the engine's ledger measures, byte for byte: the estimate runs the same
//! step on the size-only device. (Modules that compute with host loops, like the tests' toy,
//! run on the CPU backend only, so the estimate cannot price them.)

mod common;

use std::time::Duration;

use common::scratch::Scratch;
use common::{checkpointing, config, toy};
use ferrozero_config::resolved::{OffloadTarget, Precision, ResolvedConfig, ZeroStage};
use ferrozero_runtime::comm::local::run_ranks;
use ferrozero_runtime::engine::estimate::estimate;
use ferrozero_runtime::engine::ledger::{Category, Location};
use ferrozero_runtime::engine::Engine;
use ferrozero_runtime::nn::freeze::Freeze;
use ferrozero_runtime::nn::peft::LoraConfig;
use ferrozero_runtime::nn::{gpt2, llama, Model};

const SEQ: usize = 8;
const MICRO: usize = 2;

#[derive(Clone, Copy, Debug)]
enum Which {
    Gpt2,
    Llama,
    /// Llama with LoRA on every linear layer, the base frozen (PEFT's rules).
    LlamaLora,
    /// GPT-2 with its embeddings and first block frozen: backward stops above them.
    Gpt2BottomFrozen,
}

fn build(which: Which) -> Model {
    match which {
        Which::Gpt2 => gpt2::build(&gpt2::Gpt2Config::preset("tiny").unwrap()).unwrap(),
        Which::Llama => llama::build(&llama::LlamaConfig::preset("tiny").unwrap()).unwrap(),
        Which::Gpt2BottomFrozen => {
            let f = Freeze::new(&["transformer.w?e.weight", "transformer.h.0.*"]).unwrap();
            build(Which::Gpt2).freeze(f).unwrap()
        }
        Which::LlamaLora => {
            let cfg = llama::LlamaConfig::preset("tiny").unwrap();
            let lora = LoraConfig::from_json(
                r#"{"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": "all-linear"}"#,
                "test",
            )
            .unwrap();
            let sites = llama::linear_sites(&cfg);
            let (adapters, frozen) =
                ferrozero_runtime::nn::peft::plan(&lora, &sites, "llama").unwrap();
            llama::build_with(&cfg, &adapters)
                .unwrap()
                .freeze(frozen)
                .unwrap()
        }
    }
}

fn vocab(which: Which) -> usize {
    match which {
        Which::Gpt2 | Which::Llama | Which::LlamaLora | Which::Gpt2BottomFrozen => 64,
    }
}

/// Measured (device, host, device activations, device communication buffers) peaks of rank 0
/// after one optimizer step of two micro-batches (every buffer the engine makes has lived
/// once by then).
fn measure(which: Which, cfg: &ResolvedConfig) -> (u64, u64, u64, u64) {
    let world = cfg.world_size;
    let out = run_ranks(world, Duration::from_secs(60), |comm| {
        let rank = comm.rank();
        let mut e = Engine::new(build(which), cfg.clone(), comm)?;
        let batches: Vec<_> = (0..cfg.gradient_accumulation_steps)
            .map(|m| toy::batch(vocab(which), SEQ, m * world + rank, MICRO))
            .collect();
        e.train_batch(&batches)?;
        let l = e.ledger();
        Ok((
            l.peak_total(Location::Device),
            l.peak_total(Location::Host),
            l.peak(Location::Device, Category::Activations),
            l.peak(Location::Device, Category::CommBuffers),
        ))
    })
    .unwrap();
    out[0]
}

/// The estimate is the same step run on the size-only device: the same bytes, not close ones.
fn close(est: u64, got: u64) -> bool {
    if est != got {
        eprintln!("estimate {est} vs ledger {got}");
    }
    est == got
}

#[derive(Clone, Copy, Debug)]
enum Ckpt {
    Off,
    Device,
    Cpu,
}

#[derive(Clone, Copy, Debug)]
enum Offload {
    None,
    Optimizer,
    OptimizerAndParams,
    /// Stage-3 parameter shards on NVMe (optimizer state on the host).
    ParamsOnNvme,
}

fn make_config(
    scratch: &Scratch,
    stage: ZeroStage,
    world: usize,
    precision: Precision,
    offload: Offload,
    ckpt: Ckpt,
) -> ResolvedConfig {
    let mut cfg = config(stage, world, MICRO, 2, precision);
    match offload {
        Offload::None => {}
        Offload::Optimizer => cfg.zero.offload_optimizer.target = OffloadTarget::Cpu,
        Offload::OptimizerAndParams => {
            cfg.zero.offload_optimizer.target = OffloadTarget::Cpu;
            cfg.zero.offload_param.target = OffloadTarget::Cpu;
        }
        Offload::ParamsOnNvme => {
            cfg.zero.offload_optimizer.target = OffloadTarget::Cpu;
            cfg.zero.offload_param.target = OffloadTarget::Nvme(scratch.dir());
            // Two buffers make the read-ahead and write-behind limits bind.
            cfg.zero.offload_param.buffer_count = 2;
        }
    }
    cfg.activation_checkpointing = match ckpt {
        Ckpt::Off => None,
        Ckpt::Device => Some(checkpointing(false)),
        Ckpt::Cpu => Some(checkpointing(true)),
    };
    cfg
}

/// The configuration as table cells: model, stage, world, precision, offload, checkpointing,
/// overlap.
fn describe(which: Which, cfg: &ResolvedConfig) -> String {
    format!(
        "{which:?} | {} | {} | {:?} | {:?}/{:?} | ckpt {:?} | overlap {}",
        cfg.zero.stage.number(),
        cfg.world_size,
        cfg.precision,
        cfg.zero.offload_optimizer.target,
        cfg.zero.offload_param.target,
        cfg.activation_checkpointing
            .as_ref()
            .map(|a| a.cpu_checkpointing),
        cfg.zero.overlap_comm,
    )
}

fn check(which: Which, cfg: &ResolvedConfig, failures: &mut Vec<String>) {
    let e = estimate(&build(which), cfg, MICRO, SEQ).unwrap();
    let (dev, host, act, _) = measure(which, cfg);
    let what = describe(which, cfg);
    let (est_dev, est_host) = (e.device.peak_bytes, e.host.peak_bytes);
    // One row per configuration, for the record (`--nocapture` shows the table).
    eprintln!("| {what} | {est_dev} / {dev} | {est_host} / {host} |");
    if !close(est_dev, dev) || !close(est_host, host) {
        failures.push(format!(
            "{what}: device est {est_dev} vs ledger {dev}; host est {est_host} vs ledger {host}"
        ));
    }
    // Activations are counted the same way too, not only the totals.
    let est_act = e.device.category(Category::Activations);
    if !close(est_act, act) {
        failures.push(format!("{which:?}: activations est {est_act} vs {act}"));
    }
}

fn sweep(which: Which, precisions: &[Precision]) {
    let scratch = Scratch::new();
    let mut failures = Vec::new();
    let mut runs = 0;
    for stage in [
        ZeroStage::Stage0,
        ZeroStage::Stage1,
        ZeroStage::Stage2,
        ZeroStage::Stage3,
    ] {
        for world in [1, 2] {
            for p in precisions {
                for offload in [
                    Offload::None,
                    Offload::Optimizer,
                    Offload::OptimizerAndParams,
                    Offload::ParamsOnNvme,
                ] {
                    if matches!(offload, Offload::OptimizerAndParams | Offload::ParamsOnNvme)
                        && stage != ZeroStage::Stage3
                    {
                        continue;
                    }
                    for ckpt in [Ckpt::Off, Ckpt::Device, Ckpt::Cpu] {
                        let cfg = make_config(&scratch, stage, world, p.clone(), offload, ckpt);
                        check(which, &cfg, &mut failures);
                        // The comm worker (queued reductions, stage-3 prefetch) and the
                        // opposite stage-3 reuse rule must be replayed exactly too.
                        let mut overlapped = cfg.clone();
                        overlapped.zero.overlap_comm = true;
                        overlapped.zero.max_reuse_distance = if cfg.zero.max_reuse_distance == 0 {
                            1 << 30
                        } else {
                            0
                        };
                        check(which, &overlapped, &mut failures);
                        runs += 2;
                    }
                }
            }
        }
    }
    assert!(runs >= 54, "sweep ran only {runs} configurations");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn gpt2_matches_the_ledger_in_every_mode() {
    sweep(Which::Gpt2, &[Precision::Bf16]);
}

#[test]
fn llama_matches_the_ledger_in_every_mode() {
    sweep(Which::Llama, &[Precision::Bf16]);
}

/// Frozen parameters hold no gradient, master weights or moments, in the estimate as in the
/// ledger, whatever the stage and offload.
#[test]
fn llama_with_lora_and_a_frozen_base_matches_the_ledger_in_every_mode() {
    sweep(Which::LlamaLora, &[Precision::Bf16]);
}

/// Units below the backward floor keep nothing for backward and run none, in the estimate
/// as in the ledger.
#[test]
fn gpt2_frozen_below_the_backward_floor_matches_the_ledger_in_every_mode() {
    assert_eq!(build(Which::Gpt2BottomFrozen).backward_floor(), 2);
    sweep(Which::Gpt2BottomFrozen, &[Precision::Bf16]);
}

/// One micro-step per step: the reduced gradient moves into place (f32 at one rank, the wire
/// dtype at two) and is held to the step instead of an accumulator living throughout; beside
/// offloaded optimizer state it still goes down bucket by bucket. The peak that follows is
/// the ledger's in every stage, with and without overlap.
#[test]
fn one_micro_step_per_step_matches_the_ledger() {
    let scratch = Scratch::new();
    let mut failures = Vec::new();
    let mut moved_peak = None;
    for which in [Which::Gpt2, Which::Llama] {
        for stage in [
            ZeroStage::Stage0,
            ZeroStage::Stage1,
            ZeroStage::Stage2,
            ZeroStage::Stage3,
        ] {
            for world in [1, 2] {
                for p in [Precision::F32, Precision::Bf16] {
                    for offload in [Offload::None, Offload::Optimizer] {
                        let mut cfg =
                            make_config(&scratch, stage, world, p.clone(), offload, Ckpt::Off);
                        cfg.gradient_accumulation_steps = 1;
                        cfg.train_batch_size = MICRO * world;
                        check(which, &cfg, &mut failures);
                        cfg.zero.overlap_comm = true;
                        check(which, &cfg, &mut failures);
                        if matches!((offload, &p), (Offload::None, Precision::Bf16)) && world == 1 {
                            let e = estimate(&build(which), &cfg, MICRO, SEQ).unwrap();
                            moved_peak.get_or_insert(e.device.category(Category::Gradients));
                        }
                    }
                }
            }
        }
    }
    // An fp16 wire under bf16 storage rounds twice: the accumulator stays.
    for world in [1, 2] {
        let mut cfg = make_config(
            &scratch,
            ZeroStage::Stage2,
            world,
            Precision::Bf16,
            Offload::None,
            Ckpt::Off,
        );
        cfg.gradient_accumulation_steps = 1;
        cfg.train_batch_size = MICRO * world;
        cfg.comms.data_type = Some(ferrozero_config::resolved::CommDataType::Fp16);
        check(Which::Gpt2, &cfg, &mut failures);
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // The gradient held to the step at one rank is the f32 one: GPT-2 tiny's padded
    // parameters at 4 bytes each.
    let params: usize = estimate(
        &build(Which::Gpt2),
        &make_config(
            &scratch,
            ZeroStage::Stage0,
            1,
            Precision::Bf16,
            Offload::None,
            Ckpt::Off,
        ),
        MICRO,
        SEQ,
    )
    .unwrap()
    .device
    .category(Category::Gradients) as usize
        / 2;
    assert_eq!(
        moved_peak,
        Some((params * 4) as u64),
        "f32 gradients held at one rank"
    );
}

#[test]
fn large_buckets_and_persistence_threshold_match_too() {
    // Buckets above every group size take the unchunked paths; the persistence threshold
    // keeps small stage-3 groups whole.
    let scratch = Scratch::new();
    let mut failures = Vec::new();
    for threshold in [0, 2_000, 100_000] {
        for which in [Which::Llama, Which::Gpt2] {
            let mut cfg = make_config(
                &scratch,
                ZeroStage::Stage3,
                2,
                Precision::Bf16,
                Offload::Optimizer,
                Ckpt::Off,
            );
            cfg.zero.reduce_bucket_size = 50_000_000;
            cfg.zero.allgather_bucket_size = 50_000_000;
            cfg.zero.param_persistence_threshold = threshold;
            check(which, &cfg, &mut failures);
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn checkpointing_lowers_device_activations_and_the_figures_say_so() {
    let model = build(Which::Gpt2);
    let scratch = Scratch::new();
    let off = make_config(
        &scratch,
        ZeroStage::Stage2,
        1,
        Precision::Bf16,
        Offload::None,
        Ckpt::Off,
    );
    let on = make_config(
        &scratch,
        ZeroStage::Stage2,
        1,
        Precision::Bf16,
        Offload::None,
        Ckpt::Device,
    );
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
            let batches: Vec<_> = (0..2)
                .map(|m| toy::batch(vocab(which), SEQ, m, MICRO))
                .collect();
            e.train_batch(&batches)?;
            e.train_batch(&batches)?;
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

/// f32 accumulators in a bf16 run (`data_types.grad_accum_dtype = "fp32"`): twice the gradient
/// bytes on the device or, with the optimizer offloaded, on the host, and the reduced sums cast
/// to f32 before their way down; priced as the ledger counts them.
#[test]
fn f32_gradient_accumulators_match_the_ledger() {
    let scratch = Scratch::new();
    let mut failures = Vec::new();
    for stage in [ZeroStage::Stage0, ZeroStage::Stage2, ZeroStage::Stage3] {
        for world in [1, 2] {
            for offload in [
                Offload::None,
                Offload::Optimizer,
                Offload::OptimizerAndParams,
            ] {
                if matches!(offload, Offload::OptimizerAndParams) && stage != ZeroStage::Stage3 {
                    continue;
                }
                let mut cfg =
                    make_config(&scratch, stage, world, Precision::Bf16, offload, Ckpt::Off);
                cfg.grad_accum_f32 = true;
                check(Which::Llama, &cfg, &mut failures);
                cfg.zero.overlap_comm = true;
                check(Which::Llama, &cfg, &mut failures);
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn quantized_communication_staging_matches_the_ledger() {
    // ZeRO++ qwZ and qgZ hold packed words (and qgZ f32 sums) while a gather or reduction
    // runs: the replay prices them where the engine's ledger counts them.
    let scratch = Scratch::new();
    let mut failures = Vec::new();
    for which in [Which::Llama, Which::Gpt2, Which::LlamaLora] {
        for (w, g, frozen) in [
            (true, false, false),
            (false, true, false),
            (true, true, false),
            (false, false, true),
        ] {
            for (offload, overlap) in [(Offload::None, false), (Offload::OptimizerAndParams, true)]
            {
                let mut cfg = make_config(
                    &scratch,
                    ZeroStage::Stage3,
                    2,
                    Precision::Bf16,
                    offload,
                    Ckpt::Off,
                );
                (cfg.zero.quantized_weights, cfg.zero.quantized_gradients) = (w, g);
                cfg.zero.quantized_nontrainable_weights = frozen;
                cfg.zero.overlap_comm = overlap;
                check(which, &cfg, &mut failures);
                staging_priced(which, &cfg, &mut failures);
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// bf16 master weights and moments (`bf16_optimizer_states`) where the optimizer runs (on
/// the device: here the CPU's memory) or offloaded: the totals within 5%, and the optimizer
/// bytes exactly the ledger's, a third of what f32 state takes.
#[test]
fn bf16_optimizer_states_match_the_ledger() {
    let scratch = Scratch::new();
    let mut failures = Vec::new();
    for stage in [ZeroStage::Stage1, ZeroStage::Stage2, ZeroStage::Stage3] {
        for world in [1, 2] {
            for offload in [Offload::None, Offload::Optimizer] {
                let mut cfg =
                    make_config(&scratch, stage, world, Precision::Bf16, offload, Ckpt::Off);
                cfg.zero.overlap_comm = world > 1;
                cfg.bf16_state.master_weights_and_grads = true;
                cfg.bf16_state.optimizer_states = true;
                check(Which::Gpt2, &cfg, &mut failures);
                let at = match offload {
                    Offload::None => Location::Device,
                    _ => Location::Host,
                };
                let opt = |c: &ResolvedConfig| {
                    let e = estimate(&build(Which::Gpt2), c, MICRO, SEQ).unwrap();
                    match at {
                        Location::Device => e.device.category(Category::OptimizerState),
                        _ => e.host.category(Category::OptimizerState),
                    }
                };
                let got = optimizer_bytes(&cfg, at);
                assert_eq!(opt(&cfg), got, "{}: ledger", describe(Which::Gpt2, &cfg));
                // The state alone (no optimizer overlap's snapshots of it): a third.
                let mut plain = cfg.clone();
                plain.zero.overlap_comm = false;
                let mut f32_state = plain.clone();
                f32_state.bf16_state = Default::default();
                let (bf16, full) = (opt(&plain), opt(&f32_state));
                assert_eq!(bf16 * 3, full, "{}", describe(Which::Gpt2, &plain));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Rank 0's peak optimizer bytes at `at` after one step of GPT-2.
fn optimizer_bytes(cfg: &ResolvedConfig, at: Location) -> u64 {
    let world = cfg.world_size;
    let out = run_ranks(world, Duration::from_secs(60), |comm| {
        let rank = comm.rank();
        let mut e = Engine::new(build(Which::Gpt2), cfg.clone(), comm)?;
        let batches: Vec<_> = (0..cfg.gradient_accumulation_steps)
            .map(|m| toy::batch(vocab(Which::Gpt2), SEQ, m * world + rank, MICRO))
            .collect();
        e.train_batch(&batches)?;
        Ok(e.ledger().peak(at, Category::OptimizerState))
    })
    .unwrap();
    out[0]
}

/// The communication buffers' peak agrees with the ledger's alone, and the staging is priced
/// at all: qgZ's raises the reductions' peak; qwZ's (and the frozen parameters' alone under
/// `zero_quantized_nontrainable_weights`), in forward, raises it where a LoRA base's frozen
/// parameters are gathered (the toy's and GPT-2's forward gathers stay below backward's
/// reduction peak).
fn staging_priced(which: Which, cfg: &ResolvedConfig, failures: &mut Vec<String>) {
    let comm = |c: &ResolvedConfig| {
        estimate(&build(which), c, MICRO, SEQ)
            .unwrap()
            .device
            .category(Category::CommBuffers)
    };
    let (est, got) = (comm(cfg), measure(which, cfg).3);
    let (w, g) = (cfg.zero.quantized_weights, cfg.zero.quantized_gradients);
    if !close(est, got) {
        failures.push(format!(
            "{which:?} qwZ {w} qgZ {g}: comm est {est} vs {got}"
        ));
    }
    let mut plain = cfg.clone();
    (plain.zero.quantized_weights, plain.zero.quantized_gradients) = (false, false);
    plain.zero.quantized_nontrainable_weights = false;
    let must_grow = g || matches!(which, Which::LlamaLora);
    if must_grow && comm(cfg) <= comm(&plain) {
        failures.push(format!("{which:?} qwZ {w} qgZ {g}: staging not priced"));
    }
}
