//! The real engine on the size-only ("meta") device: the same steps on the CPU backend and on
//! `MetaBackend` with `MetaComm` (one simulated rank standing for rank 0 of the real run) hold
//! the same bytes, every location and category of the ledger equal, for GPT-2 and Llama
//! (LoRA and frozen variants too) over stages 0-3, one and two ranks, offload, activation
//! checkpointing, overlap, hpZ, MiCS, gradient accumulation and every precision, NVMe (the
//! optimizer's tiles and stage 3's parameter shards) included; and a 7B Llama at stage 3 on 64
//! ranks, and a 13B on one rank with everything on NVMe, run a step in seconds without
//! model-sized memory or a file.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{checkpointing, config, toy};
use ferrozero_config::resolved::{
    LossScaling, OffloadTarget, Precision, ResolvedConfig, ZeroStage,
};
use ferrozero_runtime::backend::MetaBackend;
use ferrozero_runtime::comm::local::run_ranks;
use ferrozero_runtime::comm::meta::MetaComm;
use ferrozero_runtime::engine::ledger::{Category, Ledger, Location};
use ferrozero_runtime::engine::Engine;
use ferrozero_runtime::nn::freeze::Freeze;
use ferrozero_runtime::nn::peft::LoraConfig;
use ferrozero_runtime::nn::{gpt2, llama, Model};

const SEQ: usize = 8;
const MICRO: usize = 2;
const VOCAB: usize = 64;

#[derive(Clone, Copy, Debug)]
enum Which {
    Gpt2,
    Llama,
    LlamaLora,
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

/// Every (location, category) peak and every location's total peak.
type Peaks = Vec<(Location, Option<Category>, u64)>;

fn peaks(l: &Ledger) -> Peaks {
    let mut out = Vec::new();
    for loc in [Location::Device, Location::Host, Location::Nvme] {
        for cat in Category::ALL {
            out.push((loc, Some(cat), l.peak(loc, cat)));
        }
        out.push((loc, None, l.peak_total(loc)));
    }
    out
}

fn fp16() -> Precision {
    Precision::Fp16(LossScaling::Dynamic {
        initial_scale_power: 16,
        loss_scale_window: 1000,
        hysteresis: 2,
        consecutive_hysteresis: false,
        min_loss_scale: 1.0,
    })
}

fn batches(cfg: &ResolvedConfig, rank: usize) -> Vec<ferrozero_runtime::nn::Batch> {
    let world = cfg.world_size;
    (0..cfg.gradient_accumulation_steps)
        .map(|m| toy::batch(VOCAB, SEQ, m * world + rank, MICRO))
        .collect()
}

/// Rank 0's ledger after one step on the CPU, every rank run.
fn real(which: Which, cfg: &ResolvedConfig) -> Peaks {
    let out = run_ranks(cfg.world_size, Duration::from_secs(60), |comm| {
        let rank = comm.rank();
        let mut e = Engine::new(build(which), cfg.clone(), comm)?;
        e.train_batch(&batches(cfg, rank))?;
        Ok(peaks(e.ledger()))
    })
    .unwrap();
    out.into_iter().next().unwrap()
}

/// Rank 0's ledger after one step on the meta device, rank 0 alone simulated.
fn meta(which: Which, cfg: &ResolvedConfig) -> ferrozero_runtime::Result<Peaks> {
    let comm = MetaComm::new(0, cfg.world_size, cfg.comms.backend)?;
    let be = Arc::new(MetaBackend);
    let mut e = Engine::with_backend(build(which), cfg.clone(), Box::new(comm), be)?;
    e.train_batch(&batches(cfg, 0))?;
    Ok(peaks(e.ledger()))
}

fn describe(which: Which, cfg: &ResolvedConfig) -> String {
    format!(
        "{which:?} stage {} world {} {:?} offload {:?}/{:?} ckpt {:?} overlap {} hpz {} mics {} gas {}",
        cfg.zero.stage.number(),
        cfg.world_size,
        cfg.precision,
        cfg.zero.offload_optimizer.target,
        cfg.zero.offload_param.target,
        cfg.activation_checkpointing.as_ref().map(|a| a.cpu_checkpointing),
        cfg.zero.overlap_comm,
        cfg.zero.hpz_partition_size,
        cfg.zero.mics_shard_size,
        cfg.gradient_accumulation_steps,
    )
}

/// Held shared by every comparison and alone by the 7B test, whose RSS reading must not see
/// other tests' runs on their threads.
static ALONE: std::sync::RwLock<()> = std::sync::RwLock::new(());

/// Compares the two ledgers; a difference or a failed meta run is a failure line.
fn check(which: Which, cfg: &ResolvedConfig, failures: &mut Vec<String>) {
    let _shared = ALONE.read().unwrap_or_else(|e| e.into_inner());
    let want = real(which, cfg);
    compare(&describe(which, cfg), &want, meta(which, cfg), failures);
}

/// Each (location, category) peak of the real run against the meta run's.
fn compare(
    what: &str,
    want: &Peaks,
    got: ferrozero_runtime::Result<Peaks>,
    failures: &mut Vec<String>,
) {
    match got {
        Err(e) => failures.push(format!("{what}: meta run failed: {e}")),
        Ok(got) => {
            for (w, g) in want.iter().zip(&got) {
                if w != g {
                    failures.push(format!(
                        "{what}: {:?}/{:?} real {} meta {}",
                        w.0, w.1, w.2, g.2
                    ));
                }
            }
        }
    }
}

#[derive(Clone, Copy, Debug)]
enum Offload {
    None,
    Optimizer,
    OptimizerAndParams,
}

#[derive(Clone, Copy, Debug)]
enum Ckpt {
    Off,
    Device,
    Cpu,
}

fn make(
    stage: ZeroStage,
    world: usize,
    p: Precision,
    offload: Offload,
    ckpt: Ckpt,
) -> ResolvedConfig {
    let mut cfg = config(stage, world, MICRO, 2, p);
    if matches!(offload, Offload::Optimizer | Offload::OptimizerAndParams) {
        cfg.zero.offload_optimizer.target = OffloadTarget::Cpu;
    }
    if matches!(offload, Offload::OptimizerAndParams) {
        cfg.zero.offload_param.target = OffloadTarget::Cpu;
    }
    cfg.activation_checkpointing = match ckpt {
        Ckpt::Off => None,
        Ckpt::Device => Some(checkpointing(false)),
        Ckpt::Cpu => Some(checkpointing(true)),
    };
    cfg
}

const STAGES: [ZeroStage; 4] = [
    ZeroStage::Stage0,
    ZeroStage::Stage1,
    ZeroStage::Stage2,
    ZeroStage::Stage3,
];

/// Stages 0-3 at one and two ranks, every offload that applies, checkpointing off, on the
/// device and on the CPU, overlap off and on (with the opposite stage-3 reuse rule).
fn sweep(which: Which, precisions: &[Precision]) {
    let mut failures = Vec::new();
    let mut runs = 0;
    for stage in STAGES {
        for world in [1, 2] {
            for p in precisions {
                for offload in [
                    Offload::None,
                    Offload::Optimizer,
                    Offload::OptimizerAndParams,
                ] {
                    if matches!(offload, Offload::OptimizerAndParams) && stage != ZeroStage::Stage3
                    {
                        continue;
                    }
                    for ckpt in [Ckpt::Off, Ckpt::Device, Ckpt::Cpu] {
                        let cfg = make(stage, world, p.clone(), offload, ckpt);
                        check(which, &cfg, &mut failures);
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
fn gpt2_meta_ledger_equals_the_cpu_ledger_in_every_mode() {
    sweep(Which::Gpt2, &[Precision::Bf16, Precision::F32]);
}

#[test]
fn llama_meta_ledger_equals_the_cpu_ledger_in_every_mode() {
    sweep(Which::Llama, &[Precision::Bf16, Precision::F32]);
}

#[test]
fn lora_llama_meta_ledger_equals_the_cpu_ledger_in_every_mode() {
    sweep(Which::LlamaLora, &[Precision::Bf16]);
}

#[test]
fn bottom_frozen_gpt2_meta_ledger_equals_the_cpu_ledger_in_every_mode() {
    sweep(Which::Gpt2BottomFrozen, &[Precision::Bf16]);
}

/// fp16 with its dynamic loss scale, one micro-step per step, hpZ and MiCS groups.
#[test]
fn fp16_accumulation_hpz_and_mics_meta_ledgers_equal_the_cpu_ledgers() {
    let mut failures = Vec::new();
    for which in [Which::Gpt2, Which::Llama] {
        for stage in STAGES {
            for world in [1, 2] {
                let mut cfg = make(stage, world, fp16(), Offload::Optimizer, Ckpt::Off);
                check(which, &cfg, &mut failures);
                cfg.gradient_accumulation_steps = 1;
                cfg.train_batch_size = MICRO * world;
                check(which, &cfg, &mut failures);
            }
        }
        for overlap in [false, true] {
            let mut hpz = make(
                ZeroStage::Stage3,
                4,
                Precision::Bf16,
                Offload::None,
                Ckpt::Off,
            );
            hpz.zero.hpz_partition_size = 2;
            hpz.zero.overlap_comm = overlap;
            check(which, &hpz, &mut failures);
            let mut mics = make(
                ZeroStage::Stage3,
                4,
                Precision::Bf16,
                Offload::Optimizer,
                Ckpt::Off,
            );
            mics.zero.mics_shard_size = 2;
            mics.zero.overlap_comm = overlap;
            check(which, &mics, &mut failures);
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// This process's resident memory, in bytes.
fn rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib * 1024
}

/// Elements of every group's shard a rank of `world` holds at stage 3 (one group per unit,
/// and one of the tied parameters when there are any), by the shard arithmetic's rule.
fn shard_elements(model: &Model, world: usize) -> u64 {
    use ferrozero_runtime::engine::partition::shard_len;
    let numel = |specs: &[ferrozero_runtime::nn::ParamSpec]| specs.iter().map(|p| p.numel()).sum();
    let units = model.units.iter().map(|u| numel(&u.module.param_specs()));
    let shared = (!model.shared.is_empty()).then(|| numel(&model.shared));
    units
        .chain(shared)
        .map(|n| shard_len(n, world) as u64)
        .sum()
}

/// A 7B Llama at stage 3 on 64 ranks, one micro-batch of 1 x 512: the meta engine builds and
/// steps in under 3 s without model-sized memory, and holds the closed form's state: bf16
/// parameter shards, f32 master weights and two f32 moments of the rank's shard.
#[test]
fn llama_7b_stage_3_on_64_ranks_steps_in_seconds_without_its_bytes() {
    let _alone = ALONE.write().unwrap_or_else(|e| e.into_inner());
    let model = llama::build(&llama::LlamaConfig::preset("llama-7b").unwrap()).unwrap();
    let shard = shard_elements(&model, 64);
    let mut cfg = config(ZeroStage::Stage3, 64, 1, 1, Precision::Bf16);
    cfg.zero.reduce_bucket_size = 500_000_000;
    cfg.zero.allgather_bucket_size = 500_000_000;
    cfg.zero.sub_group_size = 1_000_000_000;
    let before = rss();
    let start = Instant::now();
    let comm = MetaComm::new(0, 64, cfg.comms.backend).unwrap();
    let mut e =
        Engine::with_backend(model, cfg.clone(), Box::new(comm), Arc::new(MetaBackend)).unwrap();
    let built = start.elapsed();
    let batch = toy::batch(32000, 512, 0, 1);
    e.train_batch(&[batch]).unwrap();
    let took = start.elapsed();
    let grew = rss().saturating_sub(before);
    eprintln!(
        "7B stage 3, 64 ranks: built {built:?}, built and stepped {took:?}, RSS +{} MiB",
        grew >> 20
    );
    assert!(took < Duration::from_secs(3), "took {took:?}");
    assert!(grew < 256 << 20, "RSS grew {grew} bytes");
    let l = e.ledger();
    assert!(shard > 6_000_000_000 / 64, "a 7B's shard: {shard}");
    assert!(l.peak(Location::Device, Category::Parameters) >= 2 * shard);
    // The step ran: a gathered unit, its activations and reductions were held.
    assert_eq!(e.global_steps(), 1);
    assert!(l.peak(Location::Device, Category::Activations) > 512 * 4096 * 4);
    assert!(l.peak(Location::Device, Category::CommBuffers) > 0);
    eprintln!("ledger: {:?}", peaks(l));
    assert_eq!(
        l.peak(Location::Device, Category::OptimizerState),
        12 * shard
    );
}

/// LAMB's two passes, on the device's state and offloaded (where the host backend runs them:
/// the meta device's host is itself).
#[test]
fn lamb_meta_ledgers_equal_the_cpu_ledgers() {
    let mut failures = Vec::new();
    for stage in STAGES {
        for world in [1, 2] {
            for offload in [Offload::None, Offload::Optimizer] {
                let mut cfg = make(stage, world, Precision::Bf16, offload, Ckpt::Off);
                cfg.optimizer = ferrozero_config::resolved::OptimizerConfig::Lamb {
                    lr: 2e-2,
                    betas: (0.9, 0.999),
                    eps: 1e-8,
                    eps_inside_sqrt: false,
                    weight_decay: 0.01,
                    bias_correction: true,
                    max_coeff: 10.0,
                    min_coeff: 0.01,
                };
                check(Which::Llama, &cfg, &mut failures);
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// ZeRO++'s quantized gathers and reductions (packed words through the all-to-all), and the
/// communication logger's decorator over the meta communicator, its splits included (MiCS).
#[test]
fn zeropp_and_logged_meta_ledgers_equal_the_cpu_ledgers() {
    let mut failures = Vec::new();
    for which in [Which::Gpt2, Which::LlamaLora] {
        for (w, g, frozen) in [
            (true, false, false),
            (true, true, false),
            (false, false, true),
        ] {
            let mut cfg = make(
                ZeroStage::Stage3,
                2,
                Precision::Bf16,
                Offload::None,
                Ckpt::Off,
            );
            (cfg.zero.quantized_weights, cfg.zero.quantized_gradients) = (w, g);
            cfg.zero.quantized_nontrainable_weights = frozen;
            check(which, &cfg, &mut failures);
        }
        let mut logged = make(
            ZeroStage::Stage3,
            4,
            Precision::Bf16,
            Offload::None,
            Ckpt::Off,
        );
        logged.zero.mics_shard_size = 2;
        logged.monitor.comms_logger = Some(ferrozero_config::resolved::CommsLoggerConfig {
            verbose: false,
            prof_all: true,
            prof_ops: Vec::new(),
            debug: false,
        });
        check(which, &logged, &mut failures);
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The NVMe configurations of the sweep: optimizer tiles on NVMe (stages 1-3), parameter
/// shards on NVMe (stage 3; optimizer in memory, on the host, or on NVMe too), the pool
/// locked or not, few or many swap buffers, read-ahead on and off.
fn nvme_configs(dir: &std::path::Path) -> Vec<ResolvedConfig> {
    let mut out = Vec::new();
    for world in [1, 2] {
        for stage in [ZeroStage::Stage1, ZeroStage::Stage2, ZeroStage::Stage3] {
            for (pin, count) in [(false, 4), (true, 2)] {
                let mut cfg = make(stage, world, Precision::Bf16, Offload::None, Ckpt::Off);
                cfg.zero.offload_optimizer.target = OffloadTarget::Nvme(dir.to_path_buf());
                (
                    cfg.zero.offload_optimizer.pin_memory,
                    cfg.zero.offload_optimizer.buffer_count,
                ) = (pin, count);
                // Small tiles: a group's state spans several, the last one short.
                cfg.zero.sub_group_size = if pin { 1000 } else { 1 << 20 };
                out.push(cfg);
            }
        }
        for (opt, count, max_in_cpu, ckpt) in [
            (OffloadTarget::None, 2, 1_000_000_000, Ckpt::Off),
            (OffloadTarget::Cpu, 5, 0, Ckpt::Device),
            (
                OffloadTarget::Nvme(dir.to_path_buf()),
                3,
                1_000_000_000,
                Ckpt::Cpu,
            ),
        ] {
            let mut cfg = make(
                ZeroStage::Stage3,
                world,
                Precision::Bf16,
                Offload::None,
                ckpt,
            );
            cfg.zero.offload_optimizer.target = opt;
            cfg.zero.offload_param.target = OffloadTarget::Nvme(dir.to_path_buf());
            cfg.zero.offload_param.buffer_count = count;
            cfg.zero.offload_param.max_in_cpu = max_in_cpu;
            cfg.zero.offload_param.pin_memory = count == 5;
            out.push(cfg);
        }
    }
    out
}

/// `cfg` with every NVMe path at `dir`.
fn nvme_at(cfg: &ResolvedConfig, dir: &std::path::Path) -> ResolvedConfig {
    let mut c = cfg.clone();
    for t in [
        &mut c.zero.offload_optimizer.target,
        &mut c.zero.offload_param.target,
    ] {
        if let OffloadTarget::Nvme(p) = t {
            *p = dir.to_path_buf();
        }
    }
    c
}

/// NVMe in the meta run: the CPU engine with real swap files against the meta engine with a
/// swap path that does not exist, which it must not create; every ledger peak equal (the
/// NVMe bytes, the tiles' host pool, the shards' host buffers as they are read ahead).
#[test]
fn nvme_meta_ledgers_equal_the_cpu_ledgers_and_touch_no_file() {
    let scratch = common::scratch::Scratch::new();
    let absent = scratch.dir().join("never-made");
    let mut failures = Vec::new();
    let mut runs = 0;
    for which in [Which::Llama, Which::Gpt2] {
        for cfg in nvme_configs(&scratch.dir()) {
            for overlap in [false, true] {
                let mut cfg = cfg.clone();
                cfg.zero.overlap_comm = overlap;
                let what = describe(which, &cfg);
                let want = {
                    let _shared = ALONE.read().unwrap_or_else(|e| e.into_inner());
                    real(which, &nvme_at(&cfg, &scratch.dir()))
                };
                assert!(
                    want.iter().any(|p| p.0 == Location::Nvme && p.2 > 0),
                    "{what}: nothing on NVMe"
                );
                compare(
                    &what,
                    &want,
                    meta(which, &nvme_at(&cfg, &absent)),
                    &mut failures,
                );
                assert!(
                    !absent.exists(),
                    "{what}: the meta run made {}",
                    absent.display()
                );
                runs += 1;
            }
        }
    }
    assert!(runs >= 48, "swept only {runs} configurations");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A meta run keeps the config's checks: the NVMe optimizer still needs Adam and bf16 or
/// fp16 parameters, and refuses before anything else.
#[test]
fn a_meta_run_checks_nvme_configs_as_a_real_one() {
    let scratch = common::scratch::Scratch::new();
    let absent = scratch.dir();
    let mut cfg = make(
        ZeroStage::Stage3,
        2,
        Precision::F32,
        Offload::None,
        Ckpt::Off,
    );
    cfg.zero.offload_optimizer.target = OffloadTarget::Nvme(absent.clone());
    let e = meta(Which::Gpt2, &cfg).expect_err("f32 refused");
    assert!(e.to_string().contains("bf16 or fp16"), "{e}");
    let mut sgd = make(
        ZeroStage::Stage2,
        1,
        Precision::Bf16,
        Offload::None,
        Ckpt::Off,
    );
    sgd.zero.offload_optimizer.target = OffloadTarget::Nvme(absent.clone());
    sgd.optimizer = ferrozero_config::resolved::OptimizerConfig::Sgd {
        lr: 1e-2,
        momentum: 0.9,
        dampening: 0.0,
        weight_decay: 0.0,
        nesterov: false,
    };
    let e = meta(Which::Gpt2, &sgd).expect_err("SGD refused");
    assert!(e.to_string().contains("Adam"), "{e}");
    let mut small = make(
        ZeroStage::Stage3,
        1,
        Precision::Bf16,
        Offload::None,
        Ckpt::Off,
    );
    small.zero.offload_param.target = OffloadTarget::Nvme(absent.clone());
    small.zero.offload_param.buffer_size = 8;
    let e = meta(Which::Gpt2, &small).expect_err("small buffers refused");
    assert!(e.to_string().contains("raise buffer_size"), "{e}");
    assert!(!absent.exists());
}

/// Elements of every group a single rank holds at stage 3 (shards of one rank are whole
/// groups): the parameters and the optimizer's owned ranges.
fn group_elements(model: &Model) -> u64 {
    shard_elements(model, 1)
}

/// A 13B Llama at one rank with `configs/llama13b_40gb_nvme.toml`'s settings (stage 3, bf16,
/// optimizer and parameters on NVMe, checkpointing), one micro-batch of 1 x 4096: the meta
/// engine builds and steps in under 3 s without model-sized memory and without creating its
/// swap directory, and its NVMe holds the closed form: f32 master weights and two moments
/// (12 bytes per parameter) and the bf16 parameter shards (2 bytes per parameter).
#[test]
fn llama_13b_on_nvme_steps_in_seconds_without_a_file_or_its_bytes() {
    let _alone = ALONE.write().unwrap_or_else(|e| e.into_inner());
    let scratch = common::scratch::Scratch::new();
    let absent = scratch.dir().join("local_nvme");
    let model = llama::build(&llama::LlamaConfig::preset("llama-13b").unwrap()).unwrap();
    let n = group_elements(&model);
    let mut cfg = config(ZeroStage::Stage3, 1, 1, 1, Precision::Bf16);
    let z = &mut cfg.zero;
    (z.overlap_comm, z.sub_group_size, z.reduce_bucket_size) = (true, 100_000_000, 50_000_000);
    (z.prefetch_bucket_size, z.param_persistence_threshold) = (45_000_000, 100_000);
    (z.max_live_parameters, z.max_reuse_distance) = (100_000_000, 100_000_000);
    z.offload_param.target = OffloadTarget::Nvme(absent.clone());
    (z.offload_param.pin_memory, z.offload_param.buffer_count) = (true, 5);
    (z.offload_param.buffer_size, z.offload_param.max_in_cpu) = (400_000_000, 1_000_000_000);
    z.offload_optimizer.target = OffloadTarget::Nvme(absent.clone());
    (
        z.offload_optimizer.pin_memory,
        z.offload_optimizer.buffer_count,
    ) = (true, 4);
    cfg.activation_checkpointing = Some(checkpointing(false));
    let before = rss();
    let start = Instant::now();
    let comm = MetaComm::new(0, 1, cfg.comms.backend).unwrap();
    let mut e =
        Engine::with_backend(model, cfg.clone(), Box::new(comm), Arc::new(MetaBackend)).unwrap();
    let built = start.elapsed();
    e.train_batch(&[toy::batch(32000, 4096, 0, 1)]).unwrap();
    let took = start.elapsed();
    let grew = rss().saturating_sub(before);
    eprintln!(
        "13B on NVMe, 1 rank: built {built:?}, built and stepped {took:?}, RSS +{} MiB",
        grew >> 20
    );
    assert!(!absent.exists(), "the meta run made {}", absent.display());
    assert!(took < Duration::from_secs(3), "took {took:?}");
    assert!(grew < 256 << 20, "RSS grew {grew} bytes");
    assert_eq!(e.global_steps(), 1);
    let l = e.ledger();
    eprintln!("ledger: {:?}", peaks(l));
    assert!(n > 12_000_000_000, "a 13B's parameters: {n}");
    assert_eq!(l.peak(Location::Nvme, Category::OptimizerState), 12 * n);
    assert_eq!(l.peak(Location::Nvme, Category::Parameters), 2 * n);
    assert_eq!(l.peak_total(Location::Nvme), 14 * n);
    // The tiles' pool: four buffers of one 1e8-parameter tile each, rounded to pages.
    let pool = 4 * (12 * 100_000_000u64).next_multiple_of(4096);
    assert_eq!(l.peak(Location::Host, Category::CommBuffers), pool);
    // Shards were read into host buffers ahead of their gathers, at most five at once.
    assert!(l.peak(Location::Host, Category::Prefetch) > 0);
    assert_eq!(l.current(Location::Host, Category::Prefetch), 0);
    assert!(l.peak(Location::Device, Category::Activations) > 4096 * 5120 * 4);
}
