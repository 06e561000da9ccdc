//! Frozen parameters: no gradient, master copy or optimizer state, yet sharded, gathered and
//! offloaded like any other. Training with part of a model frozen gives the same bits at
//! every stage, with and without offload, overlap and checkpointing; frozen parameters stay
//! bit for bit what they were; the trainable ones take the steps they take when nothing is
//! frozen; the ledger holds no gradient or optimizer bytes for the frozen ones; a stage-3
//! checkpoint resumes at another world size with the frozen parameters intact.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::runs::{rank0, toy_batches, toy_steps};
use common::scratch::Scratch;
use common::tiny::gpt2_part_frozen;
use common::{checkpointing, config, lamb, tiny};
use ferrozero_config::resolved::{OffloadTarget, Precision, ResolvedConfig, ZeroStage};
use ferrozero_runtime::comm::local::run_ranks;
use ferrozero_runtime::engine::checkpoint::Tag;
use ferrozero_runtime::engine::ledger::{Category, Location};
use ferrozero_runtime::engine::{Engine, NamedTensor};
use ferrozero_runtime::nn::freeze::Freeze;
use ferrozero_runtime::nn::{gpt2, Model};

const T: usize = 8;
const STEPS: usize = 3;

/// Llama (untied) training only its last block's MLP and the final norm.
fn llama_last_mlp() -> Model {
    let f = Freeze::new(&["*", "!model.layers.1.mlp.*", "!model.norm.weight"]).unwrap();
    tiny::llama_model(2).freeze(f).unwrap()
}

/// GPT-2 with PEFT's LoRA (r 4, dropout 0.1) on the attention and MLP input layers, the
/// final norm trained in full (`modules_to_save`), every other base weight frozen.
fn gpt2_lora() -> Model {
    tiny::gpt2_lora(r#"["c_attn", "c_fc"]"#, r#"["ln_f"]"#)
}

/// What a run leaves on rank 0: each step's loss bits, and the parameters before and after.
struct Run {
    losses: Vec<u64>,
    before: Vec<NamedTensor>,
    after: Vec<NamedTensor>,
}

fn run(build: fn() -> Model, cfg: &ResolvedConfig) -> Run {
    run_steps(build, cfg, STEPS)
}

fn run_steps(build: fn() -> Model, cfg: &ResolvedConfig, steps: usize) -> Run {
    rank0(cfg.world_size, |comm| {
        let rank = comm.rank();
        let mut e = Engine::new(build(), cfg.clone(), comm)?;
        let before = e.parameters()?;
        let reports = toy_steps(&mut e, cfg, (tiny::VOCAB, T), steps, rank)?;
        Ok(Run {
            losses: reports.iter().map(|r| r.loss.to_bits()).collect(),
            before,
            after: e.parameters()?,
        })
    })
    .expect("training failed")
}

fn base(stage: ZeroStage, world: usize) -> ResolvedConfig {
    config(stage, world, 2, 2, Precision::F32)
}

use common::runs::named_bits as bits;

/// Every configuration the bitwise promise covers, named.
fn variants(world: usize) -> Vec<(String, ResolvedConfig)> {
    let mut out = Vec::new();
    for stage in [ZeroStage::Stage1, ZeroStage::Stage2, ZeroStage::Stage3] {
        out.push((format!("{stage:?}"), base(stage, world)));
    }
    let mut c = base(ZeroStage::Stage3, world);
    c.zero.offload_optimizer.target = OffloadTarget::Cpu;
    out.push(("stage 3, optimizer offload".into(), c.clone()));
    c.zero.offload_param.target = OffloadTarget::Cpu;
    out.push(("stage 3, optimizer and parameter offload".into(), c.clone()));
    c.zero.overlap_comm = true;
    out.push(("stage 3, offload and overlap".into(), c.clone()));
    c.activation_checkpointing = Some(checkpointing(false));
    out.push(("stage 3, offload, overlap, checkpointing".into(), c));
    let mut c = base(ZeroStage::Stage2, world);
    c.zero.offload_optimizer.target = OffloadTarget::Cpu;
    c.zero.overlap_comm = true;
    out.push(("stage 2, optimizer offload and overlap".into(), c));
    out
}

#[test]
fn part_frozen_models_train_to_the_same_bits_at_every_stage_and_offload() {
    for (name, build) in [
        ("gpt2", gpt2_part_frozen as fn() -> Model),
        ("llama", llama_last_mlp),
        ("gpt2 lora", gpt2_lora),
    ] {
        for world in [1, 2] {
            let reference = run(build, &base(ZeroStage::Stage0, world));
            for (what, cfg) in variants(world) {
                let got = run(build, &cfg);
                assert_eq!(
                    got.losses, reference.losses,
                    "{name}, world {world}: {what}"
                );
                assert!(
                    bits(&got.after) == bits(&reference.after),
                    "{name}, world {world}: {what} changed the parameters"
                );
            }
        }
    }
}

/// LAMB's trust ratios are per tensor over the trainable ones only: a part-frozen and a LoRA
/// model train to the same bits at every stage, with and without offload.
#[test]
fn lamb_over_frozen_models_is_the_same_at_every_stage() {
    let with_lamb = |mut c: ResolvedConfig| {
        c.optimizer = lamb(2e-2);
        c
    };
    for build in [gpt2_part_frozen as fn() -> Model, gpt2_lora] {
        for world in [1, 2] {
            let reference = run(build, &with_lamb(base(ZeroStage::Stage0, world)));
            for stage in [ZeroStage::Stage1, ZeroStage::Stage3] {
                let mut c = with_lamb(base(stage, world));
                let got = run(build, &c);
                assert_eq!(got.losses, reference.losses, "world {world} {stage:?}");
                c.zero.offload_optimizer.target = OffloadTarget::Cpu;
                let got = run(build, &c);
                assert_eq!(
                    got.losses, reference.losses,
                    "world {world} {stage:?} offload"
                );
                assert!(bits(&got.after) == bits(&reference.after));
            }
            let moved = (reference.before.iter().zip(&reference.after))
                .filter(|(b, a)| b.data != a.data)
                .count();
            assert!(moved > 0, "LAMB trained nothing");
        }
    }
}

#[test]
fn frozen_parameters_stay_bitwise_unchanged_and_the_rest_train() {
    for build in [gpt2_part_frozen as fn() -> Model, gpt2_lora] {
        frozen_stay_and_the_rest_train(build);
    }
}

fn frozen_stay_and_the_rest_train(build: fn() -> Model) {
    let model = build();
    let r = run(build, &base(ZeroStage::Stage3, 2));
    let (mut frozen, mut trained) = (0, 0);
    for (b, a) in r.before.iter().zip(&r.after) {
        assert_eq!(b.name, a.name);
        let same = bits(std::slice::from_ref(b)) == bits(std::slice::from_ref(a));
        match model.is_frozen(&b.name) {
            true => {
                assert!(same, "frozen {} changed", b.name);
                frozen += 1;
            }
            false => {
                assert!(!same, "trainable {} did not change", b.name);
                trained += 1;
            }
        }
    }
    assert!(
        frozen >= 6 && trained >= 6,
        "{frozen} frozen, {trained} trained"
    );
}

/// Without clipping, a trainable parameter's first Adam step depends on its own gradient
/// alone, and that does not depend on which other parameters train (later steps do: the
/// parameters below have moved in one run and not in the other).
#[test]
fn trainable_parameters_step_as_when_nothing_is_frozen() {
    let mut cfg = base(ZeroStage::Stage2, 2);
    cfg.gradient_clipping = 0.0;
    let frozen = run_steps(llama_last_mlp, &cfg, 1);
    let full = run_steps(|| tiny::llama_model(2), &cfg, 1);
    let full: HashMap<&str, &NamedTensor> =
        full.after.iter().map(|t| (t.name.as_str(), t)).collect();
    let model = llama_last_mlp();
    let mut compared = 0;
    for t in frozen.after.iter().filter(|t| !model.is_frozen(&t.name)) {
        let want = full[t.name.as_str()];
        for (i, (a, b)) in t.data.iter().zip(&want.data).enumerate() {
            assert!((a - b).abs() <= 1e-5, "{}[{i}]: {a} vs {b}", t.name);
        }
        compared += 1;
    }
    assert_eq!(
        compared, 4,
        "the last block's MLP (3 weights) and the final norm"
    );
}

/// A GPT-2 big enough that the frozen part dominates: all but the last of 4 blocks frozen,
/// with the embeddings.
fn gpt2_mostly_frozen() -> Model {
    let cfg = gpt2::Gpt2Config::from_json(
        r#"{"n_layer": 4, "n_head": 4, "n_embd": 128, "vocab_size": 1000, "n_positions": 64,
            "model_type": "gpt2", "activation_function": "gelu_new", "resid_pdrop": 0.0,
            "embd_pdrop": 0.0, "attn_pdrop": 0.0}"#,
    )
    .unwrap();
    let f = Freeze::new(&["*", "!transformer.h.3.*", "!transformer.ln_f.*"]).unwrap();
    gpt2::build(&cfg).unwrap().freeze(f).unwrap()
}

#[test]
fn the_ledger_holds_no_gradient_or_optimizer_bytes_for_frozen_parameters() {
    for stage in [ZeroStage::Stage0, ZeroStage::Stage3] {
        let cfg = config(stage, 1, 1, 2, Precision::Bf16);
        let out = run_ranks(1, Duration::from_secs(60), |comm| {
            let model = gpt2_mostly_frozen();
            let (all, trainable) = (model.num_params(), model.num_trainable_params());
            let e = Engine::new(model, cfg.clone(), comm)?;
            let l = e.ledger();
            let at = |c| l.current(Location::Device, c);
            Ok((
                all,
                trainable,
                at(Category::Parameters),
                at(Category::Gradients),
                at(Category::OptimizerState),
            ))
        })
        .unwrap();
        let (all, trainable, params, grads, optim) = out[0];
        assert!(trainable * 4 < all, "{trainable} of {all} train");
        // bf16 parameters for all; bf16 gradients, f32 master and two f32 moments for the
        // trainable ones (up to each group's padding to 16 elements).
        let pad = 16 * 8;
        assert!(
            (params as usize).abs_diff(2 * all) <= 2 * pad,
            "{stage:?}: parameters {params}"
        );
        assert!(
            (grads as usize).abs_diff(2 * trainable) <= 2 * pad,
            "{stage:?}: gradients {grads}"
        );
        assert!(
            (optim as usize).abs_diff(12 * trainable) <= 12 * pad,
            "{stage:?}: optimizer {optim}"
        );
    }
}

#[test]
fn a_stage3_checkpoint_resumes_at_another_world_size_with_frozen_parameters() {
    for build in [gpt2_part_frozen as fn() -> Model, gpt2_lora] {
        resumes_at_another_world_size(build);
    }
}

/// Three steps of `build` at stage 3 on two ranks, saved after the second; resumed at stage 1
/// on one rank, the third step over the same global batch gives the uninterrupted run's loss
/// (up to the order of the ranks' sums), from the saved parameters bit for bit.
fn resumes_at_another_world_size(build: fn() -> Model) {
    let scratch = Scratch::new();
    let dir = scratch.dir();
    let cfg2 = base(ZeroStage::Stage3, 2);
    let saved = run_ranks(2, Duration::from_secs(120), |comm| {
        let rank = comm.rank();
        let mut e = Engine::new(build(), cfg2.clone(), comm)?;
        let (mut params, mut losses) = (Vec::new(), Vec::new());
        for s in 0..3 {
            let b = toy_batches(&cfg2, (tiny::VOCAB, T), s, rank);
            losses.push(e.train_batch(&b)?.loss);
            if s == 1 {
                e.save_checkpoint(&dir, "frozen", 0)?;
                params = e.parameters()?;
            }
        }
        Ok((params, losses))
    })
    .unwrap();
    let mut cfg1 = config(ZeroStage::Stage1, 1, 4, 2, Precision::F32);
    cfg1.train_batch_size = 8;
    let loaded = run_ranks(1, Duration::from_secs(60), |comm| {
        let mut e = Engine::new(build(), cfg1.clone(), comm)?;
        e.load_checkpoint(&dir, &Tag::Latest)?;
        let p = e.parameters()?;
        // The third step's global batch, rank 0's rows and rank 1's in one micro-batch.
        let loss = e
            .train_batch(&toy_batches(&cfg1, (tiny::VOCAB, T), 2, 0))?
            .loss;
        Ok((p, loss))
    })
    .unwrap();
    let ((params, loss), (want, losses)) = (&loaded[0], &saved[0]);
    assert!(
        bits(params) == bits(want),
        "the resumed parameters differ from the saved"
    );
    assert!(
        (loss - losses[2]).abs() <= 1e-5,
        "resumed {loss} vs uninterrupted {}",
        losses[2]
    );
}
