//! The speculative optimizer overlap on the emulated device, on a step where clipping binds
//! after the lane stepped some groups: the snapshot of the device values (the parameters the
//! offloaded step uploads) goes down on the device-to-host stream and comes back on the
//! host-to-device stream, ordered by events; no stream is synchronized and no copy waits at
//! issue. The bits are those of the run with nothing offloaded and nothing overlapped.
#![cfg(feature = "cuda")]

mod common;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use common::{config, toy};
use ferrozero_config::resolved::{OffloadTarget, Precision, ResolvedConfig, ZeroStage};
use ferrozero_runtime::backend::cuda::driver::{Event, StreamKind, TraceOp, Traced};
use ferrozero_runtime::backend::cuda::{self, CudaBackend};
use ferrozero_runtime::backend::Backend;
use ferrozero_runtime::comm::local::run_ranks;
use ferrozero_runtime::engine::optimizer_overlap::OptimizerOverlap;
use ferrozero_runtime::engine::Engine;
use ferrozero_runtime::nn::{Batch, Model};
use ferrozero_runtime::tensor::DType;

const V: usize = 23;
const T: usize = 6;
const WORLD: usize = 1;

fn cfg(clip: f64, offload: bool) -> ResolvedConfig {
    let mut c = config(ZeroStage::Stage2, WORLD, 2, 2, Precision::Bf16);
    c.gradient_clipping = clip;
    if offload {
        c.zero.offload_optimizer.target = OffloadTarget::Cpu;
        c.zero.overlap_comm = true;
    }
    c
}

fn batches(step: usize, rank: usize) -> Vec<Batch> {
    (0..2)
        .map(|m| toy::batch(V, T, ((step * 2 + m) * WORLD + rank) * 2, 2))
        .collect()
}

/// Rank 0's view of one run of two steps: the first step's gradient norm, its stream trace,
/// how many groups it rolled back, and the parameters' bits after both steps.
struct Run {
    norm: f64,
    trace: Vec<Traced>,
    rolled_back: usize,
    /// Of those, the groups that own parameters (whose snapshots move bytes).
    rolled_back_owning: usize,
    bits: Vec<u32>,
}

fn train(cfg: &ResolvedConfig) -> Run {
    train_with(cfg, None)
}

/// [`train`], with the optimizer overlap `overlap` when given instead of the config's.
fn train_with(cfg: &ResolvedConfig, overlap: Option<OptimizerOverlap>) -> Run {
    let out = run_ranks(WORLD, Duration::from_secs(300), |comm| {
        let rank = comm.rank();
        let dev: Arc<CudaBackend> = cuda::emulated(DType::Bf16)?;
        let be: Arc<dyn Backend> = dev.clone();
        let mut e = match overlap.clone() {
            Some(o) => Engine::with_backend_and_overlap(toy_model(), cfg.clone(), comm, be, o)?,
            None => Engine::with_backend(toy_model(), cfg.clone(), comm, be)?,
        };
        e.trace_schedule(true);
        let obs = dev.device().observed();
        obs.start_trace();
        let r = e.train_batch(&batches(0, rank))?;
        let trace = obs.take_trace();
        let rolled_back: Vec<usize> = e
            .take_schedule_trace()
            .iter()
            .filter(|s| s.lane == "compute" && s.op == "rollback")
            .map(|s| s.index)
            .collect();
        e.train_batch(&batches(1, rank))?;
        let bits = e
            .parameters()?
            .iter()
            .flat_map(|t| t.data.iter().map(|x| x.to_bits()))
            .collect();
        // A group owning no parameters (the embedding unit's table is the shared group's)
        // has no snapshot bytes to move.
        let model = toy_model();
        let owns = |g: usize| match model.units.get(g) {
            Some(u) => !u.module.param_specs().is_empty(),
            None => !model.shared.is_empty(),
        };
        Ok(Run {
            norm: r.grad_norm,
            trace,
            rolled_back: rolled_back.len(),
            rolled_back_owning: rolled_back.iter().filter(|&&g| owns(g)).count(),
            bits,
        })
    })
    .expect("training on the emulated device");
    out.into_iter().next().unwrap()
}

fn toy_model() -> Model {
    common::tiny::small_llama(V, T)
}

fn on(t: &[Traced], s: StreamKind) -> impl Iterator<Item = (usize, &TraceOp)> {
    t.iter()
        .enumerate()
        .filter(move |(_, (k, _))| *k == Some(s))
        .map(|(i, (_, op))| (i, op))
}

#[test]
fn a_binding_step_rolls_back_on_the_copy_streams() {
    // One rank (several ranks fence their device collectives with stream synchronizations).
    // The first step's global norm without clipping, then a threshold just under it: the lane
    // steps groups until the last one lent takes its sum past the threshold, and the step
    // undoes them.
    let free = train(&cfg(0.0, true));
    assert_eq!(free.rolled_back, 0);
    let (clip, run) = [0.999, 0.99, 0.9]
        .into_iter()
        .map(|f| f * free.norm)
        .map(|clip| (clip, train(&cfg(clip, true))))
        .find(|(_, r)| r.rolled_back > 0)
        .expect("no threshold under the norm rolled a step back");
    let plain = train(&cfg(clip, false));
    assert!(plain.bits == run.bits, "the rolled-back run differs");
    let t = &run.trace;
    let syncs = t.iter().filter(|(_, op)| *op == TraceOp::Synchronize);
    assert_eq!(syncs.count(), 0, "a stream was synchronized");
    for s in [StreamKind::DeviceToHost, StreamKind::HostToDevice] {
        for (i, op) in on(t, s) {
            if let TraceOp::CopyDtoH { wait: true, .. } | TraceOp::CopyHtoD { wait: true, .. } = op
            {
                panic!("copy at {i} on {s:?} waited at issue");
            }
        }
    }
    // A synchronous download waits for the compute stream: the snapshots add none to what
    // the step without them reads back.
    let sync_down = |t: &[Traced]| {
        t.iter()
            .filter(|(_, op)| matches!(op, TraceOp::CopyDtoH { wait: true, .. }))
            .count()
    };
    assert_eq!(
        sync_down(t),
        sync_down(&free.trace),
        "the snapshots waited for the device"
    );
    // The snapshots' downloads: the parameters of every stepped group went down.
    let down = on(t, StreamKind::DeviceToHost)
        .filter(|(_, op)| matches!(op, TraceOp::CopyDtoH { .. }))
        .count();
    let free_down = on(&free.trace, StreamKind::DeviceToHost)
        .filter(|(_, op)| matches!(op, TraceOp::CopyDtoH { .. }))
        .count();
    assert!(
        run.rolled_back_owning > 0 && down >= free_down + run.rolled_back_owning,
        "{down} downloads, {free_down} without snapshots, {} rolled back owning parameters",
        run.rolled_back_owning
    );
    // The restores: uploads whose events the compute stream waits for.
    let h2d: HashSet<Event> = on(t, StreamKind::HostToDevice)
        .filter_map(|(_, op)| match op {
            TraceOp::Record(e) => Some(*e),
            _ => None,
        })
        .collect();
    let waits = on(t, StreamKind::Compute)
        .filter(|(_, op)| matches!(op, TraceOp::Wait(e) if h2d.contains(e)))
        .count();
    assert!(
        waits >= run.rolled_back,
        "{waits} waits for {} restores",
        run.rolled_back
    );
}

/// A speculation bounded to the last unit's group on the device: with clipping that binds and
/// that does not, the bits of the run with nothing offloaded and nothing overlapped, and a
/// binding step rolls back that group alone.
#[test]
fn bounded_snapshots_on_the_device_keep_the_bits() {
    let free = train(&cfg(0.0, true));
    let m = toy_model();
    let offloaded = cfg(1.0, true);
    let e = ferrozero_runtime::engine::estimate::estimate(&m, &offloaded, 2, T).unwrap();
    let last = m.units.len() - 1;
    let bound = e.snapshot_group_bytes[last];
    assert!(bound > 0, "the last unit's group owns parameters");
    for clip in [0.5 * free.norm, 2.0 * free.norm] {
        let overlap = OptimizerOverlap::Speculative("test".into(), Some(bound));
        let run = train_with(&cfg(clip, true), Some(overlap));
        let plain = train(&cfg(clip, false));
        assert!(
            plain.bits == run.bits,
            "clip {clip}: the bounded run differs"
        );
        assert!(
            run.rolled_back <= 1,
            "clip {clip}: {} rolled back",
            run.rolled_back
        );
    }
}
