//! At one micro-step per step the reduced micro-step gradient moves into place and the step
//! reads it rounded to the accumulator's dtype, instead of a cast added into a zeroed
//! accumulator. Against the same run with accumulators kept (`Engine::accumulate_gradients`,
//! the path before), every step's loss, gradient norm, clipping, loss scale and skip verdict
//! and the final parameters are bit-identical, on the CPU and on the emulated device: GPT-2
//! and Llama (untied and tied), bf16 (or f32) at stages 0 and 3 on one rank and stage 2 on two, and fp16 with
//! dynamic loss scaling from a scale that overflows.

mod common;
mod device_common;

use std::sync::Arc;
use std::time::Duration;

use common::tiny::{self, VOCAB};
use common::{config, toy};
use device_common::Dev;
use ferrozero_config::resolved::{Precision, ResolvedConfig, ZeroStage};
use ferrozero_runtime::backend::Backend;
use ferrozero_runtime::comm::local::run_ranks;
use ferrozero_runtime::engine::ledger::{Category, Location};
use ferrozero_runtime::engine::Engine;
use ferrozero_runtime::nn::Model;

const SEQ: usize = 8;

fn gpt2_model() -> Model {
    tiny::gpt2_model(2)
}

fn llama_model() -> Model {
    tiny::llama_model(2)
}

fn llama_tied_model() -> Model {
    tiny::llama_tied_model(2)
}

/// What a run decided, step by step, and where it ended, all as bits.
#[derive(Debug, PartialEq)]
struct Run {
    /// Per step: loss, gradient norm, loss scale (bits), skipped.
    steps: Vec<(u64, u64, u64, bool)>,
    params: Vec<(String, Vec<u32>)>,
}

/// `steps` steps of `model` at one micro-step per step, every rank on `be`; rank 0's run. With
/// `accumulate` the engine keeps zeroed accumulators (the old path).
fn train(
    be: &Arc<dyn Backend>,
    model: fn() -> Model,
    cfg: &ResolvedConfig,
    steps: usize,
    accumulate: bool,
) -> Run {
    let world = cfg.world_size;
    let out = run_ranks(world, Duration::from_secs(300), |comm| {
        let rank = comm.rank();
        let mut e = Engine::with_backend(model(), cfg.clone(), comm, be.clone())?;
        if accumulate {
            e.accumulate_gradients()?;
        }
        let mut out = Vec::new();
        for s in 0..steps {
            let b = toy::batch(VOCAB, SEQ, s * world + rank, 2);
            let r = e.train_batch(&[b])?;
            out.push((
                r.loss.to_bits(),
                r.grad_norm.to_bits(),
                r.loss_scale.to_bits(),
                r.skipped,
            ));
            // Between steps a moved gradient is gone; an accumulator stays.
            let held = e.ledger().current(Location::Device, Category::Gradients);
            assert_eq!(
                held == 0,
                !accumulate,
                "gradient bytes between steps: {held}"
            );
        }
        let params = e
            .parameters()?
            .iter()
            .map(|t| (t.name.clone(), t.data.iter().map(|x| x.to_bits()).collect()))
            .collect();
        Ok(Run { steps: out, params })
    })
    .expect("training");
    out.into_iter().next().expect("rank 0")
}

fn cfg(stage: ZeroStage, world: usize, precision: Precision) -> ResolvedConfig {
    config(stage, world, 2, 1, precision)
}

/// The moved run equals the accumulated one; `what` names the case.
fn same(
    be: &Arc<dyn Backend>,
    model: fn() -> Model,
    c: &ResolvedConfig,
    steps: usize,
    what: &str,
) -> Run {
    let moved = train(be, model, c, steps, false);
    let kept = train(be, model, c, steps, true);
    assert_eq!(moved.steps, kept.steps, "{what}: step decisions");
    assert!(moved.params == kept.params, "{what}: parameters differ");
    println!("{what}: {} steps bit-identical: {:?}", steps, moved.steps);
    moved
}

fn moved_gradient_steps_as_accumulated(d: &Dev) {
    let precision = d.training_precision();
    let cases = [
        (ZeroStage::Stage0, 1),
        (ZeroStage::Stage3, 1),
        (ZeroStage::Stage2, 2),
    ];
    for (name, model) in [
        ("GPT-2", gpt2_model as fn() -> Model),
        ("Llama", llama_model),
        // Its embedding unit has no gradient: an empty reduction and no term in the step.
        ("tied Llama", llama_tied_model),
    ] {
        for (stage, world) in cases {
            let what = format!(
                "{} {name} {precision:?} stage {} x{world}",
                d.name,
                stage.number()
            );
            let run = same(
                &d.be,
                model,
                &cfg(stage, world, precision.clone()),
                3,
                &what,
            );
            // Clipping at 1.0 binds: the first steps' norms are above it.
            let norm = f64::from_bits(run.steps[0].1);
            assert!(norm > 1.0, "{what}: clipping does not bind (norm {norm})");
        }
    }
}
test_device!(moved_gradient_steps_as_accumulated);

/// fp16 from a loss scale whose gradients overflow f16 (the f32 micro-step gradient is finite;
/// only its rounding to the accumulator's dtype overflows): skipped steps halve the scale
/// until they fit, identically on both paths.
fn fp16_overflow(be: &Arc<dyn Backend>, name: &str) {
    let precision = Precision::Fp16(common::dynamic_scaling(20, 1000, 1));
    for (stage, world) in [(ZeroStage::Stage0, 1), (ZeroStage::Stage2, 2)] {
        let what = format!("{name} fp16 stage {} x{world}", stage.number());
        let run = same(
            be,
            gpt2_model,
            &cfg(stage, world, precision.clone()),
            8,
            &what,
        );
        let skipped = run.steps.iter().filter(|s| s.3).count();
        assert!(
            skipped > 0 && skipped < run.steps.len(),
            "{what}: {skipped} of {} steps skipped",
            run.steps.len()
        );
    }
}

#[test]
fn fp16_overflow_cpu() {
    fp16_overflow(&ferrozero_runtime::backend::cpu(), "cpu");
}

#[cfg(feature = "cuda")]
#[test]
fn fp16_overflow_cuda_emu_f16() {
    match ferrozero_runtime::backend::cuda::emulated(ferrozero_runtime::tensor::DType::F16) {
        Ok(be) => fp16_overflow(&(be as Arc<dyn Backend>), "cuda_emu_f16"),
        Err(e) => ferrozero_runtime::backend::cuda::emu::skip_unless_required(&format!(
            "cuda_emu_f16: {e}"
        )),
    }
}

/// Two micro-steps before a step at one micro-step per step (the manual `forward`/`backward`
/// loop allows it): the moved gradient becomes an accumulator holding the same values and the
/// second is added into it, exactly as the run keeping accumulators does.
fn second_micro_step_before_the_step(d: &Dev) {
    let precision = d.training_precision();
    let c = cfg(ZeroStage::Stage0, 1, precision);
    let run = |accumulate: bool| {
        let out = run_ranks(1, Duration::from_secs(300), |comm| {
            let mut e = Engine::with_backend(gpt2_model(), c.clone(), comm, d.be.clone())?;
            if accumulate {
                e.accumulate_gradients()?;
            }
            let mut norms = Vec::new();
            for s in 0..2 {
                for m in 0..2 {
                    e.forward(&toy::batch(VOCAB, SEQ, 2 * s + m, 2))?;
                    e.backward()?;
                }
                let r = e.step()?.expect("an accumulation boundary");
                norms.push(r.grad_norm.to_bits());
            }
            let params: Vec<Vec<u32>> = e
                .parameters()?
                .iter()
                .map(|t| t.data.iter().map(|x| x.to_bits()).collect())
                .collect();
            Ok((norms, params))
        });
        out.expect("training").remove(0)
    };
    let (moved, kept) = (run(false), run(true));
    assert_eq!(moved.0, kept.0, "{}: gradient norms", d.name);
    assert!(moved.1 == kept.1, "{}: parameters differ", d.name);
}
test_device!(second_micro_step_before_the_step);
