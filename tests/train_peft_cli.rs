//! `ferrozero train` with part of the model trained: LoRA from a PEFT config (a PEFT adapter
//! directory out, which a second run starts from, bit for bit, and which `--merge` folds into
//! the base weights), `--freeze` rules (the frozen weights come out as they went in), and the
//! mistakes a user makes with either, each a clear error naming the file, key or pattern.

mod train_common;

use std::collections::BTreeMap;
use std::path::Path;

use ferrozero::runtime::nn::weights::{self, NamedTensor, Naming};
use train_common::{metrics, model_dir, repo, s, train, TempDir};

type Tensors = BTreeMap<String, NamedTensor>;

fn tensors(path: &Path) -> Tensors {
    (weights::load(path, Naming::Exact).unwrap().into_iter())
        .map(|t| (t.name.clone(), t))
        .collect()
}

const LORA: &str = r#"{"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 8,
    "target_modules": ["c_attn", "c_fc"], "fan_in_fan_out": true, "bias": "none"}"#;

/// A model directory, the corpus, and the arguments every run shares.
fn setup(tmp: &TempDir) -> (std::path::PathBuf, Vec<String>) {
    let model = tmp.0.join("model");
    model_dir(&model);
    let corpus = tmp.0.join("shakespeare.txt");
    std::fs::copy(repo("data/shakespeare/input.txt"), &corpus).unwrap();
    let common = [
        "--model",
        s(&model),
        "--data",
        s(&corpus),
        "--seq-len",
        "64",
    ];
    let mut args: Vec<String> = common.iter().map(|a| a.to_string()).collect();
    args.extend(["--no-progress", "--no-cache"].map(String::from));
    (model, args)
}

/// `common` followed by `more`.
fn args<'a>(common: &'a [String], more: &[&'a str]) -> Vec<&'a str> {
    let common = common.iter().map(String::as_str);
    common.chain(more.iter().copied()).collect()
}

fn run(tmp: &TempDir, common: &[String], more: &[&str]) -> String {
    let (ok, text) = train(&tmp.0, &args(common, more));
    assert!(ok, "{text}");
    text
}

/// Runs with `more`, writing to `out`; the base model's weights and the written ones.
fn run_weights(
    tmp: &TempDir,
    common: &[String],
    (model, out): (&Path, &Path),
    more: &[&str],
) -> (Tensors, Tensors) {
    run(tmp, common, &[more, &["--output", s(out)]].concat());
    let weights = |dir: &Path| tensors(&dir.join("model.safetensors"));
    (weights(model), weights(out))
}

#[test]
fn lora_trains_writes_a_peft_directory_resumes_from_it_and_merges() {
    let tmp = TempDir::new("lora");
    let (model, common) = setup(&tmp);
    let cfg = tmp.0.join("adapter_config.json");
    std::fs::write(&cfg, LORA).unwrap();
    let (out, again, merged, m) = (
        tmp.0.join("adapter"),
        tmp.0.join("again"),
        tmp.0.join("merged"),
        tmp.0.join("m.jsonl"),
    );
    let ck = tmp.0.join("ck");
    // ZeRO-3 over two ranks, no warmup: adapters starting at B = 0 learn within 20 steps.
    let ds = tmp.0.join("ds.json");
    std::fs::write(
        &ds,
        r#"{"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 3},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}"#,
    )
    .unwrap();
    let more = [
        "--peft",
        s(&cfg),
        "--steps",
        "20",
        "--ranks",
        "2",
        "--config",
        s(&ds),
    ];
    run(
        &tmp,
        &common,
        &[
            &more[..],
            &["--output", s(&out), "--metrics", s(&m), "--save", s(&ck)],
        ]
        .concat(),
    );
    let losses = metrics(&m, "loss");
    assert!(
        losses[19] < losses[0] - 0.03,
        "LoRA did not learn: {losses:?}"
    );
    let adapter = tensors(&out.join("adapter_model.safetensors"));
    // c_attn and c_fc of both blocks, A and B each; nothing of the base.
    assert_eq!(adapter.len(), 8, "{:?}", adapter.keys());
    assert!(adapter
        .keys()
        .all(|k| k.starts_with("base_model.model.transformer.h.")));
    assert!(out.join("adapter_config.json").is_file());
    // A run from the directory without steps writes the same adapter back, bit for bit.
    run(
        &tmp,
        &common,
        &["--peft", s(&out), "--steps", "0", "--output", s(&again)],
    );
    let back = tensors(&again.join("adapter_model.safetensors"));
    for (name, t) in &adapter {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&back[name].data), bits(&t.data), "{name}");
    }
    // Merged: W + (alpha / r) B A in GPT-2's [in, out] layout, and no adapter tensors.
    let flags = ["--peft", s(&out), "--steps", "0", "--merge"];
    let (base, got) = run_weights(&tmp, &common, (&model, &merged), &flags);
    assert!(got.keys().all(|k| !k.contains("lora_")), "{:?}", got.keys());
    let w = "transformer.h.1.attn.c_attn";
    let (a, b) = (
        &adapter[&format!("base_model.model.{w}.lora_A.weight")].data,
        &adapter[&format!("base_model.model.{w}.lora_B.weight")].data,
    );
    let (n_in, n_out, r) = (32, 96, 4);
    let (i, o) = (5, 70);
    let delta: f32 = (0..r).map(|k| b[o * r + k] * a[k * n_in + i]).sum();
    let key = format!("{w}.weight");
    let want = base[&key].data[i * n_out + o] + 2.0 * delta;
    assert!((got[&key].data[i * n_out + o] - want).abs() < 1e-6);
    assert_eq!(got[&key].shape, vec![n_in, n_out]);
    assert_eq!(got.len(), base.len());
    // The stage-3 checkpoint consolidates to the same adapter directory, and merged to the
    // same model.
    let (from_ck, merged_ck) = (tmp.0.join("from-ck"), tmp.0.join("merged-ck"));
    consolidate(&[s(&ck), "-o", s(&from_ck)]);
    consolidate(&[s(&ck), "-o", s(&merged_ck), "--merge"]);
    assert!(from_ck.join("adapter_config.json").is_file());
    assert!(!merged_ck.join("adapter_config.json").exists());
    let ck_adapter = tensors(&from_ck.join("adapter_model.safetensors"));
    assert_eq!(
        ck_adapter.keys().collect::<Vec<_>>(),
        adapter.keys().collect::<Vec<_>>()
    );
    for (name, t) in &adapter {
        assert_eq!(ck_adapter[name].data, t.data, "{name}");
    }
    let ck_merged = tensors(&merged_ck.join("model.safetensors"));
    for (name, t) in &got {
        assert_eq!(ck_merged[name].data, t.data, "{name}");
    }
    // The checkpoint names the base model instead of copying it: its shard files hold the
    // adapters and their optimizer state only.
    let tag = std::fs::read_to_string(ck.join("latest")).unwrap();
    let saved: u64 = (std::fs::read_dir(ck.join(tag.trim())).unwrap())
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with("rank-"))
        .map(|e| e.metadata().unwrap().len())
        .sum();
    let base_bytes = std::fs::metadata(model.join("model.safetensors"))
        .unwrap()
        .len();
    assert!(
        saved * 4 < base_bytes,
        "checkpoint {saved} bytes, base {base_bytes}"
    );
    // Resumed over another base, it refuses, naming the base it was trained over.
    let wrong = [&common[..]].concat();
    let wrong: Vec<String> = (wrong.iter())
        .map(|a| a.replace(s(&model), s(&merged)))
        .collect();
    let resume = [
        "--peft",
        s(&cfg),
        "--config",
        s(&ds),
        "--steps",
        "23",
        "--resume",
        s(&ck),
    ];
    let (ok, text) = train(&tmp.0, &args(&wrong, &resume));
    assert!(!ok, "{text}");
    assert!(
        text.contains("frozen parameters are not the ones"),
        "{text}"
    );
    // The two-rank stage-3 checkpoint resumes on one rank and trains on.
    let m2 = tmp.0.join("m2.jsonl");
    run(
        &tmp,
        &common,
        &[&resume[..], &["--metrics", s(&m2)]].concat(),
    );
    let more_losses = metrics(&m2, "loss");
    assert_eq!(more_losses.len(), 3, "steps 21-23 after the resume");
    assert!(
        more_losses.iter().all(|l| (l - losses[19]).abs() < 0.1),
        "{more_losses:?}"
    );
}

fn consolidate(args: &[&str]) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ferrozero"))
        .args(["checkpoint", "consolidate"])
        .args(args)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{args:?}: {text}");
}

#[test]
fn freeze_rules_leave_frozen_weights_as_they_were() {
    let tmp = TempDir::new("freeze");
    let (model, common) = setup(&tmp);
    let out = tmp.0.join("out");
    let flags = ["--freeze", "*", "!transformer.h.1.*", "--steps", "5"];
    let (before, after) = run_weights(&tmp, &common, (&model, &out), &flags);
    for (name, t) in &after {
        let same = before[name].data == t.data;
        assert_eq!(same, !name.starts_with("transformer.h.1."), "{name}");
    }
}

#[test]
fn lora_and_freeze_mistakes_are_clear_errors() {
    let tmp = TempDir::new("lora-errors");
    let (_, common) = setup(&tmp);
    let nothing = tmp.0.join("nothing.json");
    std::fs::write(&nothing, LORA.replace("\"c_attn\", \"c_fc\"", "\"q_proj\"")).unwrap();
    let dora = tmp.0.join("dora.json");
    std::fs::write(
        &dora,
        LORA.replace("\"bias\": \"none\"", "\"use_dora\": true"),
    )
    .unwrap();
    let empty_dir = tmp.0.join("no-weights");
    std::fs::create_dir_all(&empty_dir).unwrap();
    std::fs::write(empty_dir.join("adapter_config.json"), LORA).unwrap();
    let cases: [(&[&str], &[&str]); 5] = [
        (
            &["--peft", s(&nothing)],
            &["nothing.json", "target_modules", "c_attn"],
        ),
        (&["--peft", s(&dora)], &["dora.json", "use_dora"]),
        (
            &["--peft", s(&empty_dir)],
            &["adapter_model.safetensors", "missing"],
        ),
        (
            &["--freeze", "model.layers.*"],
            &["\"model.layers.*\"", "matches no parameter"],
        ),
        (&["--freeze", "*"], &["nothing would train"]),
    ];
    for (flags, want) in cases {
        let (ok, text) = train(&tmp.0, &args(&common, flags));
        assert!(!ok, "{flags:?} ran");
        for w in want {
            assert!(text.contains(w), "{flags:?}: `{w}` not in: {text}");
        }
        assert!(!text.contains("panicked"), "{text}");
    }
}
