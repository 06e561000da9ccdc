//! Each supported architecture against transformers' own model: the model built from the
//! `config.json` transformers wrote, loaded with its initial weights, trained 20 f32 AdamW
//! steps with clipping; every step's loss within 2e-5 of transformers'. Fixtures and the
//! script that made them: `tests/fixtures/gen_hf_parity.py`.

mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::parity_config;
use ferrozero_config::resolved::ZeroStage;
use ferrozero_runtime::comm::local::run_ranks;
use ferrozero_runtime::engine::Engine;
use ferrozero_runtime::nn::hf::{Architecture, HfModel};
use ferrozero_runtime::nn::weights::{self, NamedTensor, Naming};
use ferrozero_runtime::nn::Batch;

const STEPS: usize = 20;
const TOLERANCE: f64 = 2e-5;

fn fixture(arch: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(arch)
}

fn take<'a>(f: &'a [NamedTensor], name: &str) -> &'a NamedTensor {
    f.iter()
        .find(|t| t.name == name)
        .unwrap_or_else(|| panic!("fixture lacks {name}"))
}

/// Trains the fixture's model for its 20 steps; returns each step's loss.
fn train(arch: &str, stage: ZeroStage, world: usize) -> (Vec<f64>, Vec<f64>) {
    let dir = fixture(arch);
    let hf = HfModel::from_file(&dir.join("config.json")).expect("config.json reads");
    // The batch and losses keep their names; parameters are named as the architecture's
    // checkpoints name them.
    let mut file =
        weights::load(&dir.join("parity.safetensors"), Naming::Exact).expect("fixture loads");
    let is_param = |n: &str| !n.starts_with("batch.") && n != "losses";
    for t in file.iter_mut().filter(|t| is_param(&t.name)) {
        t.name = hf.naming().canonical(&t.name);
    }
    let (tokens, targets) = (take(&file, "batch.tokens"), take(&file, "batch.targets"));
    let [steps, batch, seq] = tokens.shape[..] else {
        panic!("batch.tokens shape {:?}", tokens.shape)
    };
    assert_eq!(steps, STEPS);
    let want: Vec<f64> = take(&file, "losses")
        .data
        .iter()
        .map(|&l| l as f64)
        .collect();
    let model = hf.build().unwrap();
    let specs = model.units.iter().flat_map(|u| u.module.param_specs());
    let names: Vec<String> = specs.chain(model.shared.clone()).map(|p| p.name).collect();
    let init: Vec<NamedTensor> = file
        .iter()
        .filter(|t| names.contains(&t.name))
        .cloned()
        .collect();
    assert_eq!(
        init.len(),
        names.len(),
        "{arch}: fixture has every parameter"
    );
    let rows = batch / world;
    let got = run_ranks(world, Duration::from_secs(120), |comm| {
        let r = comm.rank();
        let mut e = Engine::new(hf.build()?, parity_config(stage, world, rows), comm)?;
        e.set_parameters(&init)?;
        let mut losses = vec![];
        for s in 0..STEPS {
            let span = (s * batch + r * rows) * seq..(s * batch + (r + 1) * rows) * seq;
            let b = Batch {
                batch: rows,
                seq,
                tokens: tokens.data[span.clone()]
                    .iter()
                    .map(|&t| t as u32)
                    .collect(),
                targets: targets.data[span].iter().map(|&t| t as i32).collect(),
            };
            losses.push(e.train_batch(&[b])?.loss);
        }
        Ok(losses)
    })
    .expect("training runs");
    (got[0].clone(), want)
}

fn check(arch: &str, architecture: Architecture) {
    let hf = HfModel::from_file(&fixture(arch).join("config.json")).unwrap();
    assert_eq!(hf.architecture, architecture);
    let (got, want) = train(arch, ZeroStage::Stage0, 1);
    for (s, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            (g - w).abs() <= TOLERANCE,
            "{arch} step {s}: loss {g} vs transformers' {w}\n got {got:?}\nwant {want:?}"
        );
    }
    // The model learns: the check compares training, not 20 copies of one loss.
    assert_ne!(want[0], want[STEPS - 1]);
}

#[test]
fn gpt2_trains_as_transformers_does() {
    check("gpt2", Architecture::Gpt2);
}

#[test]
fn llama_with_tied_embeddings_gqa_head_dim_and_llama3_rope_trains_as_transformers_does() {
    check("llama", Architecture::Llama);
}

#[test]
fn mistral_within_its_window_trains_as_transformers_does() {
    check("mistral", Architecture::Mistral);
}

#[test]
fn qwen2_with_qkv_biases_and_linear_rope_trains_as_transformers_does() {
    check("qwen2", Architecture::Qwen2);
}

#[test]
fn sharded_across_two_ranks_at_stage_3_qwen2_still_trains_as_transformers_does() {
    let (two, want) = train("qwen2", ZeroStage::Stage3, 2);
    for (s, (a, w)) in two.iter().zip(&want).enumerate() {
        assert!((a - w).abs() <= TOLERANCE, "step {s}: {a} vs {w}");
    }
}
