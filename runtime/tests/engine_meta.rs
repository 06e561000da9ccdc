//! The real engine on the size-only ("meta") device at sizes no test machine holds: a 7B
//! Llama at stage 3 on 64 ranks, and a 13B on one rank with everything on NVMe, run a step in
//! seconds without model-sized memory or a file, holding the closed form's state; and a meta
//! run refuses what a real one refuses. (That the meta run holds what the CPU run holds, every
//! ledger peak in every mode, is `estimate_vs_ledger`'s sweep.)

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::ledgers::{meta, peaks};
use common::models::{resident as rss, serial, Which, MICRO};
use common::{checkpointing, config, toy};
use ferrozero_config::resolved::{OffloadTarget, Precision, ResolvedConfig, ZeroStage};
use ferrozero_runtime::backend::MetaBackend;
use ferrozero_runtime::comm::meta::MetaComm;
use ferrozero_runtime::engine::ledger::{Category, Location};
use ferrozero_runtime::engine::Engine;
use ferrozero_runtime::nn::{llama, Model};

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

/// Builds `model` on the meta device as rank 0 of `cfg`'s world and steps it once on one
/// micro-batch of 1 x `seq`: under 3 s, the process's memory growing less than 256 MiB.
fn step_in_seconds(what: &str, model: Model, cfg: &ResolvedConfig, seq: usize) -> Engine {
    let before = rss();
    let start = Instant::now();
    let comm = MetaComm::new(0, cfg.world_size, cfg.comms.backend).unwrap();
    let be = Arc::new(MetaBackend);
    let mut e = Engine::with_backend(model, cfg.clone(), Box::new(comm), be).unwrap();
    let built = start.elapsed();
    e.train_batch(&[toy::batch(32000, seq, 0, 1)]).unwrap();
    let took = start.elapsed();
    let grew = rss().saturating_sub(before);
    eprintln!(
        "{what}: built {built:?}, built and stepped {took:?}, RSS +{} MiB",
        grew >> 20
    );
    assert!(took < Duration::from_secs(3), "took {took:?}");
    assert!(grew < 256 << 20, "RSS grew {grew} bytes");
    assert_eq!(e.global_steps(), 1);
    eprintln!("ledger: {:?}", peaks(e.ledger()));
    e
}

/// A 7B Llama at stage 3 on 64 ranks, one micro-batch of 1 x 512: the meta engine builds and
/// steps in under 3 s without model-sized memory, and holds the closed form's state: bf16
/// parameter shards, f32 master weights and two f32 moments of the rank's shard.
#[test]
fn llama_7b_stage_3_on_64_ranks_steps_in_seconds_without_its_bytes() {
    let _alone = serial();
    let model = llama::build(&llama::LlamaConfig::preset("llama-7b").unwrap()).unwrap();
    let shard = shard_elements(&model, 64);
    let mut cfg = config(ZeroStage::Stage3, 64, 1, 1, Precision::Bf16);
    cfg.zero.reduce_bucket_size = 500_000_000;
    cfg.zero.allgather_bucket_size = 500_000_000;
    cfg.zero.sub_group_size = 1_000_000_000;
    let e = step_in_seconds("7B stage 3, 64 ranks", model, &cfg, 512);
    let l = e.ledger();
    assert!(shard > 6_000_000_000 / 64, "a 7B's shard: {shard}");
    assert!(l.peak(Location::Device, Category::Parameters) >= 2 * shard);
    // The step ran: a gathered unit, its activations and reductions were held.
    assert!(l.peak(Location::Device, Category::Activations) > 512 * 4096 * 4);
    assert!(l.peak(Location::Device, Category::CommBuffers) > 0);
    assert_eq!(
        l.peak(Location::Device, Category::OptimizerState),
        12 * shard
    );
}

/// A meta run keeps the config's checks: the NVMe optimizer still needs Adam and bf16 or
/// fp16 parameters, and refuses before anything else.
#[test]
fn a_meta_run_checks_nvme_configs_as_a_real_one() {
    let scratch = common::scratch::Scratch::new();
    let absent = scratch.dir();
    let on_nvme = |stage, world, precision| {
        let mut c = config(stage, world, MICRO, 2, precision);
        c.zero.offload_optimizer.target = OffloadTarget::Nvme(absent.clone());
        c
    };
    let cfg = on_nvme(ZeroStage::Stage3, 2, Precision::F32);
    let e = meta(Which::Gpt2, &cfg).expect_err("f32 refused");
    assert!(e.to_string().contains("bf16 or fp16"), "{e}");
    let mut sgd = on_nvme(ZeroStage::Stage2, 1, Precision::Bf16);
    sgd.optimizer = ferrozero_config::resolved::OptimizerConfig::Sgd {
        lr: 1e-2,
        momentum: 0.9,
        dampening: 0.0,
        weight_decay: 0.0,
        nesterov: false,
    };
    let e = meta(Which::Gpt2, &sgd).expect_err("SGD refused");
    assert!(e.to_string().contains("Adam"), "{e}");
    let mut small = config(ZeroStage::Stage3, 1, MICRO, 2, Precision::Bf16);
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
    let _alone = serial();
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
    let e = step_in_seconds("13B on NVMe, 1 rank", model, &cfg, 4096);
    assert!(!absent.exists(), "the meta run made {}", absent.display());
    let l = e.ledger();
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
