//! The user-facing examples run end to end at a small size and prove what they claim:
//! `custom_module`'s gradient check passes (and fails on a planted backward bug) and its loss
//! falls under ZeRO-2; `finetune_llama` fine-tunes under ZeRO-3 with CPU offload, its
//! consolidated weights equal the live parameters, and a second run starts from them.
//!
//! `cargo test --workspace --release` builds the examples next to this test's executable;
//! after `cargo test --test examples_run` alone, build them with `cargo build --examples`
//! (same profile) first.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use ferrozero::runtime::nn::llama::{self, LlamaConfig};
use ferrozero::runtime::nn::weights::{self, Naming};
use ferrozero::runtime::tensor::DType;

/// `target/<profile>/examples/<name>`, built by `cargo test` next to this test binary.
fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test knows its own path");
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("test executables live in target/<profile>/deps");
    let p = dir.join("examples").join(name);
    let build = "`cargo test --workspace` builds it; before `cargo test --test examples_run` \
                 run `cargo build --examples` (same profile)";
    let built = std::fs::metadata(&p)
        .and_then(|m| m.modified())
        .unwrap_or_else(|_| panic!("{} is missing: {build}", p.display()));
    // Only the example's own source is compared: the common slip is editing it and testing
    // the old binary.
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("examples/{name}.rs"));
    let edited = std::fs::metadata(&source)
        .and_then(|m| m.modified())
        .unwrap();
    assert!(
        edited <= built,
        "{} is older than {}: {build}",
        p.display(),
        source.display()
    );
    p
}

/// Runs an example; returns its exit status and stdout + stderr.
fn run(name: &str, args: &[&str]) -> (Output, String) {
    let out = Command::new(example(name))
        .args(args)
        // The engine's info logs are not what these tests look at.
        .env("RUST_LOG", "warn")
        .output()
        .expect("the example starts");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out, text)
}

fn run_ok(name: &str, args: &[&str]) -> String {
    let (out, text) = run(name, args);
    assert!(out.status.success(), "{name} {args:?} failed:\n{text}");
    text
}

/// The two numbers of the `loss fell: first A -> last B` line.
fn losses(text: &str) -> (f64, f64) {
    let line = text
        .lines()
        .find_map(|l| l.strip_prefix("loss fell: first "))
        .unwrap_or_else(|| panic!("no `loss fell` line in:\n{text}"));
    let (a, b) = line
        .split_once(" -> last ")
        .unwrap_or_else(|| panic!("malformed line {line:?}"));
    (a.trim().parse().unwrap(), b.trim().parse().unwrap())
}

/// A fresh directory for one test, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        let p = std::env::temp_dir().join(format!("fz-examples-{tag}-{}", std::process::id()));
        std::fs::remove_dir_all(&p).ok();
        std::fs::create_dir_all(&p).unwrap();
        Self(p)
    }
    fn path(&self, name: &str) -> String {
        self.0.join(name).to_str().unwrap().to_string()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        std::fs::remove_dir_all(&self.0).ok();
    }
}

#[test]
fn custom_module_passes_gradcheck_and_learns_with_zero2() {
    let text = run_ok("custom_module", &["--steps", "40"]);
    assert!(text.contains("gradcheck passed: "), "{text}");
    let (first, last) = losses(&text);
    assert!(first > 3.5, "starts near ln(64): {text}");
    assert!(last < 0.5 * first, "{text}");
}

#[test]
fn custom_module_gradcheck_catches_a_wrong_backward() {
    let (out, text) = run("custom_module", &["--bug", "skip-residual"]);
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("gradcheck FAILED"), "{text}");
    // The failure is in the input gradient, which the planted bug corrupts; no training ran.
    let input = text.lines().find(|l| l.starts_with("input")).unwrap();
    assert!(!input.ends_with("failures 0"), "{text}");
    assert!(!text.contains("loss fell"), "{text}");
}

#[test]
fn finetune_llama_consolidates_exactly_what_it_trained() {
    let dir = TempDir::new("finetune");
    let out = dir.path("run1");
    let text = run_ok("finetune_llama", &["--steps", "30", "--out", &out]);
    let model = llama::build(&LlamaConfig::preset("tiny").unwrap()).unwrap();
    let tensors: usize = model
        .units
        .iter()
        .map(|u| u.module.param_specs().len())
        .sum();
    let line = format!(
        "consolidated weights match live parameters: {tensors} tensors, {} params",
        model.num_params()
    );
    assert!(text.contains(&line), "expected {line:?} in:\n{text}");
    let (first, last) = losses(&text);
    assert!(last < first - 0.5, "{text}");
    // Fine-tuning moved every tensor away from the starting file.
    let start = weights::load(
        Path::new(&format!("{out}/pretrained.safetensors")),
        Naming::Exact,
    )
    .unwrap();
    let tuned = weights::load(
        Path::new(&format!("{out}/model.safetensors")),
        Naming::Exact,
    )
    .unwrap();
    let names = |v: &[weights::NamedTensor]| v.iter().map(|t| t.name.clone()).collect::<Vec<_>>();
    assert_eq!(names(&start), names(&tuned));
    assert!(start.iter().zip(&tuned).all(|(a, b)| a.data != b.data));
    // A new run from the consolidated file starts where the first one ended, on 1 rank: the
    // file is a complete, world-size-free model.
    let again = run_ok(
        "finetune_llama",
        &[
            "--init",
            &format!("{out}/model.safetensors"),
            "--steps",
            "10",
            "--ranks",
            "1",
            "--out",
            &dir.path("run2"),
        ],
    );
    let (resumed, _) = losses(&again);
    assert!(
        resumed < 0.5 * first,
        "first run: {text}\nsecond run: {again}"
    );
}

#[test]
fn finetune_llama_refuses_weights_of_another_shape() {
    let dir = TempDir::new("finetune-bad");
    let cfg = dir.path("config.json");
    std::fs::write(
        &cfg,
        r#"{"model_type": "llama", "hidden_size": 16, "intermediate_size": 32,
            "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 64,
            "max_position_embeddings": 64}"#,
    )
    .unwrap();
    // Every tensor of the default (width 32) model, offered to a width-16 model.
    let wide = dir.path("wide.safetensors");
    write_zeros(&LlamaConfig::preset("tiny").unwrap(), Path::new(&wide));
    let (out, text) = run(
        "finetune_llama",
        &[
            "--model-config",
            &cfg,
            "--init",
            &wide,
            "--out",
            &dir.path("never"),
        ],
    );
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("tensor `model.embed_tokens.weight` has shape [64, 32]")
            && text.contains("needs [64, 16]"),
        "{text}"
    );
    assert!(!Path::new(&dir.path("never")).exists(), "nothing written");
}

/// A safetensors file with every parameter of `cfg`'s model, all zeros.
fn write_zeros(cfg: &LlamaConfig, path: &Path) {
    let model = llama::build(cfg).unwrap();
    let specs: Vec<_> = model
        .units
        .iter()
        .flat_map(|u| u.module.param_specs())
        .collect();
    let zeros: Vec<Vec<f32>> = specs.iter().map(|s| vec![0.0; s.numel()]).collect();
    let tensors: Vec<(&str, &[usize], &[f32])> = specs
        .iter()
        .zip(&zeros)
        .map(|(s, z)| (s.name.as_str(), s.shape.as_slice(), z.as_slice()))
        .collect();
    weights::save(path, &tensors, DType::F32).unwrap();
}

/// `finetune_llama --peft`: LoRA on every linear layer with the norms trained in full, the
/// base frozen, under ZeRO-3 with CPU offload in bf16; the checkpoint consolidates to the live
/// parameters bit for bit (frozen groups included), the frozen base comes out as it went in,
/// and the adapter is written as PEFT writes it.
#[test]
fn finetune_llama_with_lora_keeps_the_base_and_writes_the_adapter() {
    let dir = TempDir::new("finetune-lora");
    let (out, cfg) = (dir.path("run"), dir.path("adapter_config.json"));
    std::fs::write(
        &cfg,
        r#"{"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": "all-linear",
            "modules_to_save": ["norm"]}"#,
    )
    .unwrap();
    let text = run_ok(
        "finetune_llama",
        &["--steps", "30", "--out", &out, "--peft", &cfg],
    );
    assert!(
        text.contains("consolidated weights match live parameters"),
        "{text}"
    );
    let (first, last) = losses(&text);
    assert!(last < first - 0.1, "{text}");
    let load = |f: &str| weights::load(Path::new(&format!("{out}/{f}")), Naming::Exact).unwrap();
    let (start, tuned) = (load("pretrained.safetensors"), load("model.safetensors"));
    for t in &start {
        let after = tuned.iter().find(|u| u.name == t.name).unwrap();
        // The base weights were bf16 in the run: compare as the run held them.
        let mut b = ferrozero::runtime::tensor::FlatBuf::zeros(DType::Bf16, t.data.len());
        b.store_f32(0, &t.data);
        let mut rounded = vec![0.0f32; t.data.len()];
        b.load_f32(0, &mut rounded);
        let trains = t.name.contains("norm");
        assert_eq!(after.data != rounded, trains, "{}", t.name);
    }
    let adapter = load("adapter/adapter_model.safetensors");
    // 7 adapted layers per block, 2 blocks, A and B; 5 norms of the tiny Llama.
    assert_eq!(
        adapter.len(),
        2 * 7 * 2 + 5,
        "{:?}",
        adapter.iter().map(|t| &t.name).collect::<Vec<_>>()
    );
    assert!(Path::new(&format!("{out}/adapter/adapter_config.json")).is_file());
}
