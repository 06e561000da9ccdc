//! The speculative optimizer overlap: with gradient clipping or fp16's dynamic loss scale, the
//! lane steps each group during backward as if clipping did not bind and nothing overflowed,
//! and the step undoes that exactly when either happens. Stages 0-3 on 1 and 2 ranks, with
//! steps where clipping binds and steps where it does not, and an fp16 step that overflows:
//! parameters, losses and norms are bitwise those of the run with nothing offloaded and nothing
//! overlapped, and the schedule trace shows which path each step took.

mod common;

use std::time::Duration;

use common::toy;
use common::warmup as base;
use ferrozero_config::resolved::{OffloadTarget, Precision, ResolvedConfig, ZeroStage};
use ferrozero_runtime::comm::local::run_ranks;
use ferrozero_runtime::engine::optimizer_overlap::OptimizerOverlap;
use ferrozero_runtime::engine::trace::Span;
use ferrozero_runtime::engine::Engine;
use ferrozero_runtime::nn::Model;

const STEPS: usize = 6;

/// The optimizer on the host, overlapped with backward (and in stage 3 the parameters on the
/// host too, when `params`).
fn offloaded(cfg: &ResolvedConfig, params: bool) -> ResolvedConfig {
    let mut cfg = cfg.clone();
    cfg.zero.offload_optimizer.target = OffloadTarget::Cpu;
    cfg.zero.overlap_comm = true;
    if params {
        cfg.zero.offload_param.target = OffloadTarget::Cpu;
    }
    cfg
}

/// What one rank saw: parameter bits, per step (loss, norm, skipped) and the schedule trace.
struct Run {
    bits: Vec<u32>,
    reports: Vec<(u64, u64, bool)>,
    traces: Vec<Vec<Span>>,
    overlap: OptimizerOverlap,
}

fn train(cfg: &ResolvedConfig, model: fn() -> Model) -> Vec<Run> {
    train_with(cfg, model, None)
}

fn plain() -> Model {
    toy::model(11, 6, 5, 3)
}

/// Layer h.1's bias gradient is NaN in step 3's last micro-step (its sixth backward).
fn with_nan() -> Model {
    let mut m = plain();
    m.units[2].module = std::sync::Arc::new(toy::NanAt::new("h.1", 6, 5));
    m
}

fn count(spans: &[Span], lane: &str, op: &str) -> usize {
    spans
        .iter()
        .filter(|s| s.lane == lane && s.op == op)
        .count()
}

/// Runs `cfg` with and without the speculative overlap and demands the same bits; checks that
/// each step took the path its outcome calls for. Returns, per step, whether the lane's work
/// stood (no group stepped again after backward).
fn same_bits(cfg: &ResolvedConfig, model: fn() -> Model, what: &str) -> Vec<bool> {
    let want = train(cfg, model);
    let mut stood = Vec::new();
    let variants = match cfg.zero.stage {
        ZeroStage::Stage3 => vec![offloaded(cfg, false), offloaded(cfg, true)],
        _ => vec![offloaded(cfg, false)],
    };
    for on in variants {
        let got = train(&on, model);
        let what = format!("{what} params {:?}", on.zero.offload_param.target);
        for (w, g) in want.iter().zip(&got) {
            assert!(
                matches!(g.overlap, OptimizerOverlap::Speculative(..)),
                "{what}: {:?}",
                g.overlap
            );
            assert!(w.bits == g.bits, "{what}: parameters differ");
            assert_eq!(w.reports, g.reports, "{what}: loss, norm or skip differ");
        }
        let m = model();
        let groups = m.units.len() + usize::from(!m.shared.is_empty());
        stood = got[0]
            .traces
            .iter()
            .zip(&got[0].reports)
            .map(|(spans, r)| path_of_step(spans, groups, r.2, &what))
            .collect();
    }
    stood
}

/// Whether the lane's speculation stood in a step: then the lane stepped every group and
/// nothing ran after backward; otherwise every group the lane stepped was rolled back and the
/// step ran after backward (or, skipped, did not run at all).
fn path_of_step(spans: &[Span], groups: usize, skipped: bool, what: &str) -> bool {
    let lane = count(spans, "optimizer", "step");
    let after = count(spans, "compute", "step");
    let rolled = count(spans, "compute", "rollback");
    if !skipped && rolled == 0 && after == 0 {
        assert_eq!(
            lane, groups,
            "{what}: the lane stepped every group: {spans:?}"
        );
        return true;
    }
    assert_eq!(rolled, lane, "{what}: every lane step is undone: {spans:?}");
    let redo = if skipped { 0 } else { groups };
    assert_eq!(after, redo, "{what}: the step after backward: {spans:?}");
    false
}

#[test]
fn clipped_steps_are_bitwise_those_of_the_step_after_backward() {
    for world in [1, 2] {
        for precision in [Precision::Bf16, Precision::F32] {
            let clip = median_norm(world, precision.clone());
            for stage in common::STAGES {
                let cfg = base(stage, world, precision.clone(), clip);
                let what = format!("{stage:?} world {world} {precision:?} clip {clip}");
                let stood = same_bits(&cfg, plain, &what);
                assert!(
                    stood.contains(&true) && stood.contains(&false),
                    "{what}: clipping bound in every step or in none: {stood:?}"
                );
            }
        }
    }
}

/// fp16 with a dynamic loss scale from 2^8 that halves at the first overflow.
fn dynamic_scale() -> Precision {
    Precision::Fp16(common::dynamic_scaling(8, 100, 1))
}

#[test]
fn an_fp16_overflow_step_is_skipped_and_the_lane_undone_exactly() {
    let dynamic = dynamic_scale();
    for world in [1, 2] {
        for stage in common::STAGES {
            // With clipping (the usual config) and without (the scale alone speculates).
            for clip in [0.0, 1e6] {
                let cfg = base(stage, world, dynamic.clone(), clip);
                let what = format!("{stage:?} world {world} fp16 clip {clip}");
                let stood = same_bits(&cfg, with_nan, &what);
                // Step 3 overflowed (the lane had stepped the later units' groups: undone);
                // every other step stood.
                assert_eq!(stood, [true, true, false, true, true, true], "{what}");
            }
        }
    }
}

/// A speculation bounded by host memory: only the groups backward finishes first, about half
/// of them, are snapshotted and stepped on the lane; the others are stepped after backward.
/// With clipping that binds in some steps and with fp16 overflowing in one, stages 0-3 (with
/// and without the parameters offloaded at stage 3), worlds 1 and 2: the bits of the run with
/// nothing offloaded and nothing overlapped.
#[test]
fn bounded_snapshots_keep_the_bits() {
    let dynamic = dynamic_scale();
    for world in [1, 2] {
        for stage in common::STAGES {
            let clip = median_norm(world, Precision::Bf16);
            let cases = [
                (
                    base(stage, world, Precision::Bf16, clip),
                    plain as fn() -> Model,
                ),
                (base(stage, world, dynamic.clone(), 1e6), with_nan),
            ];
            for (cfg, model) in cases {
                let want = train(&cfg, model);
                let mut variants = vec![offloaded(&cfg, false)];
                if stage == ZeroStage::Stage3 {
                    variants.push(offloaded(&cfg, true));
                }
                for on in variants {
                    let what = format!(
                        "{stage:?} world {world} {:?} {:?}",
                        cfg.precision, on.zero.offload_param.target
                    );
                    let (bound, planned) = half_the_snapshots(&on, model);
                    let got = train_with(
                        &on,
                        model,
                        Some(OptimizerOverlap::Speculative("test".into(), Some(bound))),
                    );
                    for (w, g) in want.iter().zip(&got) {
                        assert_eq!(
                            g.overlap,
                            OptimizerOverlap::Speculative("test".into(), Some(bound))
                        );
                        assert!(w.bits == g.bits, "{what}: parameters differ");
                        assert_eq!(w.reports, g.reports, "{what}: loss, norm or skip differ");
                    }
                    // The lane stepped at most the planned groups, and some step stood with
                    // the rest stepped after backward.
                    let groups = model().units.len() + usize::from(!model().shared.is_empty());
                    let mut stood = false;
                    for (spans, r) in got[0].traces.iter().zip(&got[0].reports) {
                        let lane = count(spans, "optimizer", "step");
                        let after = count(spans, "compute", "step");
                        let rolled = count(spans, "compute", "rollback");
                        assert!(
                            lane <= planned,
                            "{what}: {lane} lane steps of {planned} planned"
                        );
                        if !r.2 && rolled == 0 {
                            assert_eq!(lane + after, groups, "{what}: {spans:?}");
                            stood |= lane > 0 && after > 0;
                        }
                    }
                    assert!(
                        stood,
                        "{what}: no step split between the lane and after backward"
                    );
                }
            }
        }
    }
}

/// A clipping threshold between the toy's gradient norms (`world` ranks, `precision`):
/// clipping binds in some steps and not in others.
fn median_norm(world: usize, precision: Precision) -> f64 {
    let probe = train(&base(ZeroStage::Stage0, world, precision, 0.0), plain);
    let mut norms: Vec<f64> = probe[0]
        .reports
        .iter()
        .map(|r| f64::from_bits(r.1))
        .collect();
    norms.sort_by(f64::total_cmp);
    norms[STEPS / 2]
}

/// The snapshot bytes of about half the groups, in the order backward finishes them (the
/// last units first), as rank 0's engine counts them; and how many groups that is.
fn half_the_snapshots(cfg: &ResolvedConfig, model: fn() -> Model) -> (u64, usize) {
    let units = model().units.len();
    let groups = run_ranks(cfg.world_size, Duration::from_secs(60), |comm| {
        Ok(Engine::new(model(), cfg.clone(), comm)?.snapshot_group_bytes())
    })
    .expect("building the engines")
    .swap_remove(0);
    let take = units.div_ceil(2);
    let bytes: u64 = groups[units - take..units].iter().sum();
    (bytes, take)
}

/// [`train`] with the optimizer overlap `overlap` when given, else the config's.
fn train_with(
    cfg: &ResolvedConfig,
    model: fn() -> Model,
    overlap: Option<OptimizerOverlap>,
) -> Vec<Run> {
    let world = cfg.world_size;
    run_ranks(world, Duration::from_secs(120), |comm| {
        let rank = comm.rank();
        let mut e = Engine::with_overlap(model(), cfg.clone(), comm, overlap.clone())?;
        e.trace_schedule(true);
        let (mut reports, mut traces) = (Vec::new(), Vec::new());
        for s in 0..STEPS {
            let b = |i: usize| toy::batch(11, 5, ((s * 2 + i) * world + rank) * 2, 2);
            let r = e.train_batch(&[b(0), b(1)])?;
            reports.push((r.loss.to_bits(), r.grad_norm.to_bits(), r.skipped));
            traces.push(e.take_schedule_trace());
        }
        let bits = e
            .parameters()?
            .iter()
            .flat_map(|t| t.data.iter().map(|x| x.to_bits()))
            .collect();
        let overlap = e.optimizer_overlap().clone();
        Ok(Run {
            bits,
            reports,
            traces,
            overlap,
        })
    })
    .expect("training failed")
}
