//! Helpers of the `ferrozero train` tests: a tiny GPT-2 model directory for the shipped
//! tokenizer, and running the CLI in a scratch directory.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

use ferrozero::runtime::nn::init;
use ferrozero::runtime::nn::weights;
use ferrozero::runtime::tensor::DType;

pub fn repo(p: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(p)
}

/// `target/<profile>/examples/train_gpt`, built by `cargo test` next to the test binaries.
pub fn train_gpt() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let p = exe.parent().unwrap().parent().unwrap();
    let p = p.join("examples").join("train_gpt");
    assert!(
        p.exists(),
        "cargo test builds examples/train_gpt next to the tests"
    );
    p
}

pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        let d = std::env::temp_dir().join(format!("fz-train-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        Self(d)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        std::fs::remove_dir_all(&self.0).ok();
    }
}

/// A GPT-2 model directory sized for the shipped tokenizer, with seeded random weights.
pub fn model_dir(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    let config = r#"{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": 2,
        "n_head": 2, "n_embd": 32, "vocab_size": 512, "n_positions": 64, "resid_pdrop": 0.0,
        "embd_pdrop": 0.0, "attn_pdrop": 0.0, "eos_token_id": 0}"#;
    std::fs::write(dir.join("config.json"), config).unwrap();
    std::fs::copy(
        repo("data/shakespeare/tokenizer.json"),
        dir.join("tokenizer.json"),
    )
    .unwrap();
    let spec = ferrozero::train::model::parse(&dir.join("config.json").to_string_lossy()).unwrap();
    let model = spec.build().unwrap();
    let specs: Vec<_> = model
        .units
        .iter()
        .flat_map(|u| u.module.param_specs())
        .chain(model.shared.iter().cloned())
        .collect();
    let values: Vec<Vec<f32>> = specs
        .iter()
        .map(|s| {
            let mut v = vec![0.0; s.numel()];
            init::fill(&s.init, init::param_seed(7, &s.name), &mut v);
            v
        })
        .collect();
    let tensors: Vec<(&str, &[usize], &[f32])> = specs
        .iter()
        .zip(&values)
        .map(|(s, v)| (s.name.as_str(), s.shape.as_slice(), v.as_slice()))
        .collect();
    weights::save(&dir.join("model.safetensors"), &tensors, DType::F32).unwrap();
}

/// Runs `ferrozero train` in `cwd` (a scratch directory: nothing is read from it).
pub fn train(cwd: &Path, args: &[&str]) -> (bool, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ferrozero"));
    run_output(cmd.arg("train").args(args).current_dir(cwd))
}

/// Runs `cmd` to its end: whether it succeeded, and its standard output then its standard
/// error as one text (what a user sees).
pub fn run_output(cmd: &mut Command) -> (bool, String) {
    let out = cmd.output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

pub fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

pub fn metrics(path: &Path, key: &str) -> Vec<f64> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()[key].as_f64())
        .collect()
}

/// Runs `ferrozero train` in `tmp` on a fresh tiny model directory and the Shakespeare corpus
/// at two ranks, sequences of 32, under the DeepSpeed `config` (written to a file); `steps`
/// steps with their metrics. Returns whether it ran, the log and the losses.
pub fn train_ds_config(
    tmp: &Path,
    config: &serde_json::Value,
    steps: usize,
) -> (bool, String, Vec<f64>) {
    let model = tmp.join("model");
    model_dir(&model);
    let ds = tmp.join("ds_config.json");
    std::fs::write(&ds, config.to_string()).unwrap();
    let m = tmp.join("m.jsonl");
    let corpus = repo("data/shakespeare/input.txt");
    let steps = steps.to_string();
    let args = [
        "--model",
        s(&model),
        "--data",
        s(&corpus),
        "--config",
        s(&ds),
        "--ranks",
        "2",
        "--steps",
        &steps,
        "--seq-len",
        "32",
        "--metrics",
        s(&m),
        "--no-cache",
        "--no-progress",
    ];
    let (ok, text) = train(tmp, &args);
    let losses = if ok { metrics(&m, "loss") } else { Vec::new() };
    (ok, text, losses)
}
