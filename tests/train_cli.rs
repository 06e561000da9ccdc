//! `ferrozero train` end to end on the shipped Shakespeare corpus and tokenizer with a tiny
//! GPT-2 model directory generated here: the loss falls, the held-out loss is reported, and
//! the output directory loads back with the same parameters bit for bit.

mod train_common;

use std::path::Path;

use ferrozero::runtime::nn::weights::{self, Naming};
use train_common::{metrics, model_dir, repo, s, train, train_ds_config, TempDir};

#[test]
fn fine_tunes_on_shakespeare_and_the_output_loads_back() {
    let tmp = TempDir::new("e2e");
    let (model, out, again) = (tmp.0.join("model"), tmp.0.join("out"), tmp.0.join("again"));
    model_dir(&model);
    let corpus = tmp.0.join("shakespeare.txt");
    std::fs::copy(repo("data/shakespeare/input.txt"), &corpus).unwrap();
    let (m1, m2) = (tmp.0.join("m1.jsonl"), tmp.0.join("m2.jsonl"));
    let ck = tmp.0.join("ck");
    let common = [
        "--data",
        s(&corpus),
        "--ranks",
        "2",
        "--seq-len",
        "64",
        "--no-progress",
    ];
    let first = [
        &common[..],
        &["--model", s(&model), "--steps", "30", "--eval-every", "10"],
        &["--output", s(&out), "--metrics", s(&m1), "--save", s(&ck)],
    ]
    .concat();
    let (ok, text) = train(&tmp.0, &first);
    assert!(ok, "{text}");
    let losses = metrics(&m1, "loss");
    let evals = metrics(&m1, "eval_loss");
    assert_eq!(losses.len(), 30, "{text}");
    assert!(
        losses[29] < losses[0] - 0.5,
        "loss did not fall: {losses:?}"
    );
    assert_eq!(evals.len(), 3, "{text}");
    assert!(evals[2] < evals[0], "held-out loss did not fall: {evals:?}");
    assert!(text.contains("step 30 eval_loss="), "{text}");
    for f in ["config.json", "tokenizer.json", "model.safetensors"] {
        assert!(out.join(f).is_file(), "{f} missing from the output");
    }
    // The output is a model directory: a run from it without steps reports the same held-out
    // loss (bit for bit) and writes the same parameters back. Its tokens come from the cache.
    let second = [
        &common[..],
        &["--model", s(&out), "--steps", "0", "--output", s(&again)],
        &["--metrics", s(&m2)],
    ]
    .concat();
    let (ok, text) = train(&tmp.0, &second);
    assert!(ok, "{text}");
    assert!(text.contains("(cached)"), "{text}");
    assert_eq!(metrics(&m2, "eval_loss"), vec![evals[2]]);
    // Resuming the checkpoint continues at step 31.
    let m3 = tmp.0.join("m3.jsonl");
    let third = [
        &common[..],
        &["--model", s(&model), "--steps", "35", "--resume", s(&ck)],
        &["--metrics", s(&m3)],
    ]
    .concat();
    let (ok, text) = train(&tmp.0, &third);
    assert!(ok, "{text}");
    assert_eq!(metrics(&m3, "step")[0], 31.0, "{text}");
    assert_eq!(metrics(&m3, "loss").len(), 5, "{text}");
    let a = weights::load(&out.join("model.safetensors"), Naming::Exact).unwrap();
    let b = weights::load(&again.join("model.safetensors"), Naming::Exact).unwrap();
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(&b) {
        assert_eq!((&x.name, &x.shape), (&y.name, &y.shape));
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert!(bits(&x.data) == bits(&y.data), "{} differs", x.name);
    }
}

#[test]
fn bad_inputs_are_clear_errors_naming_the_file() {
    let tmp = TempDir::new("errors");
    let model = tmp.0.join("model");
    model_dir(&model);
    let run = |data: &Path| {
        train(
            &tmp.0,
            &["--model", s(&model), "--data", s(data), "--seq-len", "32"],
        )
    };
    let csv = tmp.0.join("c.csv");
    std::fs::write(&csv, "a,b\n").unwrap();
    let (ok, text) = run(&csv);
    assert!(!ok);
    assert!(
        text.contains(&format!("{}: unknown data extension `csv`", csv.display())),
        "{text}"
    );
    let empty = tmp.0.join("empty.txt");
    std::fs::write(&empty, "").unwrap();
    let (ok, text) = run(&empty);
    assert!(!ok);
    assert!(
        text.contains(&format!("{}: the corpus is empty", empty.display())),
        "{text}"
    );
    let bad = tmp.0.join("bad.jsonl");
    std::fs::write(&bad, "{\"text\": \"To be\"}\n{\"txt\": \"or not\"}\n").unwrap();
    let (ok, text) = run(&bad);
    assert!(!ok);
    assert!(
        text.contains(&format!("{}: line 2: no \"text\" field", bad.display())),
        "{text}"
    );
    std::fs::write(model.join("tokenizer.json"), "{\"version\": ").unwrap();
    let ok_text = tmp.0.join("ok.txt");
    std::fs::write(&ok_text, "To be, or not to be, that is the question.").unwrap();
    let (ok, text) = run(&ok_text);
    assert!(!ok);
    let tok = model.join("tokenizer.json");
    assert!(
        text.contains(&format!("{}: not a valid tokenizer.json", tok.display())),
        "{text}"
    );
    std::fs::remove_file(&tok).unwrap();
    let (ok, text) = run(&ok_text);
    assert!(!ok);
    assert!(
        text.contains(&format!("{}: cannot read the tokenizer", tok.display())),
        "{text}"
    );
}

/// A DeepSpeed config with the three observers on runs unchanged through `ferrozero train`
/// (they live in the engine, so the command gets them as `train_gpt` does): an event file,
/// one CSV row per step, and DeepSpeed's communication summary.
#[test]
fn a_deepspeed_config_with_monitors_runs_through_ferrozero_train() {
    let tmp = TempDir::new("monitors");
    let d = tmp.0.display().to_string();
    let config = serde_json::json!({
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 2,
        "zero_optimization": {"stage": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "tensorboard": {"enabled": true, "output_path": format!("{d}/tb"), "job_name": "ft"},
        "csv_monitor": {"enabled": true, "output_path": format!("{d}/csv"), "job_name": "ft"},
        "comms_logger": {"enabled": true}
    });
    let (ok, text, _) = train_ds_config(&tmp.0, &config, 4);
    assert!(ok, "{text}");
    let events: Vec<_> = std::fs::read_dir(tmp.0.join("tb/ft"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert!(
        events.len() == 1 && events[0].starts_with("events.out.tfevents."),
        "{events:?}"
    );
    let loss = std::fs::read_to_string(tmp.0.join("csv/ft/Train_Samples_train_loss.csv")).unwrap();
    let rows: Vec<&str> = loss.lines().collect();
    assert_eq!(rows.len(), 5, "{loss}");
    assert_eq!(rows[0], "step,train_loss");
    // Indexed by samples: 2 per rank per step, 2 ranks.
    assert!(rows[4].starts_with("16,"), "{loss}");
    assert!(text.contains("Comm. Op"), "{text}");
    assert!(text.contains("reduce_scatter_tensor"), "{text}");
}

/// A DeepSpeed config with a Lamb section (every FusedLamb key) trains through
/// `ferrozero train` at two ranks, stage 2 (each rank owns a shard: the trust ratios come from
/// partial norms combined across ranks), with the optimizer state on the CPU device.
#[test]
fn a_deepspeed_lamb_config_trains_through_ferrozero_train() {
    let tmp = TempDir::new("lamb");
    let config = serde_json::json!({
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "Lamb", "params": {
            "lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8, "eps_inside_sqrt": false,
            "weight_decay": 0.01, "bias_correction": true, "max_coeff": 10.0,
            "min_coeff": 0.01, "amsgrad": false}}
    });
    let (ok, text, losses) = train_ds_config(&tmp.0, &config, 20);
    assert!(ok, "{text}");
    assert_eq!(losses.len(), 20, "{text}");
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
    assert!(losses[19] < losses[0], "loss did not fall: {losses:?}");
}

/// As a new user runs it, from the data's directory with a relative `--data`, output to a
/// file: the second run reads the token cache the first wrote (it was deleted as stale
/// before), the log shows the held-out losses, `--output` carries `generation_config.json`,
/// and a config with a typo is refused before the corpus is tokenized.
#[test]
fn a_relative_data_path_keeps_its_cache_and_the_output_is_complete() {
    let tmp = TempDir::new("relative");
    let model = tmp.0.join("model");
    model_dir(&model);
    let generation = r#"{"bos_token_id": 0, "eos_token_id": 0, "max_length": 64}"#;
    std::fs::write(model.join("generation_config.json"), generation).unwrap();
    std::fs::copy(repo("data/shakespeare/input.txt"), tmp.0.join("input.txt")).unwrap();
    let out = tmp.0.join("out");
    let args = [
        "--data",
        "input.txt",
        "--model",
        s(&model),
        "--seq-len",
        "64",
        "--steps",
        "4",
        "--eval-every",
        "2",
        "--eval-fraction",
        "0.1",
        "--output",
        s(&out),
    ];
    let (ok, first) = train(&tmp.0, &args);
    assert!(ok, "{first}");
    assert!(!first.contains("(cached)"), "{first}");
    assert!(
        first.contains("step 2 eval_loss=") && first.contains("step 4 eval_loss="),
        "{first}"
    );
    let caches = |d: &Path| {
        std::fs::read_dir(d)
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().ends_with(".tokens.bin"))
            .count()
    };
    assert_eq!(caches(&tmp.0), 1, "the cache was written and kept");
    let (ok, second) = train(&tmp.0, &args);
    assert!(ok, "{second}");
    assert!(second.contains("(cached)"), "{second}");
    assert_eq!(caches(&tmp.0), 1);
    let copied = std::fs::read_to_string(out.join("generation_config.json")).unwrap();
    assert_eq!(copied, generation);
    // A typo in the config is refused before any tokenizing (no cache, no data line).
    let typo = tmp.0.join("typo.json");
    std::fs::write(
        &typo,
        r#"{"train_micro_batch_size_per_gpu": 1, "zero_optimisation": {}}"#,
    )
    .unwrap();
    std::fs::copy(repo("data/shakespeare/input.txt"), tmp.0.join("fresh.txt")).unwrap();
    let bad = [
        "--data",
        "fresh.txt",
        "--model",
        s(&model),
        "--config",
        s(&typo),
        "--steps",
        "1",
    ];
    let (ok, text) = train(&tmp.0, &bad);
    assert!(!ok && text.contains("zero_optimisation"), "{text}");
    assert!(
        !text.contains("data:"),
        "tokenized before the config was checked: {text}"
    );
    let fresh = std::fs::read_dir(&tmp.0)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("fresh.txt."))
        .count();
    assert_eq!(fresh, 0, "{text}");
}
