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
        attention_dropout: 0.0,
    })
    .expect("a valid Llama")
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

/// Bytes the driver holds registered after two steps of `micro` rows, and the ledger's peak
/// count.
fn measure(cfg: &ResolvedConfig, micro: usize) -> (u64, u64) {
    let drv = Arc::new(EmuDriver::builtin().expect("the emulator"));
    let be: Arc<dyn Backend> = Arc::new(CudaBackend::new(
        CudaDevice::new(drv.clone(), None),
        DType::Bf16,
    ));
    let out = run_ranks(1, Duration::from_secs(300), |comm| {
        let mut e = Engine::with_backend(model(), cfg.clone(), comm, be.clone())?;
        for s in 0..2 {
            e.train_batch(&[toy::batch(V, T, s * micro, micro)])?;
        }
        // A forward samples what the step left registered.
        e.forward(&toy::batch(V, T, 5 * micro, micro))?;
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
        let (registered, ledger) = measure(&c, 1);
        let est = estimate(&model(), &c, 1, T).unwrap().page_locked;
        eprintln!("parameters offloaded {params}: registered {registered}, ledger {ledger}, estimate {est:?}");
        assert!(est.staging > 0, "no staging priced");
        assert_eq!(est.parameters > 0, params);
        // The estimate is the measured step's registrations: the same bytes, not just close.
        assert_eq!(est.total(), registered, "estimate {est:?}");
        assert_eq!(ledger, registered, "ledger");
    }
    // The CPU page-locks nothing, and the estimate of a CPU run says so.
    let mut cpu = cfg(true);
    cpu.device = Device::Cpu;
    let e = estimate(&model(), &cpu, 1, T).unwrap();
    assert_eq!(e.page_locked.total(), 0);
}

/// Rows whose checkpoints (a layer's input: rows x T x 2048 bf16 = 2 MiB) pass the staging
/// pool's registration threshold.
const CKPT_ROWS: usize = 64;

/// A checkpoint's bytes at [`CKPT_ROWS`] rows.
const CKPT_BYTES: u64 = (CKPT_ROWS * T * 2048 * 2) as u64;

#[test]
fn checkpoint_and_snapshot_staging_are_priced() {
    let mut c = cfg(false);
    c.train_micro_batch_size_per_gpu = CKPT_ROWS;
    c.train_batch_size = CKPT_ROWS;
    // Checkpoints go down to host staging after each layer's forward and come back ahead.
    c.activation_checkpointing = Some(common::checkpointing(true));
    // The speculative overlap: clipping on (never binding here, so every group is saved and
    // the snapshots hold their staging as in a run whose speculation stands).
    c.zero.overlap_comm = true;
    c.gradient_clipping = 1e9;
    let (registered, ledger) = measure(&c, CKPT_ROWS);
    let est = estimate(&model(), &c, CKPT_ROWS, T).unwrap().page_locked;
    eprintln!(
        "checkpoints and snapshots: registered {registered}, ledger {ledger}, estimate {est:?}"
    );
    // What the two steps left registered, which the forward samples, is the estimate's, to
    // one checkpoint: the lane's snapshots and the checkpoints take buffers from one staging
    // pool on two threads, and whether a returned checkpoint buffer is reused or a new one
    // registered follows their timing (seen: exact, and under load one checkpoint less).
    assert!(
        est.total().abs_diff(ledger) <= CKPT_BYTES,
        "estimate {est:?} vs {ledger}"
    );
    // The sampling forward then registers one checkpoint more: outside `train_batch` the
    // last unit's forward is not fused with its backward, so its input goes down too.
    assert_eq!(registered, ledger + CKPT_BYTES, "registered");
    // Without either, their staging is not priced.
    let mut plain = cfg(false);
    plain.train_micro_batch_size_per_gpu = CKPT_ROWS;
    plain.train_batch_size = CKPT_ROWS;
    let without = estimate(&model(), &plain, CKPT_ROWS, T)
        .unwrap()
        .page_locked;
    assert!(
        est.staging >= without.staging + 2 * CKPT_BYTES,
        "with checkpoints and snapshots {est:?}, without {without:?}"
    );
}
