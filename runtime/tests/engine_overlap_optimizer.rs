//! The optimizer step overlapped with backward (the optimizer lane): each group's step
//! starts on the optimizer lane when its gradient is final, and the parameters are bitwise
//! those of the step taken after backward; with clipping or a dynamic loss scale it is
//! speculative (`engine_overlap_speculative.rs`), or off where it cannot be (NVMe optimizer
//! state) and the engine says why; without either, NaN gradients skip a step taken after
//! backward and stop an overlapped one with an error naming the step.

mod common;

use std::time::Duration;

use common::scratch::Scratch;
use common::toy;
use ferrozero_config::resolved::{
    LossScaling, OffloadTarget, Precision, ResolvedConfig, ZeroStage,
};
use ferrozero_runtime::comm::local::run_ranks;
use ferrozero_runtime::engine::optimizer_overlap::OptimizerOverlap;
use ferrozero_runtime::engine::trace::Span;
use ferrozero_runtime::engine::Engine;

/// Stage, world and precision as given; no clipping ([`common::warmup`]).
fn base(stage: ZeroStage, world: usize, precision: Precision) -> ResolvedConfig {
    common::warmup(stage, world, precision, 0.0)
}

/// Each rank's parameter bits and (loss, grad norm) bits per step, and the overlap decision.
type Run = (Vec<Vec<u32>>, Vec<Vec<(u64, u64)>>, OptimizerOverlap);

fn train(cfg: &ResolvedConfig, steps: usize) -> Run {
    let world = cfg.world_size;
    let out = run_ranks(world, Duration::from_secs(60), |comm| {
        let rank = comm.rank();
        let mut e = Engine::new(toy::model(11, 6, 5, 3), cfg.clone(), comm)?;
        let mut reports = Vec::new();
        for s in 0..steps {
            let b = |i: usize| toy::batch(11, 5, ((s * 2 + i) * world + rank) * 2, 2);
            let r = e.train_batch(&[b(0), b(1)])?;
            reports.push((r.loss.to_bits(), r.grad_norm.to_bits()));
        }
        let bits: Vec<u32> = e
            .parameters()?
            .iter()
            .flat_map(|t| t.data.iter().map(|x| x.to_bits()))
            .collect();
        Ok((bits, reports, e.optimizer_overlap().clone()))
    })
    .expect("training failed");
    let overlap = out[0].2.clone();
    let (bits, reports) = out.into_iter().map(|o| (o.0, o.1)).unzip();
    (bits, reports, overlap)
}

#[test]
fn overlapped_steps_are_bitwise_identical_to_steps_after_backward() {
    let scratch = Scratch::new();
    for stage in common::STAGES {
        for world in [1, 2] {
            for precision in [Precision::Bf16, Precision::F32] {
                // The reference: nothing offloaded, nothing overlapped.
                let reference = base(stage, world, precision.clone());
                let (want, want_reports, off) = train(&reference, 4);
                assert!(matches!(off, OptimizerOverlap::Off(_)));
                let mut targets = vec![OffloadTarget::Cpu];
                if precision == Precision::Bf16 {
                    // NVMe optimizer state keeps fp32 masters there: bf16 or fp16 only.
                    targets.push(OffloadTarget::Nvme(scratch.dir()));
                }
                for target in targets {
                    let mut cfg = reference.clone();
                    cfg.zero.offload_optimizer.target = target.clone();
                    cfg.zero.overlap_comm = true;
                    let mut variants = vec![cfg.clone()];
                    if stage == ZeroStage::Stage3 {
                        cfg.zero.offload_param.target = OffloadTarget::Cpu;
                        variants.push(cfg);
                    }
                    for cfg in variants {
                        let (got, reports, on) = train(&cfg, 4);
                        let what = format!(
                            "{stage:?} world {world} {precision:?} optimizer {target:?} \
                             params {:?}",
                            cfg.zero.offload_param.target
                        );
                        assert_eq!(on, OptimizerOverlap::On, "{what}");
                        assert!(got == want, "{what}: parameters differ");
                        assert_eq!(reports, want_reports, "{what}: loss or grad norm differ");
                    }
                }
            }
        }
    }
}

fn overlapped(cfg: &ResolvedConfig) -> ResolvedConfig {
    let mut cfg = cfg.clone();
    cfg.zero.offload_optimizer.target = OffloadTarget::Cpu;
    cfg.zero.overlap_comm = true;
    cfg
}

/// One rank's schedule for `steps` steps of a toy large enough that a unit's backward takes
/// milliseconds; one trace per step.
fn traced(cfg: &ResolvedConfig, steps: usize) -> (Vec<Vec<Span>>, usize, OptimizerOverlap) {
    let out = run_ranks(1, Duration::from_secs(120), |comm| {
        let mut e = Engine::new(toy::model(31, 96, 12, 6), cfg.clone(), comm)?;
        e.trace_schedule(true);
        let mut traces = Vec::new();
        for s in 0..steps {
            let b = |i: usize| toy::batch(31, 12, (s * 2 + i) * 8, 8);
            e.train_batch(&[b(0), b(1)])?;
            traces.push(e.take_schedule_trace());
        }
        Ok((traces, e.model().units.len(), e.optimizer_overlap().clone()))
    })
    .expect("training failed");
    out.into_iter().next().expect("one rank")
}

fn end_of_first_unit_backward(spans: &[Span]) -> Duration {
    spans
        .iter()
        .filter(|s| s.op == "backward" && s.index == 0)
        .map(|s| s.end)
        .max()
        .expect("unit 0's backward is traced")
}

#[test]
fn the_step_of_a_group_starts_while_backward_of_earlier_units_runs() {
    let cfg = overlapped(&base(ZeroStage::Stage2, 1, Precision::Bf16));
    let (traces, units, on) = traced(&cfg, 5);
    assert_eq!(on, OptimizerOverlap::On);
    let mut overlapped_steps = 0;
    for spans in &traces {
        let steps: Vec<&Span> = spans.iter().filter(|s| s.op == "step").collect();
        // Every group (the units' and the shared one) stepped once, on the optimizer lane,
        // the last unit's group first: backward finishes it first.
        assert_eq!(steps.len(), units + 1, "{spans:?}");
        assert!(steps.iter().all(|s| s.lane == "optimizer"), "{spans:?}");
        assert_eq!(steps[0].index, units - 1, "{spans:?}");
        assert_eq!(steps.last().map(|s| s.index), Some(units), "{spans:?}");
        // The last layer's group (the head has no parameters of its own) holds real work.
        let last_layer = steps.iter().find(|s| s.index == units - 2).expect("traced");
        if last_layer.start < end_of_first_unit_backward(spans) {
            overlapped_steps += 1;
        }
    }
    // A loaded machine may delay the lane's thread in one step, not in all of them.
    assert!(
        overlapped_steps > 0,
        "no step started before backward ended: {traces:?}"
    );
}

#[test]
fn a_global_value_makes_the_overlap_speculative_or_keeps_the_step_after_backward() {
    let scratch = Scratch::new();
    let mut clipped = overlapped(&base(ZeroStage::Stage2, 1, Precision::Bf16));
    clipped.gradient_clipping = 1.0;
    let OptimizerOverlap::Speculative(why, None) = OptimizerOverlap::decide(&clipped) else {
        panic!("clipping does not make the overlap speculative")
    };
    assert!(
        why.contains("gradient_clipping=1.0 needs the global norm"),
        "{why}"
    );
    // Optimizer state on NVMe is not snapshotted: with clipping the step follows backward.
    let mut on_nvme = clipped.clone();
    on_nvme.zero.offload_optimizer.target = OffloadTarget::Nvme(scratch.dir());
    let (traces, units, off) = traced(&on_nvme, 2);
    let OptimizerOverlap::Off(why) = off else {
        panic!("overlap on with clipping and NVMe optimizer state")
    };
    assert!(
        why.contains("gradient_clipping=1.0") && why.contains("NVMe is not snapshotted"),
        "{why}"
    );
    for spans in &traces {
        let end = end_of_first_unit_backward(spans);
        let steps: Vec<&Span> = spans.iter().filter(|s| s.op == "step").collect();
        assert_eq!(steps.len(), units + 1, "{spans:?}");
        assert!(
            steps.iter().all(|s| s.lane == "compute" && s.start >= end),
            "{spans:?}"
        );
    }
    let mut dynamic = overlapped(&base(
        ZeroStage::Stage2,
        1,
        Precision::Fp16(common::dynamic_scaling(8, 100, 2)),
    ));
    dynamic.gradient_clipping = 0.0;
    let OptimizerOverlap::Speculative(why, None) = OptimizerOverlap::decide(&dynamic) else {
        panic!("a dynamic loss scale does not make the overlap speculative")
    };
    assert!(why.contains("dynamic loss scale"), "{why}");
    let mut static_scale = dynamic.clone();
    static_scale.precision = Precision::Fp16(LossScaling::Static(128.0));
    assert_eq!(
        OptimizerOverlap::decide(&static_scale),
        OptimizerOverlap::On
    );
    let mut nvme_params = overlapped(&base(ZeroStage::Stage3, 1, Precision::Bf16));
    nvme_params.zero.offload_param.target = OffloadTarget::Nvme(scratch.dir());
    assert!(matches!(
        OptimizerOverlap::decide(&nvme_params),
        OptimizerOverlap::Off(w) if w.contains("offload_param")
    ));
}

/// Four steps of a toy whose layer h.1 gets a NaN gradient in step 3's last micro-step:
/// each step's `skipped`, or the first error.
fn train_with_nan(cfg: &ResolvedConfig) -> std::result::Result<Vec<bool>, String> {
    let out = run_ranks(1, Duration::from_secs(60), |comm| {
        let mut model = toy::model(11, 6, 5, 3);
        model.units[2].module = std::sync::Arc::new(toy::NanAt::new("h.1", 6, 5));
        let mut e = Engine::new(model, cfg.clone(), comm)?;
        let mut skipped = Vec::new();
        for s in 0..4 {
            let b = |i: usize| toy::batch(11, 5, (s * 2 + i) * 2, 2);
            skipped.push(e.train_batch(&[b(0), b(1)])?.skipped);
        }
        Ok(skipped)
    });
    out.map(|mut o| o.remove(0)).map_err(|e| e.to_string())
}

#[test]
fn nan_gradients_skip_the_step_after_backward_and_stop_an_overlapped_one() {
    let on = overlapped(&base(ZeroStage::Stage2, 1, Precision::Bf16));
    let mut off = on.clone();
    off.zero.overlap_comm = false;
    assert_eq!(train_with_nan(&off), Ok(vec![false, false, true, false]));
    let err = train_with_nan(&on).expect_err("an overlapped step with NaN gradients");
    assert!(
        err.contains("step 3")
            && err.contains("Inf or NaN")
            && err.contains("overlap_comm = false"),
        "{err}"
    );
}
