//! Page-locked host memory on the emulated device: what the driver registered while a stage-3
//! run with parameters and optimizer in host memory trains (the host parameter store, the
//! staging pool of the offloaded step's copies, the small-upload ring, the host gradient
//! accumulators) against the estimate's page-locked figure and the engine ledger's count.
#![cfg(feature = "cuda")]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{config, toy};
use ferrozero_config::resolved::{OffloadTarget, Precision, ResolvedConfig, ZeroStage};
use ferrozero_config::Device;
use ferrozero_runtime::backend::cuda::driver::EmuDriver;
use ferrozero_runtime::backend::cuda::{CudaBackend, CudaDevice};
use ferrozero_runtime::backend::{Backend, Rope};
use ferrozero_runtime::comm::local::run_ranks;
use ferrozero_runtime::engine::estimate::estimate;
use ferrozero_runtime::engine::Engine;
use ferrozero_runtime::nn::llama::{self, LlamaConfig};
use ferrozero_runtime::nn::Model;
use ferrozero_runtime::tensor::DType;

const V: usize = 64;
const T: usize = 8;

/// Layers whose shards and gradients (36 MiB) pass the staging pool's registration threshold
/// and are mapped afresh by glibc (from 32 MiB), so no two buffers share a page: the driver
/// refuses a range that overlaps a registered page, and smaller buffers may.
fn model() -> Model {
    llama::build(&LlamaConfig {
        hidden_size: 2048,
        intermediate_size: 1024,
        num_hidden_layers: 2,
        num_attention_heads: 16,
        num_key_value_heads: None,
        head_dim: None,
        rms_norm_eps: 1e-6,
        rope: Rope::plain(10000.0),
        vocab_size: V,
        max_position_embeddings: T,
        tie_word_embeddings: false,
        initializer_range: 0.02,
        qkv_bias: false,
        sliding_window: None,
    })
    .expect("a valid Llama")
}

/// Parameters of one of `model()`'s layers: attention and MLP projections, two norms.
fn layer_params() -> u64 {
    let (h, f) = (2048u64, 1024u64);
    4 * h * h + 3 * h * f + 2 * h
}

fn cfg(params: bool) -> ResolvedConfig {
    let mut c = config(ZeroStage::Stage3, 1, 1, 1, Precision::Bf16);
    c.device = Device::Cuda(None);
    c.zero.offload_optimizer.target = OffloadTarget::Cpu;
    // The step after backward, nothing snapshotted: the staging the estimate replays.
    c.zero.overlap_comm = false;
    if params {
        c.zero.offload_param.target = OffloadTarget::Cpu;
    }
    c
}

/// Bytes the driver holds registered after two steps, and the ledger's peak count.
fn measure(cfg: &ResolvedConfig) -> (u64, u64) {
    let drv = Arc::new(EmuDriver::builtin().expect("the emulator"));
    let be: Arc<dyn Backend> = Arc::new(CudaBackend::new(
        CudaDevice::new(drv.clone(), None),
        DType::Bf16,
    ));
    let out = run_ranks(1, Duration::from_secs(300), |comm| {
        let mut e = Engine::with_backend(model(), cfg.clone(), comm, be.clone())?;
        for s in 0..2 {
            e.train_batch(&[toy::batch(V, T, s, 1)])?;
        }
        // A forward samples what the step left registered.
        e.forward(&toy::batch(V, T, 5, 1))?;
        Ok((
            drv.registered_host_bytes() as u64,
            e.ledger().report().peak_page_locked_bytes,
        ))
    })
    .expect("training on the emulated device");
    out[0]
}

#[test]
fn page_locked_bytes_are_priced_and_counted() {
    for params in [false, true] {
        let c = cfg(params);
        let (registered, ledger) = measure(&c);
        let est = estimate(&model(), &c, 1, T).page_locked;
        eprintln!("parameters offloaded {params}: registered {registered}, ledger {ledger}, estimate {est:?}");
        assert!(est.staging > 0, "no staging priced");
        // Two layers' accumulators (bf16, 23M elements each) pass the threshold.
        assert_eq!(est.accumulator, 2 * 2 * layer_params());
        assert_eq!(est.parameters > 0, params);
        // The replay mirrors every registration: the same bytes, not just close.
        assert_eq!(est.total(), registered, "estimate {est:?}");
        assert_eq!(ledger, registered, "ledger");
    }
    // The CPU page-locks nothing, and the estimate of a CPU run says so.
    let mut cpu = cfg(true);
    cpu.device = Device::Cpu;
    let e = estimate(&model(), &cpu, 1, T);
    assert_eq!(e.page_locked.total(), 0);
    assert_eq!(e.page_locked.accumulator, 0);
}

/// A model whose layers' accumulators (3.7 MiB in bf16) pass the registration threshold and
/// whose on-device optimizer the emulator runs quickly.
fn small() -> Model {
    llama::build(&LlamaConfig {
        hidden_size: 512,
        intermediate_size: 512,
        num_hidden_layers: 2,
        num_attention_heads: 8,
        num_key_value_heads: None,
        head_dim: None,
        rms_norm_eps: 1e-6,
        rope: Rope::plain(10000.0),
        vocab_size: V,
        max_position_embeddings: T,
        tie_word_embeddings: false,
        initializer_range: 0.02,
        qkv_bias: false,
        sliding_window: None,
    })
    .expect("a valid Llama")
}

/// Trains two steps; the engine's own registrations right after it is built (what the driver
/// holds less the device's staging and ring) and the parameters' bits.
fn train(cfg: &ResolvedConfig) -> (u64, Vec<(String, Vec<u32>)>) {
    let drv = Arc::new(EmuDriver::builtin().expect("the emulator"));
    let be: Arc<dyn Backend> = Arc::new(CudaBackend::new(
        CudaDevice::new(drv.clone(), None),
        DType::Bf16,
    ));
    let out = run_ranks(1, Duration::from_secs(300), |comm| {
        let mut e = Engine::with_backend(small(), cfg.clone(), comm, be.clone())?;
        let engine_locked = drv.registered_host_bytes() as u64 - be.page_locked_bytes();
        for s in 0..2 {
            e.train_batch(&[toy::batch(V, T, s, 1)])?;
        }
        let bits = e
            .parameters()?
            .into_iter()
            .map(|t| (t.name, t.data.iter().map(|x| x.to_bits()).collect()))
            .collect();
        Ok((engine_locked, bits))
    })
    .expect("training on the emulated device");
    out.into_iter().next().unwrap()
}

/// Page-locking the host accumulators changes no bit: the offloaded run, whose accumulators
/// the engine registered (exactly the estimate's figure), ends with the parameters of the
/// device's own optimizer.
#[test]
fn registered_accumulators_keep_the_devices_bits() {
    let c = cfg(false);
    let (locked, offloaded) = train(&c);
    let est = estimate(&small(), &c, 1, T).page_locked;
    assert!(est.accumulator > 0);
    assert_eq!(
        locked, est.accumulator,
        "the engine registered its accumulators"
    );
    let mut plain = c.clone();
    plain.zero.offload_optimizer.target = OffloadTarget::None;
    let (none, on_device) = train(&plain);
    assert_eq!(none, 0, "no host accumulator without offload");
    assert!(offloaded == on_device, "bits differ");
}
