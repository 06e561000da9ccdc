//! A size-only CUDA device's host side is size-only too: offloaded optimizer state, host
//! gradients, stage 3's host parameters, `cpu_checkpointing`'s checkpoints and the speculative
//! overlap's snapshots are meta storage stepped by the meta backend, and the device allocates
//! exactly what the emulator's run (real host memory, real values: the reference) allocates;
//! a 7B Llama so offloaded prices on `cuda::meta` in milliseconds, holding neither the host's
//! ~95 GB nor the device's bytes.
#![cfg(feature = "cuda")]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::models::{resident as rss, serial};
use common::{checkpointing, config, toy};
use ferrozero_config::resolved::{OffloadTarget, Precision, ResolvedConfig, ZeroStage};
use ferrozero_runtime::backend::cuda::driver::{AllocatorStats, EMU_DEFAULT_TOTAL_MEMORY};
use ferrozero_runtime::backend::cuda::{self, driver::DeviceInfo, CudaBackend};
use ferrozero_runtime::backend::{Backend, MemoryOps};
use ferrozero_runtime::comm::local::run_ranks;
use ferrozero_runtime::comm::meta::MetaComm;
use ferrozero_runtime::comm::Communicator;
use ferrozero_runtime::engine::ledger::{Category, Location};
use ferrozero_runtime::engine::optimizer_overlap::OptimizerOverlap;
use ferrozero_runtime::engine::Engine;
use ferrozero_runtime::nn::llama;
use ferrozero_runtime::tensor::DType;

/// Stage 3 at one rank, bf16, the optimizer offloaded to the CPU and `cpu_checkpointing`, one
/// micro-batch of 1 x 4096 on the size-only H100: one `train_batch` in under 3 s with the
/// process's memory barely moving; the host holds the closed form's optimizer state (bf16
/// training keeps f32 master weights and two f32 moments: 12 bytes a parameter, every
/// parameter at one rank), the device at least the bf16 parameters and within its 80 GiB.
#[test]
fn llama_7b_offloaded_to_a_size_only_host_steps_in_seconds() {
    let _one = serial();
    let shape = llama::LlamaConfig::preset("llama-7b").unwrap();
    let model = llama::build(&shape).unwrap();
    let params: u64 = model.num_params() as u64;
    let mut cfg = config(ZeroStage::Stage3, 1, 1, 1, Precision::Bf16);
    cfg.zero.offload_optimizer.target = OffloadTarget::Cpu;
    cfg.activation_checkpointing = Some(checkpointing(true));
    cfg.zero.reduce_bucket_size = 500_000_000;
    cfg.zero.allgather_bucket_size = 500_000_000;
    cfg.zero.sub_group_size = 1_000_000_000;
    let before = rss();
    let start = Instant::now();
    let dev = cuda::meta(DType::Bf16, DeviceInfo::h100_sizes_only(None)).unwrap();
    let be: Arc<dyn Backend> = dev.clone();
    assert_eq!(
        be.host_backend().name(),
        "meta",
        "a size-only host steps nothing"
    );
    let comm = MetaComm::new(0, 1, cfg.comms.backend).unwrap();
    let mut e = Engine::with_backend(model, cfg, Box::new(comm), be.clone()).unwrap();
    let report = e.train_batch(&[toy::batch(32000, 4096, 0, 1)]).unwrap();
    let took = start.elapsed();
    let grew = rss().saturating_sub(before);
    let l = e.ledger();
    let peak = be.memory_stats().unwrap().peak;
    eprintln!(
        "7B offloaded on the size-only H100: {took:?}, RSS +{} MiB, device peak {peak}, \
         host optimizer state {}, host total {}, page-locked peak {}",
        grew >> 20,
        l.peak(Location::Host, Category::OptimizerState),
        l.peak_total(Location::Host),
        l.page_locked().1,
    );
    let host: Vec<u64> = Category::ALL
        .iter()
        .map(|&c| l.peak(Location::Host, c))
        .collect();
    let device: Vec<u64> = Category::ALL
        .iter()
        .map(|&c| l.peak(Location::Device, c))
        .collect();
    eprintln!("params {params}; host peaks {host:?}; device peaks {device:?}");
    assert!(!report.skipped && e.global_steps() == 1);
    assert!(took < Duration::from_secs(3), "took {took:?}");
    assert!(grew < 256 << 20, "RSS grew {grew} bytes");
    assert!(params > 6_000_000_000, "a 7B: {params}");
    // bf16 training: f32 master weights and two f32 moments on the host, the bf16 gradient
    // accumulators beside them; the bf16 parameters on the device, no optimizer state there.
    assert_eq!(host[2], 12 * params, "host optimizer state");
    assert_eq!(host[1], 2 * params, "host gradients");
    assert_eq!(device[0], 2 * params, "device parameters");
    assert_eq!(device[2], 0, "device optimizer state");
    // cpu_checkpointing: every block's bf16 input, 1 x 4096 x hidden, waits on the host.
    let ckpt = shape.num_hidden_layers * 4096 * shape.hidden_size * 2;
    assert_eq!(host[3], ckpt as u64, "host checkpoints");
    assert!(peak > 2 * params && peak < 80 << 30, "device peak {peak}");
    assert!(
        l.page_locked().1 > 0,
        "the staging a real run page-locks is priced"
    );
}

/// What one run's device and ledger held.
#[derive(Debug, PartialEq)]
struct Held {
    stats: AllocatorStats,
    /// The ledger's host peaks by category.
    host: Vec<u64>,
    /// The ledger's page-locked peak.
    locked: u64,
    skipped: Vec<bool>,
    /// Groups the speculative overlap restored and stepped again.
    rolled_back: usize,
}

/// Two steps of the small Llama under `cfg` (and `overlap`) on `dev` at rank 0 of one.
fn two_steps(
    cfg: &ResolvedConfig,
    overlap: &Option<OptimizerOverlap>,
    dev: Arc<CudaBackend>,
    comm: Box<dyn Communicator>,
) -> ferrozero_runtime::Result<Held> {
    let (v, t) = (23, 6);
    let be: Arc<dyn Backend> = dev.clone();
    let model = common::tiny::small_llama(v, t);
    let mut e = match overlap.clone() {
        Some(o) => Engine::with_backend_and_overlap(model, cfg.clone(), comm, be, o)?,
        None => Engine::with_backend(model, cfg.clone(), comm, be)?,
    };
    e.trace_schedule(true);
    let (mut skipped, mut rolled_back) = (Vec::new(), 0);
    for s in 0..2 {
        let b: Vec<_> = (0..2)
            .map(|m| toy::batch(v, t, (s * 2 + m) * 2, 2))
            .collect();
        skipped.push(e.train_batch(&b)?.skipped);
        let trace = e.take_schedule_trace();
        rolled_back += trace.iter().filter(|s| s.op == "rollback").count();
    }
    let l = e.ledger();
    Ok(Held {
        stats: dev.device().allocator().stats(),
        host: Category::ALL
            .iter()
            .map(|&c| l.peak(Location::Host, c))
            .collect(),
        locked: l.page_locked().1,
        skipped,
        rolled_back,
    })
}

/// The emulator's run (local communicator, real host) and the size-only one (`MetaComm`).
fn both(cfg: &ResolvedConfig, overlap: Option<OptimizerOverlap>) -> (Held, Held) {
    let emu = run_ranks(1, Duration::from_secs(300), |comm| {
        two_steps(cfg, &overlap, cuda::emulated(DType::Bf16)?, comm)
    })
    .expect("the emulator's run")
    .remove(0);
    let info = DeviceInfo::h100_sizes_only(Some(EMU_DEFAULT_TOTAL_MEMORY));
    let dev = cuda::meta(DType::Bf16, info).unwrap();
    assert_eq!(dev.host_backend().name(), "meta");
    let comm = MetaComm::new(0, 1, cfg.comms.backend).unwrap();
    let meta = two_steps(cfg, &overlap, dev, Box::new(comm)).expect("the size-only run");
    (emu, meta)
}

/// Host-side configurations at one rank: the optimizer offloaded with `cpu_checkpointing` at
/// stages 2 and 3 (with stage 3's parameters offloaded too), and the speculative optimizer
/// overlap with clipping that binds on both runs and with none. The lane stops lending once
/// the running norm passes the bound, so a bound far below the toy's norm binds at the first
/// group on the emulator as the size-only status (sums of 1e30) does on the meta run: both
/// snapshot, neither lends nor restores; a bound just under the real norm would restore on the
/// emulator alone, a different branch, so it is not compared. The restores are counted and
/// held equal. The device allocator's counters, every one, and the
/// ledger's host peaks are equal; the page-locked peak too, or above the emulator's by less
/// than a page per host shard: the emulator's driver refuses to register a small shard
/// sharing a page with a registered one, the size-only host counts every shard.
#[test]
fn host_side_runs_allocate_on_the_device_as_the_emulator() {
    let _one = serial();
    let offload = |stage, params: bool, cpu_ckpt: bool| {
        let mut c = config(stage, 1, 2, 2, Precision::Bf16);
        c.zero.offload_optimizer.target = OffloadTarget::Cpu;
        if params {
            c.zero.offload_param.target = OffloadTarget::Cpu;
        }
        c.activation_checkpointing = cpu_ckpt.then(|| checkpointing(true));
        c
    };
    let speculative = |clip: f64| {
        let mut c = offload(ZeroStage::Stage2, false, false);
        c.gradient_clipping = clip;
        c.zero.overlap_comm = true;
        c
    };
    let spec = || Some(OptimizerOverlap::Speculative("test".into(), None));
    let cases = [
        (
            "stage 2, optimizer offloaded, cpu_checkpointing",
            offload(ZeroStage::Stage2, false, true),
            None,
        ),
        (
            "stage 3, optimizer offloaded, cpu_checkpointing",
            offload(ZeroStage::Stage3, false, true),
            None,
        ),
        (
            "stage 3, everything offloaded, cpu_checkpointing",
            offload(ZeroStage::Stage3, true, true),
            None,
        ),
        (
            "speculative overlap, clipping binds on both",
            speculative(1e-6),
            spec(),
        ),
        ("speculative overlap, no clipping", speculative(0.0), spec()),
    ];
    let mut failures = Vec::new();
    for (what, cfg, overlap) in cases {
        let (e, m) = both(&cfg, overlap);
        eprintln!("{what}: emulator {e:?}\n  size-only {m:?}");
        let same = e.stats == m.stats
            && e.host == m.host
            && e.skipped == m.skipped
            && e.rolled_back == m.rolled_back;
        let locked = m.locked >= e.locked && m.locked - e.locked < 64 << 10;
        if !(same && locked) {
            failures.push(format!("{what}: emulator {e:?}, size-only {m:?}"));
        }
        assert!(e.host.iter().any(|&b| b > 0), "{what}: nothing on the host");
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
