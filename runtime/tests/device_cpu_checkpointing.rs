//! `activation_checkpointing.cpu_checkpointing` on the emulated device: each checkpointed
//! unit's input goes down to page-locked host memory on the device-to-host stream after the
//! unit's forward and comes back on the host-to-device stream one unit ahead of its recompute,
//! ordered by events (no stream synchronized, no copy waiting at issue). The bits are those of
//! checkpoints kept on the device, the allocator's peak drops by what the checkpoints held,
//! and the estimate prices it within 5%.
#![cfg(feature = "cuda")]

mod common;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use common::{checkpointing, config, toy};
use ferrozero_config::resolved::{OffloadTarget, Precision, ResolvedConfig, ZeroStage};
use ferrozero_config::Device;
use ferrozero_runtime::backend::cuda::driver::{Event, StreamKind, TraceOp, Traced};
use ferrozero_runtime::backend::cuda::{self, CudaBackend};
use ferrozero_runtime::backend::{Backend, Rope};
use ferrozero_runtime::comm::local::run_ranks;
use ferrozero_runtime::engine::estimate::estimate;
use ferrozero_runtime::engine::ledger::{Category, Location};
use ferrozero_runtime::engine::Engine;
use ferrozero_runtime::nn::{llama, Batch, Model};
use ferrozero_runtime::tensor::DType;

const MICRO: usize = 4;
const SEQ: usize = 64;
const VOCAB: usize = 64;

/// Eight narrow layers over a long sequence: the checkpoints are a visible share of the peak.
fn model() -> Model {
    llama::build(&llama::LlamaConfig {
        hidden_size: 64,
        intermediate_size: 128,
        num_hidden_layers: 8,
        num_attention_heads: 4,
        num_key_value_heads: None,
        head_dim: None,
        rms_norm_eps: 1e-6,
        rope: Rope::plain(10000.0),
        vocab_size: VOCAB,
        max_position_embeddings: SEQ,
        tie_word_embeddings: false,
        initializer_range: 0.3,
        qkv_bias: false,
        sliding_window: None,
        attention_dropout: 0.0,
    })
    .expect("a valid Llama")
}

fn cfg(stage: ZeroStage, cpu: bool) -> ResolvedConfig {
    let mut c = config(stage, 1, MICRO, 2, Precision::Bf16);
    c.device = Device::Cuda(None);
    c.activation_checkpointing = Some(checkpointing(cpu));
    // The optimizer's state in host memory: the device holds little besides activations.
    c.zero.offload_optimizer.target = OffloadTarget::Cpu;
    c
}

fn batches(step: usize) -> Vec<Batch> {
    (0..2)
        .map(|m| toy::batch(VOCAB, SEQ, (step * 2 + m) * MICRO, MICRO))
        .collect()
}

/// What one run on a fresh emulated device leaves.
struct Run {
    bits: Vec<(String, Vec<u32>)>,
    /// The allocator's peak.
    peak: u64,
    /// The second step's stream trace.
    trace: Vec<Traced>,
    /// The ledger's peak of checkpoints in host memory (one micro-step's inputs).
    host_ckpt: u64,
}

fn train(cfg: &ResolvedConfig) -> Run {
    let dev: Arc<CudaBackend> = cuda::emulated(DType::Bf16).expect("the emulated device");
    let be: Arc<dyn Backend> = dev.clone();
    let out = run_ranks(1, Duration::from_secs(300), |comm| {
        let mut e = Engine::with_backend(model(), cfg.clone(), comm, be.clone())?;
        e.train_batch(&batches(0))?;
        let obs = dev.device().observed();
        obs.start_trace();
        e.train_batch(&batches(1))?;
        let trace = obs.take_trace();
        e.train_batch(&batches(2))?;
        let bits = common::runs::named_bits(&e.parameters()?);
        Ok(Run {
            bits,
            peak: e.backend().memory_stats().map_or(0, |m| m.peak),
            trace,
            host_ckpt: e.ledger().peak(Location::Host, Category::Activations),
        })
    })
    .expect("training on the emulated device");
    out.into_iter().next().unwrap()
}

fn on(t: &[Traced], s: StreamKind) -> impl Iterator<Item = (usize, &TraceOp)> {
    t.iter()
        .enumerate()
        .filter(move |(_, (k, _))| *k == Some(s))
        .map(|(i, (_, op))| (i, op))
}

fn is_kernel(op: &TraceOp) -> bool {
    matches!(op, TraceOp::Launch(_) | TraceOp::Gemm)
}

#[test]
fn cpu_checkpoints_change_no_bit_and_leave_the_device() {
    for stage in [ZeroStage::Stage0, ZeroStage::Stage3] {
        let kept = train(&cfg(stage, false));
        let c = cfg(stage, true);
        let moved = train(&c);
        assert!(
            kept.bits == moved.bits,
            "{stage:?}: cpu_checkpointing differs"
        );
        assert_eq!(
            kept.host_ckpt, 0,
            "{stage:?}: device checkpoints counted on the host"
        );
        assert!(
            moved.host_ckpt > 0,
            "{stage:?}: no checkpoint in host memory"
        );
        // Every checkpoint but the two around the unit in backward leaves the device.
        eprintln!(
            "{stage:?}: peak {} with host checkpoints, {} on the device; checkpoints {}",
            moved.peak, kept.peak, moved.host_ckpt
        );
        assert!(
            moved.peak + moved.host_ckpt / 2 <= kept.peak,
            "{stage:?}: peak {} with host checkpoints vs {} on the device",
            moved.peak,
            kept.peak
        );
        for (what, c, run) in [("device", cfg(stage, false), &kept), ("host", c, &moved)] {
            let est = estimate(&model(), &c, MICRO, SEQ)
                .unwrap()
                .device
                .peak_bytes;
            let off = (est as f64 - run.peak as f64).abs() / run.peak as f64;
            eprintln!(
                "{stage:?} {what} checkpoints: estimate {est} peak {}",
                run.peak
            );
            assert!(
                off <= 0.05,
                "{stage:?}, {what} checkpoints: estimate {est} vs allocator peak {} ({:.2}%)",
                run.peak,
                off * 100.0
            );
        }
    }
}

#[test]
fn checkpoints_travel_on_the_copy_streams_ordered_by_events() {
    // The optimizer on the device: the copy streams carry checkpoints alone.
    let mut c = cfg(ZeroStage::Stage0, true);
    c.zero.offload_optimizer.target = OffloadTarget::None;
    let run = train(&c);
    let t = &run.trace;
    let compute: HashSet<Event> = on(t, StreamKind::Compute)
        .filter_map(|(_, op)| match op {
            TraceOp::Record(e) => Some(*e),
            _ => None,
        })
        .collect();
    // Down: each copy after a wait on the compute stream, none waiting at issue.
    let (mut ordered, mut down) = (false, 0u64);
    for (i, op) in on(t, StreamKind::DeviceToHost) {
        match op {
            TraceOp::Wait(e) => ordered = compute.contains(e),
            TraceOp::CopyDtoH { bytes, wait } => {
                assert!(!wait, "download at {i} waited at issue");
                assert!(ordered, "download at {i} not ordered after compute");
                down += *bytes as u64;
            }
            _ => {}
        }
    }
    // Two micro-steps, each sending every checkpoint down once.
    assert_eq!(down, 2 * run.host_ckpt, "checkpoint bytes sent down");
    // Up: each copy after a wait on the compute stream, an event after it that the compute
    // stream waits for, with kernels between (the upload ran one unit ahead).
    let (mut ordered, mut up, mut last_copy) = (false, 0u64, false);
    let mut events = Vec::new();
    for (i, op) in on(t, StreamKind::HostToDevice) {
        match op {
            TraceOp::Wait(e) => ordered = compute.contains(e),
            TraceOp::CopyHtoD { bytes, wait } => {
                assert!(!wait, "upload at {i} waited at issue");
                assert!(ordered, "upload at {i} not ordered after compute");
                up += *bytes as u64;
                last_copy = true;
            }
            TraceOp::Record(e) if last_copy => {
                events.push((i, *e));
                last_copy = false;
            }
            _ => {}
        }
    }
    assert_eq!(up, down, "checkpoint bytes brought back");
    let mut ahead = 0;
    for &(at, e) in &events {
        let waited = on(t, StreamKind::Compute)
            .find(|(_, op)| **op == TraceOp::Wait(e))
            .map(|(i, _)| i)
            .unwrap_or_else(|| panic!("the compute stream never waited for upload {e:?}"));
        assert!(waited > at);
        if on(t, StreamKind::Compute).any(|(i, op)| i > at && i < waited && is_kernel(op)) {
            ahead += 1;
        }
    }
    // The last unit's checkpoint goes up at its own recompute; every other one a unit ahead.
    assert!(
        ahead + 2 >= events.len() && ahead > 0,
        "{ahead} of {} uploads ran ahead",
        events.len()
    );
    let syncs = t.iter().filter(|(_, op)| *op == TraceOp::Synchronize);
    assert_eq!(syncs.count(), 0, "a stream was synchronized");
}
