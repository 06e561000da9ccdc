//! How often a training step on the device makes the host wait, and how many kernels a
//! transformer block costs, counted by the driver layer (`Observed`) on the emulated device:
//! small GPT-2 and Llama models, bf16, AdamW, clipping 1.0, world size 1 (and GPT-2 at two
//! ranks), stages 0 and 3, two micro-batches per step (and one, where the gradient moves into
//! place). Each case prints where every host sync of a step came from (the
//! operation and the kernel issued just before it), so a regression names its source.

#![cfg(feature = "cuda")]

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use common::tiny::{gpt2_model, llama_model, VOCAB};
use common::{config, toy};
use ferrozero_config::resolved::{Precision, ZeroStage};
use ferrozero_runtime::backend::cuda::driver::{StreamKind, TraceOp, Traced};
use ferrozero_runtime::backend::cuda::{self, CudaBackend};
use ferrozero_runtime::backend::{Backend, DeviceActivity, MemoryOps};
use ferrozero_runtime::comm::local::run_ranks;
use ferrozero_runtime::engine::Engine;
use ferrozero_runtime::nn::Model;
use ferrozero_runtime::tensor::DType;

const SEQ: usize = 8;
const GAS: usize = 2;

/// Host syncs one optimizer step may make: the download of the step's status (the
/// micro-steps' losses, the gradient's sums of squares and the gradient scale the device
/// decided from them and applied), after the optimizer's launch. See `ARCHITECTURE.md` ("a
/// training step on a device waits for it once").
const MAX_SYNCS_PER_STEP: u64 = 1;

/// Kernel launches (GEMMs included) one GPT-2 block adds to a step of `GAS` micro-batches:
/// its forward and backward per micro-batch and its share of the optimizer step, measured as
/// the difference between a 2-block and a 1-block model. Per micro-batch 30:
/// 12 GEMMs (q/k/v, projection, fc, fc2 forward, GELU fused in fc's epilogue and each
/// residual add in its projection's, written out of place over the residual stream; dX and dW
/// of each backward), 4 attention (forward; dot, dQ, dK/dV backward), 4 LayerNorm (ln_1
/// forward also writing the block's copy of its input; ln_2 forward; 2 backward, each adding
/// the residual gradient around it to its dx) + 2 of their dgamma/dbeta finalizes, 6 bias
/// gradients (3 adds of cuBLASLt's BGRAD scratch to the f32 gradient; fc's GELU gradient
/// after its plain dX product and its bias gradient's 2-kernel column sum: cuBLASLt's
/// DGELU_BGRAD, one launch fewer, measured slower on an H200), 2 of the engine's micro-step
/// gradient (a cast to bf16, an add).
/// Per step 2: its sum of squares (partial sums and their finalize). The optimizer reads the
/// bf16 gradient as it is (no widening pass) and is one launch for the whole model
/// ([`check_optimizer_launch`]), not one per block. (Before the residual fusions: 37 per
/// micro-batch, 2 forward residual adds and 2 backward gradient adds more, and 2 copies;
/// before the whole step on the device, 4 per step.)
const GPT2_LAUNCHES_PER_BLOCK: u64 = GAS as u64 * 30 + 2;

/// The same for one Llama block. Per micro-batch 37: 21 GEMMs (q, k, v, o, gate, up, down
/// forward, o and down writing residual + product out of place; dX and dW of each), 4
/// attention, 4 RMSNorm (input_layernorm forward also writing the block's copy of its input;
/// both backward adding the residual gradient) + 2 dgamma finalizes, 2 RoPE (q and k in one
/// launch, forward and backward), 2 SwiGLU (gate and up read by one kernel each way), 2 of the
/// engine's micro-step gradient (a cast, an add). Per step 2, as GPT-2's. (Before: 41, with 2
/// gradient adds and 2 RoPE launches more.)
const LLAMA_LAUNCHES_PER_BLOCK: u64 = GAS as u64 * 37 + 2;

/// The same for one GPT-2 block at one micro-batch per step, where the reduced gradient moves
/// into place (`rules::gradient_by_move`): the micro-batch's 30 less the engine's cast and add
/// (the step reads the f32 gradient rounded to bf16 in registers), and the step's 2.
const GPT2_LAUNCHES_PER_BLOCK_ONE_MICRO: u64 = 28 + 2;

/// The same for one Llama block at one micro-batch per step: 37 - 2, and the step's 2.
const LLAMA_LAUNCHES_PER_BLOCK_ONE_MICRO: u64 = 35 + 2;

/// Optimizer launches of a step: one multi-tensor AdamW over every group (at one rank and at
/// several).
/// Before the step ran whole on the device it was one per group (5 for the 2-block GPT-2: 2
/// blocks, embeddings, final norm with the head, the tied parameters), each after a pass
/// widening the group's bf16 gradient to f32.
const OPTIMIZER_LAUNCHES_PER_STEP: usize = 1;

/// The optimizer's launches in `s`'s step, then its host syncs: one launch over every group,
/// after the clip scale computed on the device, and no sync before it (none between the
/// first forward and the update: the step's one wait reads the status after it).
fn check_optimizer_launch(label: &str, s: &Step) {
    let at = |pred: &dyn Fn(&str) -> bool| -> Vec<usize> {
        s.trace
            .iter()
            .enumerate()
            .filter_map(|(i, (_, op))| match op {
                TraceOp::Launch(k) if pred(k) => Some(i),
                _ => None,
            })
            .collect()
    };
    let updates = at(&|k| k.starts_with("adam_multi"));
    assert_eq!(
        updates.len(),
        OPTIMIZER_LAUNCHES_PER_STEP,
        "{label}: optimizer launches {updates:?}"
    );
    let scale = at(&|k| k == "clip_grad_scale");
    assert!(
        scale.len() == 1 && scale[0] < updates[0],
        "{label}: the clip scale at {scale:?}, the update at {updates:?}"
    );
    assert!(
        !at(&|k| k.starts_with("cast_bf16_to_f32"))
            .iter()
            .any(|&i| i > scale[0]),
        "{label}: no gradient is widened for the optimizer"
    );
    let syncs: Vec<usize> = (0..s.trace.len())
        .filter(|&i| is_sync(&s.trace[i].1))
        .collect();
    assert!(
        syncs.iter().all(|&i| i > updates[0]),
        "{label}: host syncs at {syncs:?}, before the optimizer's launch at {}",
        updates[0]
    );
    println!(
        "{label}: {} optimizer launch at op {}, host syncs at {syncs:?} of {} ops",
        updates.len(),
        updates[0],
        s.trace.len()
    );
}

/// One traced step: its counts, its trace, and the device's peak live bytes so far.
struct Step {
    activity: DeviceActivity,
    trace: Vec<Traced>,
    peak: u64,
}

/// Trains three steps of `model` at one rank in bf16 on a fresh emulated device and traces
/// the third (the first ones compile kernels and fill the allocator's cache).
fn traced_step(model: impl Fn() -> Model + Sync, stage: ZeroStage) -> Step {
    traced_run(model, stage, 1, Precision::Bf16)
}

/// How a traced run accumulates: micro-batches per step, and whether it keeps accumulators
/// at one (`Engine::accumulate_gradients`, the path before gradients moved).
#[derive(Clone, Copy)]
struct Accumulation {
    gas: usize,
    keep: bool,
}

/// As [`traced_run`] with `acc`'s accumulation.
fn traced_run(
    model: impl Fn() -> Model + Sync,
    stage: ZeroStage,
    ranks: usize,
    precision: Precision,
) -> Step {
    let acc = Accumulation {
        gas: GAS,
        keep: false,
    };
    traced_run_with(model, stage, ranks, precision, acc)
}

/// As [`traced_step`] with `ranks` ranks (each on its own emulated device) in `precision`;
/// rank 0's step.
fn traced_run_with(
    model: impl Fn() -> Model + Sync,
    stage: ZeroStage,
    ranks: usize,
    precision: Precision,
    acc: Accumulation,
) -> Step {
    let act = match precision {
        Precision::Bf16 => DType::Bf16,
        Precision::Fp16(_) => DType::F16,
        _ => DType::F32,
    };
    let gas = acc.gas;
    let mut cfg = config(stage, ranks, 1, gas, precision);
    // DeepSpeed's default: one optimizer tile per group, as a real run has (the shared test
    // config's 17-element tiles exercise the tiling, not the step's cost).
    cfg.zero.sub_group_size = 1_000_000_000;
    // DeepSpeed's default buckets (the shared config's tiny ones multiply the collectives).
    cfg.zero.reduce_bucket_size = 500_000_000;
    cfg.zero.allgather_bucket_size = 500_000_000;
    cfg.zero.prefetch_bucket_size = 50_000_000;
    assert_eq!(cfg.gradient_clipping, 1.0);
    let out = run_ranks(ranks, Duration::from_secs(300), |comm| {
        let rank = comm.rank();
        let dev: Arc<CudaBackend> = cuda::emulated(act)?;
        let be: Arc<dyn Backend> = dev.clone();
        let mut e = Engine::with_backend(model(), cfg.clone(), comm, be)?;
        if acc.keep {
            e.accumulate_gradients()?;
        }
        let mut last = None;
        for s in 0..3 {
            let batches: Vec<_> = (0..gas)
                .map(|m| toy::batch(VOCAB, SEQ, (s * gas + m) * ranks + rank, 1))
                .collect();
            if s == 2 {
                dev.device().observed().start_trace();
            }
            let r = e.train_batch(&batches)?;
            assert!(r.loss.is_finite() && r.grad_norm.is_finite(), "{r:?}");
            last = r.device_activity;
        }
        let trace = dev.device().observed().take_trace();
        Ok(Step {
            activity: last.expect("the device counts its activity"),
            trace,
            peak: dev.memory_stats().map_or(0, |m| m.peak),
        })
    })
    .expect("training on the emulated device");
    out.into_iter().next().expect("rank 0")
}

/// Whether the host waited for the device at this operation.
fn is_sync(op: &TraceOp) -> bool {
    matches!(
        op,
        TraceOp::CopyHtoD { wait: true, .. }
            | TraceOp::CopyDtoH { wait: true, .. }
            | TraceOp::Synchronize
            | TraceOp::HostWaitEvent(_)
            | TraceOp::Free
    )
}

/// Each host sync of `trace` by where it came from: the operation, and the last kernel
/// issued before it (what the wait was for, or what the copy feeds).
fn sync_sources(trace: &[Traced]) -> BTreeMap<String, u64> {
    let mut last = "(start of step)".to_string();
    let mut out = BTreeMap::new();
    for (_, op) in trace {
        match op {
            TraceOp::Launch(k) => last = k.clone(),
            TraceOp::Gemm => last = "gemm".into(),
            op if is_sync(op) => {
                let what = match op {
                    TraceOp::CopyHtoD { bytes, .. } => format!("upload {bytes} B"),
                    TraceOp::CopyDtoH { bytes, .. } => format!("download {bytes} B"),
                    TraceOp::Synchronize => "stream synchronize".into(),
                    TraceOp::HostWaitEvent(_) => "event wait".into(),
                    _ => "free".into(),
                };
                *out.entry(format!("{what:<22} after {last}")).or_insert(0) += 1;
            }
            _ => {}
        }
    }
    out
}

/// Launches by kernel name (GEMMs as `gemm`).
fn launches(trace: &[Traced]) -> BTreeMap<String, i64> {
    let mut out = BTreeMap::new();
    for (_, op) in trace {
        let name = match op {
            TraceOp::Launch(k) => k.clone(),
            TraceOp::Gemm => "gemm".into(),
            _ => continue,
        };
        *out.entry(name).or_insert(0) += 1;
    }
    out
}

/// What one more block adds to a step, kernel by kernel.
fn block_launches(two: &Step, one: &Step) -> String {
    let (a, b) = (launches(&two.trace), launches(&one.trace));
    a.iter()
        .map(|(k, n)| (k, n - b.get(k).copied().unwrap_or(0)))
        .filter(|(_, d)| *d != 0)
        .map(|(k, d)| format!("{d} {k}"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn print_table(name: &str, s: &Step) {
    let syncs = sync_sources(&s.trace);
    let total: u64 = syncs.values().sum();
    println!(
        "{name}: {} host syncs, {} launches ({} GEMMs), {} copies, {} memsets",
        s.activity.host_syncs,
        s.activity.kernel_launches,
        s.activity.gemms,
        s.activity.copies,
        s.activity.memsets
    );
    println!("  {:>5}  source", "syncs");
    for (src, n) in &syncs {
        println!("  {n:>5}  {src}");
    }
    assert_eq!(
        total, s.activity.host_syncs,
        "{name}: the trace sees every counted sync"
    );
}

/// Syncs per step within the ratchet, and the block's launches within its budget.
fn check(name: &str, model: &(impl Fn(usize) -> Model + Sync), budget: u64) {
    for stage in [ZeroStage::Stage0, ZeroStage::Stage3] {
        let two = traced_step(|| model(2), stage);
        let one = traced_step(|| model(1), stage);
        let label = format!("{name} stage {}", stage.number());
        print_table(&format!("{label}, 2 blocks"), &two);
        check_optimizer_launch(&label, &two);
        check_optimizer_launch(&label, &one);
        let per_block = two.activity.kernel_launches - one.activity.kernel_launches;
        println!(
            "{label}: {per_block} launches per block (forward + backward + step): {}",
            block_launches(&two, &one)
        );
        assert!(
            two.activity.host_syncs <= MAX_SYNCS_PER_STEP,
            "{label}: {} host syncs in one step, at most {MAX_SYNCS_PER_STEP} allowed",
            two.activity.host_syncs
        );
        assert!(
            per_block <= budget,
            "{label}: a block costs {per_block} launches, the budget is {budget}"
        );
    }
}

#[test]
fn gpt2_step_syncs_once_within_the_launch_budget() {
    check("GPT-2", &gpt2_model, GPT2_LAUNCHES_PER_BLOCK);
}

#[test]
fn llama_step_syncs_once_within_the_launch_budget() {
    check("Llama", &llama_model, LLAMA_LAUNCHES_PER_BLOCK);
}

/// A model by name, its builder by block count, and its launch budget per block.
type ModelBudget = (&'static str, fn(usize) -> Model, u64);

/// One micro-batch per step: the moved gradient saves each block exactly the engine's cast
/// and add (2 launches) against the same run keeping accumulators, within the budget, still
/// with one optimizer launch and one host sync. Prints launches per block and per 2-block
/// step, memsets and the device's peak, both ways.
#[test]
fn one_micro_batch_per_step_moves_the_gradient() {
    let models: [ModelBudget; 2] = [
        ("GPT-2", gpt2_model, GPT2_LAUNCHES_PER_BLOCK_ONE_MICRO),
        ("Llama", llama_model, LLAMA_LAUNCHES_PER_BLOCK_ONE_MICRO),
    ];
    for (name, model, budget) in models {
        for stage in [ZeroStage::Stage0, ZeroStage::Stage3] {
            let run = |layers: usize, keep: bool| {
                let acc = Accumulation { gas: 1, keep };
                traced_run_with(|| model(layers), stage, 1, Precision::Bf16, acc)
            };
            let (two, one) = (run(2, false), run(1, false));
            let (two_kept, one_kept) = (run(2, true), run(1, true));
            let label = format!("{name} stage {} one micro-batch", stage.number());
            print_table(&format!("{label}, 2 blocks"), &two);
            check_optimizer_launch(&label, &two);
            let launches = |s: &Step| s.activity.kernel_launches;
            let per_block = launches(&two) - launches(&one);
            let kept = launches(&two_kept) - launches(&one_kept);
            println!(
                "{label}: {per_block} launches per block ({kept} keeping accumulators), 2-block \
                 step {} ({}), memsets {} ({}), device peak {} B ({} B): {}",
                launches(&two),
                launches(&two_kept),
                two.activity.memsets,
                two_kept.activity.memsets,
                two.peak,
                two_kept.peak,
                block_launches(&two, &one)
            );
            assert_eq!(
                kept - per_block,
                2,
                "{label}: the cast and the add per block"
            );
            assert!(
                per_block <= budget,
                "{label}: a block costs {per_block} launches, the budget is {budget}"
            );
            assert!(
                two.activity.host_syncs <= MAX_SYNCS_PER_STEP,
                "{label}: {} host syncs in one step",
                two.activity.host_syncs
            );
        }
    }
}

/// DeepSpeed's dynamic loss scaling from a scale that does not overflow these gradients.
fn fp16() -> Precision {
    Precision::Fp16(common::dynamic_scaling(8, 1000, 2))
}

/// Copies and kernels a 2-rank step queues on the local communicator's collective stream,
/// which the compute streams reach only through events (never a host wait).
fn collective_ops(trace: &[Traced]) -> usize {
    trace
        .iter()
        .filter(|(s, op)| {
            *s == Some(StreamKind::Collective)
                && matches!(op, TraceOp::CopyDtoD { .. } | TraceOp::Launch(_))
        })
        .count()
}

/// fp16 with dynamic loss scaling at one rank waits once, as bf16 does; so do two ranks
/// (each on its own emulated device) at stages 0 and 3: their device collectives run on the
/// collective stream ordered by events, which the emulator checks (`driver/order.rs`), and
/// their norm and loss are summed across ranks on the host after the one status download.
#[test]
fn fp16_and_two_ranks_sync_once() {
    for (label, ranks, precision, stage) in [
        ("fp16", 1, fp16(), ZeroStage::Stage0),
        ("2 ranks", 2, Precision::Bf16, ZeroStage::Stage0),
        ("2 ranks", 2, Precision::Bf16, ZeroStage::Stage3),
    ] {
        let s = traced_run(|| gpt2_model(2), stage, ranks, precision);
        let label = format!("GPT-2 {label} stage {}", stage.number());
        print_table(&label, &s);
        if ranks == 1 {
            check_optimizer_launch(&label, &s);
        } else {
            // Several ranks decide the scale on the host, then still update in one launch.
            let updates = launches(&s.trace)
                .into_iter()
                .filter(|(k, _)| k.starts_with("adam_multi"))
                .map(|(_, n)| n as usize)
                .sum::<usize>();
            assert_eq!(
                updates, OPTIMIZER_LAUNCHES_PER_STEP,
                "{label}: optimizer launches"
            );
        }
        assert!(
            s.activity.host_syncs <= MAX_SYNCS_PER_STEP,
            "{label}: {} host syncs, at most {MAX_SYNCS_PER_STEP} allowed",
            s.activity.host_syncs
        );
        let on_collective = collective_ops(&s.trace);
        println!("{label}: {on_collective} operations on the collective stream");
        assert_eq!(
            on_collective > 0,
            ranks > 1,
            "{label}: device collectives run on the collective stream exactly when there are peers"
        );
    }
}

/// `train_batch` runs the loss head fused (`Module::forward_backward`), at stage 0 and at
/// stage 3: per micro-step one loss-and-gradient kernel over its one chunk, and no forward
/// kernel whose logits a backward kernel would recompute.
fn check_head_fused(name: &str, model: fn(usize) -> Model) {
    for stage in [ZeroStage::Stage0, ZeroStage::Stage3] {
        let s = traced_step(|| model(1), stage);
        let l = launches(&s.trace);
        let fused = l.get("cross_entropy_fused_bf16").copied();
        assert_eq!(fused, Some(GAS as i64), "{name} {stage:?}: {l:?}");
        for k in ["cross_entropy_forward_bf16", "cross_entropy_backward_bf16"] {
            assert!(!l.contains_key(k), "{name} {stage:?}: {k} ran: {l:?}");
        }
    }
}

#[test]
fn train_batch_runs_the_head_fused() {
    check_head_fused("gpt2", gpt2_model);
    check_head_fused("llama", llama_model);
}
