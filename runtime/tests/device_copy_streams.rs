//! The offloaded optimizer's copies on the copy streams, read from the emulated device's issue
//! trace (its streams run synchronously, so the trace is the order the engine asked for):
//! gradients go down on the device-to-host stream behind an event of the compute stream and
//! without the host waiting at issue, updated parameters go up on the host-to-device stream,
//! and the compute stream waits for an upload only where the next forward uses it. The bits
//! are those of the run without offload on the same device.
#![cfg(feature = "cuda")]

mod common;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use common::{config, toy};
use ferrozero_config::resolved::{
    CommsLoggerConfig, OffloadTarget, Precision, ResolvedConfig, ZeroStage,
};
use ferrozero_runtime::backend::cuda::driver::{Event, StreamKind, TraceOp, Traced};
use ferrozero_runtime::backend::cuda::{self, CudaBackend};
use ferrozero_runtime::backend::Backend;
use ferrozero_runtime::comm::local::run_ranks;
use ferrozero_runtime::engine::ledger::{Category, Location};
use ferrozero_runtime::engine::{Engine, NamedTensor};
use ferrozero_runtime::nn::Model;
use ferrozero_runtime::tensor::DType;

const V: usize = 23;
const T: usize = 6;

fn model() -> Model {
    common::tiny::small_llama(V, T)
}

fn device() -> Arc<CudaBackend> {
    cuda::emulated(DType::Bf16).expect("the emulated device")
}

fn cfg(stage: ZeroStage, offload: bool, overlap: bool) -> ResolvedConfig {
    let mut c = config(stage, 1, 2, 2, Precision::Bf16);
    c.gradient_clipping = 0.0;
    c.zero.overlap_comm = overlap;
    c.monitor.comms_logger = Some(CommsLoggerConfig {
        verbose: false,
        prof_all: true,
        prof_ops: Vec::new(),
        debug: false,
    });
    if offload {
        c.zero.offload_optimizer.target = OffloadTarget::Cpu;
    }
    c
}

fn batches(step: usize) -> Vec<ferrozero_runtime::nn::Batch> {
    (0..2)
        .map(|m| toy::batch(V, T, (step * 2 + m) * 2, 2))
        .collect()
}

/// What one traced step shows, with the bytes it should move.
struct Traces {
    /// `train_batch` of the traced step.
    step: Vec<Traced>,
    /// The forward after it.
    forward: Vec<Traced>,
    /// That forward's backward.
    backward: Vec<Traced>,
    /// Bytes of the gradient accumulators in host memory and on the device, and of the
    /// parameters on the device (the ledger's).
    grad_bytes: u64,
    device_grad_bytes: u64,
    param_bytes: u64,
    /// Groups with parameters (units and the tied table; the embedding has none of its own).
    groups: usize,
    /// Bytes all-gathered by the communicator over both steps and the forward.
    gathered: u64,
}

/// One untraced step, one traced step and a traced forward on a fresh emulated device.
fn traced(cfg: &ResolvedConfig) -> Traces {
    let dev = device();
    let be: Arc<dyn Backend> = dev.clone();
    let out = run_ranks(1, Duration::from_secs(300), |comm| {
        let mut e = Engine::with_backend(model(), cfg.clone(), comm, be.clone())?;
        e.train_batch(&batches(0))?;
        let obs = dev.device().observed();
        obs.start_trace();
        e.train_batch(&batches(1))?;
        let step = obs.take_trace();
        obs.start_trace();
        e.forward(&batches(2)[0])?;
        let forward = obs.take_trace();
        obs.start_trace();
        e.backward()?;
        let backward = obs.take_trace();
        let bytes = |c: Category| e.ledger().current(Location::Device, c);
        let stats = e.comm_stats().expect("the comms logger is on");
        Ok(Traces {
            step,
            forward,
            backward,
            grad_bytes: e.ledger().current(Location::Host, Category::Gradients),
            device_grad_bytes: bytes(Category::Gradients),
            param_bytes: bytes(Category::Parameters),
            groups: e
                .gradient_shards()?
                .iter()
                .filter(|g| !g.data.is_empty())
                .count(),
            gathered: stats.bytes("all_gather_into_tensor"),
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

/// Events recorded on stream `s`.
fn recorded_on(t: &[Traced], s: StreamKind) -> HashSet<Event> {
    on(t, s)
        .filter_map(|(_, op)| match op {
            TraceOp::Record(e) => Some(*e),
            _ => None,
        })
        .collect()
}

fn is_kernel(op: &TraceOp) -> bool {
    matches!(op, TraceOp::Launch(_) | TraceOp::Gemm)
}

/// Each download on the device-to-host stream: issued without a host wait, after a wait on
/// an event recorded on the compute stream. Returns the downloads' total bytes.
fn check_downloads(t: &[Traced]) -> u64 {
    let compute = recorded_on(t, StreamKind::Compute);
    let mut ordered = false;
    let mut bytes = 0;
    for (i, op) in on(t, StreamKind::DeviceToHost) {
        match op {
            TraceOp::Wait(e) => ordered = compute.contains(e),
            TraceOp::CopyDtoH { bytes: b, wait } => {
                assert!(!wait, "download at {i} waited at issue: {op:?}");
                assert!(
                    ordered,
                    "download at {i} not ordered after the compute stream"
                );
                bytes += *b as u64;
            }
            _ => {}
        }
    }
    bytes
}

/// Each upload on the host-to-device stream: issued without a host wait and followed by an
/// event on that stream. Returns the uploads' total bytes and their events.
fn check_uploads(t: &[Traced]) -> (u64, Vec<Event>) {
    let (mut bytes, mut events, mut last_copy) = (0, Vec::new(), false);
    for (i, op) in on(t, StreamKind::HostToDevice) {
        match op {
            TraceOp::CopyHtoD { bytes: b, wait } => {
                assert!(!wait, "upload at {i} waited at issue");
                bytes += *b as u64;
                last_copy = true;
            }
            TraceOp::Record(e) if last_copy => {
                events.push(*e);
                last_copy = false;
            }
            _ => {}
        }
    }
    assert!(!last_copy, "an upload without an event after it");
    (bytes, events)
}

/// Position of the compute stream's wait for `e`, if any.
fn compute_waits_for(t: &[Traced], e: Event) -> Option<usize> {
    on(t, StreamKind::Compute)
        .find(|(_, op)| **op == TraceOp::Wait(e))
        .map(|(i, _)| i)
}

fn copies_follow_the_stream_order(overlap: bool) {
    for stage in [ZeroStage::Stage2, ZeroStage::Stage3] {
        let what = format!("{stage:?}, overlap {overlap}");
        let t = traced(&cfg(stage, true, overlap));
        assert_eq!(
            t.device_grad_bytes, 0,
            "{what}: an accumulator on the device"
        );
        assert!(t.grad_bytes > 0, "{what}: no accumulator in host memory");
        assert_eq!(
            check_downloads(&t.step),
            2 * t.grad_bytes,
            "{what}: every micro-step's gradient byte goes down on the copy stream, once"
        );
        downloads_follow_backward(&t, &what);
        let (up, events) = check_uploads(&t.step);
        assert_eq!(
            up, t.param_bytes,
            "{what}: every parameter byte goes up on the copy stream, once"
        );
        assert!(!events.is_empty(), "{what}: no uploads");
        let syncs = on(&t.step, StreamKind::Compute)
            .filter(|(_, op)| **op == TraceOp::Synchronize)
            .count();
        assert_eq!(syncs, 0, "{what}: the compute stream was synchronized");
        // Each upload is waited for where its parameters are next used, or, once later
        // groups' uploads took its place in the window of staging memory, by the host (its
        // staging then goes back): never by the compute stream inside the step.
        let host_waited = |e: Event| {
            t.step
                .iter()
                .any(|(s, op)| s.is_none() && *op == TraceOp::HostWaitEvent(e))
        };
        let mut released = 0;
        for &e in &events {
            assert_eq!(
                compute_waits_for(&t.step, e),
                None,
                "{what}: compute waited for an upload inside the step"
            );
            if host_waited(e) {
                released += 1;
                continue;
            }
            assert!(
                compute_waits_for(&t.forward, e).is_some(),
                "{what}: the next forward did not wait for upload {e:?}"
            );
        }
        assert!(
            released < events.len(),
            "{what}: every upload was released by the host"
        );
        // The first unit's parameters (and the tied table) are waited for before any kernel.
        let first_kernel = on(&t.forward, StreamKind::Compute)
            .find(|(_, op)| is_kernel(op))
            .map(|(i, _)| i)
            .expect("the forward runs kernels");
        let first_wait = events
            .iter()
            .filter_map(|&e| compute_waits_for(&t.forward, e))
            .min()
            .unwrap();
        assert!(
            first_wait < first_kernel,
            "{what}: a kernel ran before the first wait"
        );
        // Some wait comes after a kernel: the later units' uploads are waited for where
        // those units start, not all up front. (With the overlap, the lane steps the last
        // unit first: the uploads the window still holds at the forward are the first
        // units', all needed at its start.)
        let last_wait = events
            .iter()
            .filter_map(|&e| compute_waits_for(&t.forward, e))
            .max()
            .unwrap();
        assert!(
            overlap || last_wait > first_kernel,
            "{what}: every wait came before the forward"
        );
        if overlap {
            // Gradients leave while backward still runs: a kernel follows the first download.
            let first_down = on(&t.step, StreamKind::DeviceToHost)
                .find(|(_, op)| matches!(op, TraceOp::CopyDtoH { .. }))
                .map(|(i, _)| i)
                .unwrap();
            assert!(
                on(&t.step, StreamKind::Compute).any(|(i, op)| i > first_down && is_kernel(op)),
                "{what}: the downloads waited for the end of backward"
            );
        }
    }
}

/// One micro-step's backward: each group's gradient goes down as soon as it is reduced, while
/// backward still runs: between one group's download and the next the compute stream runs
/// the next unit's backward kernels (the tied table's goes down after the embedding's
/// backward, the last unit backward reaches). Nothing waits for a stream.
fn downloads_follow_backward(t: &Traces, what: &str) {
    let b = &t.backward;
    assert_eq!(check_downloads(b), t.grad_bytes, "{what}: one micro-step");
    let downs: Vec<usize> = on(b, StreamKind::DeviceToHost)
        .filter(|(_, op)| matches!(op, TraceOp::CopyDtoH { .. }))
        .map(|(i, _)| i)
        .collect();
    assert_eq!(downs.len(), t.groups, "{what}: one download per group");
    assert!(t.groups > 2, "{what}: too few groups to tell an order");
    for (k, pair) in downs.windows(2).enumerate() {
        assert!(
            on(b, StreamKind::Compute).any(|(i, op)| i > pair[0] && i < pair[1] && is_kernel(op)),
            "{what}: download {k} was not issued before the next unit's backward"
        );
    }
    let syncs = b.iter().filter(|(_, op)| *op == TraceOp::Synchronize);
    assert_eq!(
        syncs.count(),
        0,
        "{what}: a stream was synchronized in backward"
    );
}

/// In `t`: every upload on the host-to-device stream waited for by the compute stream once,
/// and each issued before the kernels of the unit before it; no stream synchronized.
fn uploads_run_ahead(t: &[Traced], units: usize, what: &str) {
    let h2d = recorded_on(t, StreamKind::HostToDevice);
    let waits: Vec<(usize, Event)> = on(t, StreamKind::Compute)
        .filter_map(|(i, op)| match op {
            TraceOp::Wait(e) if h2d.contains(e) => Some((i, *e)),
            _ => None,
        })
        .collect();
    // Every unit gathered with parameters of its own, and the tied table, is waited for once.
    assert_eq!(waits.len(), units, "{what}: waits {waits:?}");
    assert_eq!(waits.len(), h2d.len(), "{what}: an upload never waited for");
    let record_at = |e: Event| {
        t.iter()
            .position(|x| *x == (Some(StreamKind::HostToDevice), TraceOp::Record(e)))
            .unwrap()
    };
    for pair in waits.windows(2) {
        let ((at, _), (_, next)) = (pair[0], pair[1]);
        let first_kernel = on(t, StreamKind::Compute)
            .find(|(i, op)| *i > at && is_kernel(op))
            .map_or(usize::MAX, |(i, _)| i);
        assert!(
            record_at(next) < first_kernel,
            "{what}: an upload was issued after the previous unit's kernels"
        );
    }
    for (i, op) in on(t, StreamKind::HostToDevice) {
        if let TraceOp::CopyHtoD { wait, .. } = op {
            assert!(!wait, "{what}: upload at {i} waited at issue");
        }
    }
    let syncs = t.iter().filter(|(_, op)| *op == TraceOp::Synchronize);
    assert_eq!(syncs.count(), 0, "{what}: a stream was synchronized");
}

/// Stage 3 with the parameters in host memory at one rank: no all-gather, each unit's shard
/// goes up on the host-to-device stream before the previous unit's kernels are issued, and
/// the compute stream waits for it where the unit starts; in forward, and in backward when
/// units are released after forward.
fn parameter_uploads_run_ahead(overlap: bool) {
    let mut c = cfg(ZeroStage::Stage3, true, overlap);
    c.zero.offload_param.target = OffloadTarget::Cpu;
    // Room to prefetch any one unit (`stage3_prefetch_bucket_size` bounds uploads ahead too).
    c.zero.prefetch_bucket_size = 1 << 20;
    let t = traced(&c);
    assert_eq!(
        t.gathered, 0,
        "overlap {overlap}: a collective gathered parameters"
    );
    // The tied table, the two layers and the head (the embedding has no parameters of its own).
    uploads_run_ahead(&t.forward, 4, &format!("forward, overlap {overlap}"));
    c.zero.max_reuse_distance = 0;
    let t = traced(&c);
    // The head and the table stay gathered from forward (used again at once): the two layers
    // and the table again for the embedding.
    uploads_run_ahead(&t.backward, 3, &format!("backward, overlap {overlap}"));
}

#[test]
fn offloaded_parameters_upload_ahead_without_a_gather() {
    parameter_uploads_run_ahead(false);
    parameter_uploads_run_ahead(true);
}

#[test]
fn offloaded_step_copies_on_the_copy_streams() {
    copies_follow_the_stream_order(false);
}

#[test]
fn overlapped_offloaded_step_copies_on_the_copy_streams() {
    copies_follow_the_stream_order(true);
}

fn train(cfg: &ResolvedConfig, steps: usize) -> Vec<NamedTensor> {
    let be: Arc<dyn Backend> = device();
    let out = run_ranks(1, Duration::from_secs(300), |comm| {
        let mut e = Engine::with_backend(model(), cfg.clone(), comm, be.clone())?;
        for s in 0..steps {
            e.train_batch(&batches(s))?;
        }
        e.parameters()
    })
    .expect("training on the emulated device");
    out.into_iter().next().unwrap()
}

use common::runs::named_bits as bits;

/// Stages 1-3 with the optimizer offloaded (and at stage 3 the parameters too), overlapped or
/// not: the bits of the device's own optimizer.
#[test]
fn offloaded_copies_change_no_bit() {
    for stage in [ZeroStage::Stage1, ZeroStage::Stage2, ZeroStage::Stage3] {
        let plain = bits(&train(&cfg(stage, false, false), 3));
        for (overlap, params) in [(false, false), (true, false), (false, true), (true, true)] {
            if params && stage != ZeroStage::Stage3 {
                continue;
            }
            let mut c = cfg(stage, true, overlap);
            if params {
                c.zero.offload_param.target = OffloadTarget::Cpu;
            }
            let got = bits(&train(&c, 3));
            assert!(
                plain == got,
                "{stage:?} overlap {overlap} parameters offloaded {params}: offload differs"
            );
        }
    }
}

/// The host parameter store of stage 3 is page-locked with the device's driver while the
/// engine lives (best effort: the emulator, as CUDA, refuses a range sharing a page with one
/// already registered, so small neighbouring shards stay pageable) and released with it and
/// the device.
#[test]
fn the_host_parameter_store_is_page_locked_while_the_engine_lives() {
    use ferrozero_runtime::backend::cuda::driver::EmuDriver;
    use ferrozero_runtime::backend::cuda::CudaDevice;
    let drv = Arc::new(EmuDriver::builtin().expect("the emulator"));
    let dev = CudaDevice::new(drv.clone(), None);
    let be: Arc<dyn Backend> = Arc::new(CudaBackend::new(dev, DType::Bf16));
    let mut c = cfg(ZeroStage::Stage3, true, false);
    c.zero.offload_param.target = OffloadTarget::Cpu;
    let seen = run_ranks(1, Duration::from_secs(300), |comm| {
        let mut e = Engine::with_backend(model(), c.clone(), comm, be.clone())?;
        let pinned = drv.registered_host_bytes();
        e.train_batch(&batches(0))?;
        Ok((
            pinned,
            e.ledger().current(Location::Host, Category::Parameters),
        ))
    })
    .expect("training on the emulated device");
    let (pinned, host_params) = seen[0];
    assert!(pinned > 0, "no shard was page-locked");
    assert!(pinned as u64 <= host_params, "{pinned} > {host_params}");
    // The device keeps page-locked memory of its own (the small-upload ring, the staging
    // pool) until it is dropped; with it gone nothing may stay registered.
    drop(be);
    assert_eq!(drv.registered_host_bytes(), 0, "released with the engine");
}
