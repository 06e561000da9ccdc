//! A size-only CUDA device's host side is size-only too: a 7B Llama with its optimizer state
//! offloaded and its checkpoints on the host prices on `cuda::meta` in seconds, holding
//! neither the host's ~80 GB nor the device's bytes.
#![cfg(feature = "cuda")]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{checkpointing, config, toy};
use ferrozero_config::resolved::{OffloadTarget, Precision, ZeroStage};
use ferrozero_runtime::backend::cuda::{self, driver::DeviceInfo};
use ferrozero_runtime::backend::Backend;
use ferrozero_runtime::comm::meta::MetaComm;
use ferrozero_runtime::engine::ledger::{Category, Location};
use ferrozero_runtime::engine::Engine;
use ferrozero_runtime::nn::llama;
use ferrozero_runtime::tensor::DType;

/// The process's resident bytes (`VmRSS`).
fn rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib << 10
}

/// Stage 3 at one rank, bf16, the optimizer offloaded to the CPU and `cpu_checkpointing`, one
/// micro-batch of 1 x 4096 on the size-only H100: one `train_batch` in under 3 s with the
/// process's memory barely moving; the host holds the closed form's optimizer state (bf16
/// training keeps f32 master weights and two f32 moments: 12 bytes a parameter, every
/// parameter at one rank), the device at least the bf16 parameters and within its 80 GiB.
#[test]
fn llama_7b_offloaded_to_a_size_only_host_steps_in_seconds() {
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
    assert_eq!(be.host_backend().name(), "meta", "a size-only host steps nothing");
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
    assert!(l.page_locked().1 > 0, "the staging a real run page-locks is priced");
}
