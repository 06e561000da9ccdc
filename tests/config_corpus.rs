//! The DeepSpeed-style config corpus under `tests/fixtures/configs/` through `ferrozero validate`:
//! `valid/` must pass without diagnostics, `warn/` must pass with the listed warnings, and
//! `invalid/` must fail with an error at the listed key path.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/configs")
}

/// Runs `ferrozero validate --format json` on one file: (exit code, [(severity, path)]).
fn validate(file: &Path, extra: &[&str]) -> (i32, Vec<(String, String)>) {
    let out = Command::new(env!("CARGO_BIN_EXE_ferrozero"))
        .arg("validate")
        .args(["--format", "json"])
        .args(extra)
        .arg(file)
        .output()
        .expect("run ferrozero");
    let report: Value = serde_json::from_slice(&out.stdout).expect("JSON report");
    let diags = report[0]["diagnostics"]
        .as_array()
        .expect("diagnostics")
        .iter()
        .map(|d| {
            (
                d["severity"].as_str().unwrap().to_string(),
                d["path"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    (out.status.code().expect("exit code"), diags)
}

/// Expected findings: (file under fixtures, severity, key path that must be reported).
const EXPECTED: &[(&str, &str, &str)] = &[
    // DeepSpeed's layout options of activation checkpointing are ignored with a warning.
    (
        "warn/ds_activation_ckpt.json",
        "warning",
        "activation_checkpointing.partition_activations",
    ),
    // Hugging Face's ZeRO-3 template asks to gather 16-bit weights on save: ferrozero
    // consolidates its sharded checkpoints instead, and says so.
    (
        "valid/hf_zero3_auto.json",
        "warning",
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
    ),
    // ferrozero offloads all of the optimizer state: a smaller ratio is ignored with a warning.
    (
        "warn/ds_zero3_cpu_ratio.json",
        "warning",
        "zero_optimization.offload_optimizer.ratio",
    ),
    (
        "warn/deprecated_cpu_offload.json",
        "warning",
        "zero_optimization.cpu_offload",
    ),
    (
        "warn/deprecated_gather_fp16.json",
        "warning",
        "zero_optimization.stage3_gather_fp16_weights_on_model_save",
    ),
    (
        "warn/deprecated_thread_count.json",
        "warning",
        "aio.thread_count",
    ),
    (
        "warn/untested_optimizer_flag.json",
        "warning",
        "zero_allow_untested_optimizer",
    ),
    ("warn/wandb_csv_monitor.json", "warning", "wandb"),
    ("warn/zero_bool_form.json", "warning", "zero_optimization"),
    (
        "warn/template_number_checkpoints_false.json",
        "warning",
        "activation_checkpointing.number_checkpoints",
    ),
    (
        "invalid/batch_not_divisible.json",
        "error",
        "train_batch_size",
    ),
    (
        "invalid/compression_training.json",
        "error",
        "compression_training",
    ),
    ("invalid/fp16_and_bf16.json", "error", "bf16.enabled"),
    // DeepSpeed counts global steps from 1: a profile at step 0 would never be taken.
    (
        "invalid/flops_profiler_step_zero.json",
        "error",
        "flops_profiler.profile_step",
    ),
    ("invalid/loss_scale_range.json", "error", "fp16.hysteresis"),
    (
        "invalid/max_grad_norm_in_optimizer.json",
        "error",
        "optimizer.params.max_grad_norm",
    ),
    (
        "invalid/nvme_without_path.json",
        "error",
        "zero_optimization.offload_optimizer.device",
    ),
    (
        "invalid/offload_param_stage2.json",
        "error",
        "zero_optimization.offload_param.device",
    ),
    (
        "invalid/old_and_new_together.json",
        "error",
        "zero_optimization.stage3_gather_fp16_weights_on_model_save",
    ),
    ("invalid/onebit_adam.json", "error", "optimizer.type"),
    // DeepSpeed's FusedLamb raises on AMSGrad too.
    (
        "invalid/lamb_amsgrad.json",
        "error",
        "optimizer.params.amsgrad",
    ),
    (
        "invalid/ratio_below_stage3.json",
        "error",
        "zero_optimization.offload_optimizer.ratio",
    ),
    (
        "invalid/string_numbers.json",
        "error",
        "wall_clock_breakdown",
    ),
    (
        "invalid/toml_typo_section.toml",
        "error",
        "zero_optimisation",
    ),
    ("invalid/trailing_comma.json", "error", ""),
    (
        "invalid/typo_nvme_path.json",
        "error",
        "zero_optimization.offload_param.nvme_pth",
    ),
    ("invalid/typo_top_level.json", "error", "gradient_clippin"),
    (
        "invalid/warmup_longer_than_total.json",
        "error",
        "scheduler.params.warmup_num_steps",
    ),
];

#[test]
fn corpus_has_the_expected_outcome_for_every_file() {
    let mut seen = 0;
    for group in ["valid", "warn", "invalid"] {
        let mut files: Vec<_> = std::fs::read_dir(fixtures().join(group))
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        files.sort();
        for file in files {
            seen += 1;
            let (code, diags) = validate(&file, &[]);
            let name = format!("{group}/{}", file.file_name().unwrap().to_string_lossy());
            let expected_code = if group == "invalid" { 1 } else { 0 };
            assert_eq!(code, expected_code, "{name}: {diags:?}");
            match EXPECTED.iter().find(|(f, ..)| *f == name) {
                Some((_, sev, path)) => assert!(
                    diags.iter().any(|(s, p)| s == sev && p == path),
                    "{name}: expected a {sev} at `{path}`, got {diags:?}"
                ),
                None => assert!(
                    group == "valid" && diags.is_empty(),
                    "{name}: no expectation listed, got {diags:?}"
                ),
            }
        }
    }
    assert!(seen >= 30, "the corpus has only {seen} configs");
}

#[test]
fn world_size_enables_the_batch_rule() {
    let file = fixtures().join("valid/ds_zero2_fp16.json");
    assert_eq!(validate(&file, &["--world-size", "4"]).0, 0);
    let (code, diags) = validate(&file, &["--world-size", "3"]);
    assert_eq!(code, 1);
    assert_eq!(
        diags,
        vec![("error".to_string(), "train_batch_size".to_string())]
    );
}
