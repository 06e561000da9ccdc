//! `ferrozero estimate` and `ferrozero report` run as a user runs them: exit codes, the JSON
//! shape the docs promise, and clear errors for bad input.

use std::process::Command;

fn ferrozero(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_ferrozero"))
        .args(args)
        .output()
        .expect("run ferrozero");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn estimate_json_has_per_rank_totals_and_categories() {
    let (code, out, err) = ferrozero(&[
        "estimate",
        "--model",
        "llama-7b",
        "--gpus-per-node",
        "8",
        "--stage",
        "3",
        "--seq-len",
        "512",
        "--device-memory",
        "80GB",
        "--host-memory",
        "512GB",
        "--json",
    ]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let r = &v["per_rank"];
    let dev = r["device_bytes"].as_u64().unwrap();
    assert!((1 << 30..80_000_000_000).contains(&dev), "{dev}");
    assert_eq!(r["host_bytes"].as_u64(), Some(0));
    assert_eq!(r["nvme_bytes"].as_u64(), Some(0));
    let params = r["categories"]["device"]["parameters"].as_u64().unwrap();
    // Stage 3 over 8 ranks, bf16: 2 B/param / 8.
    let n = v["num_params"].as_u64().unwrap();
    assert!((params as f64 - n as f64 / 4.0).abs() / (n as f64 / 4.0) < 0.01);
    assert_eq!(v["fits"], true);
    assert!(v["suggestion"].is_null());
}

/// The 7B preset (stage 3, optimizer on the CPU, clipping) keeps a speculative overlap on a
/// 120 GiB host: its snapshots bounded to what the host leaves, the whole run within the host.
#[test]
fn estimate_states_the_optimizer_overlap_the_host_allows() {
    let preset = concat!(env!("CARGO_MANIFEST_DIR"), "/configs/llama7b_40gb.toml");
    let run = |host: &str| {
        let (code, out, err) = ferrozero(&[
            "estimate",
            "--model",
            "llama-7b",
            "--config",
            preset,
            "--device",
            "cuda",
            "--host-memory",
            host,
            "--json",
        ]);
        assert_eq!(code, 0, "{host}: {err}");
        serde_json::from_str::<serde_json::Value>(&out).unwrap()
    };
    let (v, roomy) = (run("120GiB"), run("400GiB"));
    assert_eq!(v["optimizer_overlap"], "speculative", "{v}");
    assert_eq!(roomy["optimizer_overlap"], "speculative", "{roomy}");
    let share = v["snapshot_share"].as_f64().unwrap();
    assert!(share > 0.05 && share < 0.5, "{share}");
    assert_eq!(roomy["snapshot_share"].as_f64(), Some(1.0));
    let snap = v["snapshot_bytes_per_rank"].as_u64().unwrap();
    let all = roomy["snapshot_bytes_per_rank"].as_u64().unwrap();
    assert!(snap > 0 && snap < all, "{snap} of {all}");
    let host = v["per_rank"]["host_bytes"].as_u64().unwrap();
    assert!(host <= 120 << 30, "{host}");
    let why = v["optimizer_overlap_reason"].as_str().unwrap();
    assert!(why.contains("the others step after backward"), "{why}");
    // With the optimizer state on the device there is no overlap, and nothing is copied.
    let (code, out, err) = ferrozero(&[
        "estimate",
        "--model",
        "tiny-llama",
        "--stage",
        "3",
        "--host-memory",
        "64GiB",
        "--json",
    ]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["optimizer_overlap"], "off", "{v}");
    assert_eq!(v["snapshot_bytes_per_rank"].as_u64(), Some(0));
}

#[test]
fn estimate_that_does_not_fit_exits_1_with_a_suggestion() {
    let (code, out, _) = ferrozero(&[
        "estimate",
        "--params",
        "7e9",
        "--layers",
        "32",
        "--hidden",
        "4096",
        "--gpus-per-node",
        "8",
        "--seq-len",
        "1024",
        "--device-memory",
        "40GiB",
        "--host-memory",
        "1TB",
    ]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("DOES NOT FIT"), "{out}");
    assert!(out.contains("cheapest change that fits"), "{out}");
}

#[test]
fn estimate_reads_hf_config_json() {
    let dir = std::env::temp_dir().join(format!("fz-est-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("config.json");
    std::fs::write(
        &path,
        r#"{"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 64,
            "vocab_size": 100, "n_positions": 64, "attn_pdrop": 0.0}"#,
    )
    .unwrap();
    let (code, out, err) = ferrozero(&[
        "estimate",
        "--model-config",
        path.to_str().unwrap(),
        "--json",
        "--host-memory",
        "1GB",
    ]);
    std::fs::remove_dir_all(&dir).ok();
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["seq_len"], 64);
}

/// A GPU is priced with its own figures on a machine without one: bf16 activations, flash
/// attention's log-sum-exp and the chunked head instead of the CPU's probabilities and f32
/// working copies, so the same run needs less device memory than the CPU's working set.
#[test]
fn estimate_prices_the_device_named_without_opening_it() {
    let run = |device: &str| {
        let (code, out, err) = ferrozero(&[
            "estimate",
            "--model",
            "llama-7b",
            "--stage",
            "3",
            "--seq-len",
            "4096",
            "--device-memory",
            "1TB",
            "--host-memory",
            "1TB",
            "--device",
            device,
            "--json",
        ]);
        assert_eq!(code, 0, "{device}: {err}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["device"], device);
        let figures = v["device_figures"].as_str().unwrap().to_string();
        // Every page-locked figure is listed (the staging: 0 in this config, which offloads
        // nothing; the GPU's upload ring).
        let locked = &v["per_rank"]["page_locked_bytes"];
        for k in ["parameters", "staging", "ring", "snapshots"] {
            assert!(
                locked[k].is_u64(),
                "{device}: page_locked_bytes.{k} in {locked}"
            );
        }
        assert_eq!(locked["staging"], 0, "{device}");
        (v["per_rank"]["device_bytes"].as_u64().unwrap(), figures)
    };
    let ((gpu, gpu_figures), (cpu, cpu_figures)) = (run("cuda"), run("cpu"));
    assert!(gpu_figures.contains("flash attention"), "{gpu_figures}");
    assert!(cpu_figures.contains("f32 working copies"), "{cpu_figures}");
    // The CPU keeps 32 heads x 4096² f32 probabilities per layer; the GPU 32 x 4096 floats.
    assert!(cpu > gpu + (30u64 << 30), "cpu {cpu} vs gpu {gpu}");
}

#[test]
fn estimate_rejects_bad_input_with_exit_2() {
    for args in [
        &["estimate", "--model", "gpt5"][..],
        &["estimate", "--model", "gpt2-124m", "--seq-len", "5000"],
        &[
            "estimate",
            "--model",
            "gpt2-124m",
            "--device-memory",
            "lots",
        ],
        &["estimate", "--model", "gpt2-124m", "--micro-batch", "0"],
        &["estimate", "--model", "gpt2-124m", "--device", "tpu"],
        &[
            "estimate",
            "--model",
            "gpt2-124m",
            "--config",
            "/nonexistent/ds.json",
        ],
        &["estimate"],
    ] {
        let (code, _, err) = ferrozero(args);
        assert_eq!(code, 2, "{args:?}");
        assert!(err.starts_with("error:"), "{args:?}: {err}");
    }
}

#[test]
fn report_runs_and_explains_what_is_missing() {
    let (code, out, err) = ferrozero(&["report"]);
    assert_eq!(code, 0, "{err}");
    for want in [
        "simd",
        "cores",
        "ram",
        "locked memory",
        "io_uring",
        "mpi",
        "cuda driver",
        "nccl",
    ] {
        assert!(out.contains(want), "missing `{want}` in\n{out}");
    }
    for l in out.lines().filter(|l| l.starts_with("[--]")) {
        assert!(l.len() > 40, "a missing capability without a reason: {l}");
    }
}

/// A LoRA run of the 7B (r 16 on every linear layer, bf16 base, activation checkpointing)
/// fits a 40 GB card at stage 0 without offload: the frozen base has no gradient or
/// optimizer bytes; the same run training everything does not fit.
#[test]
fn estimate_prices_a_lora_run_with_the_base_frozen() {
    let dir = std::env::temp_dir().join(format!("fz-est-lora-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (lora, ds) = (dir.join("adapter_config.json"), dir.join("ds.json"));
    std::fs::write(
        &lora,
        r#"{"peft_type": "LORA", "r": 16, "lora_alpha": 32, "target_modules": "all-linear"}"#,
    )
    .unwrap();
    std::fs::write(
        &ds,
        r#"{"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": true},
            "zero_optimization": {"stage": 0}, "activation_checkpointing": {},
            "optimizer": {"type": "AdamW", "params": {"lr": 2e-4}}}"#,
    )
    .unwrap();
    let run = |more: &[&str]| {
        let base = [
            "estimate",
            "--model",
            "llama-7b",
            "--config",
            ds.to_str().unwrap(),
        ];
        let rest = [
            "--device",
            "cuda",
            "--seq-len",
            "2048",
            "--host-memory",
            "64GB",
            "--json",
        ];
        let (code, out, err) = ferrozero(&[&base[..], more, &rest[..]].concat());
        let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|_| panic!("{err}"));
        (code, v)
    };
    let (code, v) = run(&["--peft", lora.to_str().unwrap()]);
    assert_eq!(code, 0, "{v}");
    let dev = &v["per_rank"]["categories"]["device"];
    let (grads, optim) = (
        dev["gradients"].as_u64().unwrap(),
        dev["optimizer_state"].as_u64().unwrap(),
    );
    // About 40M adapter parameters: f32 gradients, f32 master weights and two moments.
    assert!(grads < 200 << 20 && optim < 600 << 20, "{grads} {optim}");
    assert!(
        v["per_rank"]["device_bytes"].as_u64().unwrap() < 16 << 30,
        "{v}"
    );
    assert_eq!(v["fits"], true);
    let (code, full) = run(&[]);
    assert_eq!(
        (code, &full["fits"]),
        (1, &serde_json::Value::Bool(false)),
        "{full}"
    );
    std::fs::remove_dir_all(&dir).ok();
}
