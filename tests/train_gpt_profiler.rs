//! `flops_profiler` and `mfu` through the main job: the profile table is printed at
//! `profile_step` only and names every unit, the step's metric line carries the same figures,
//! and every step line and the benchmark line carry `mfu` when a peak is known (`null` on
//! the CPU without `--peak-tflops`).

mod train_common;
use train_common::{run_output, train_gpt};

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

/// Four steps of the addition model on the CPU; (success, stdout and stderr, metric lines).
fn run(dir: &Path, config: &Value, extra: &[&str]) -> (bool, String, Vec<Value>) {
    let path = dir.join("ds_config.json");
    std::fs::write(&path, config.to_string()).unwrap();
    let metrics = dir.join("metrics.jsonl");
    let _ = std::fs::remove_file(&metrics);
    let (ok, text) = run_output(
        Command::new(train_gpt())
            .args(["--config", path.to_str().unwrap()])
            .args(["--steps", "4", "--digits", "2", "--eval-rows", "16"])
            .args(["--no-progress", "--device", "cpu", "--bench-json"])
            .args(["--metrics", metrics.to_str().unwrap()])
            .args(extra)
            .current_dir(env!("CARGO_MANIFEST_DIR")),
    );
    let lines = std::fs::read_to_string(&metrics)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .filter(|v: &Value| v.get("loss").is_some())
        .collect();
    (ok, text, lines)
}

/// A directory of this test's own, removed when it ends, pass or fail.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let p = std::env::temp_dir().join(format!("fz-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn bench_line(text: &str) -> Value {
    let line = text
        .lines()
        .find(|l| l.contains("\"bench\""))
        .unwrap_or_else(|| panic!("no benchmark line:\n{text}"));
    serde_json::from_str(line).unwrap()
}

fn config(profiler: Value) -> Value {
    serde_json::json!({
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
        "flops_profiler": profiler
    })
}

#[test]
fn the_table_at_profile_step_and_mfu_in_every_line() {
    let dir = TempDir::new("profile-table");
    let cfg = config(serde_json::json!({"enabled": true, "profile_step": 2, "top_modules": 2}));
    let (ok, text, lines) = run(dir.path(), &cfg, &["--peak-tflops", "0.5"]);
    assert!(ok, "{text}");
    assert_eq!(text.matches("Profile Summary at step").count(), 1, "{text}");
    assert!(text.contains("Profile Summary at step 2:"), "{text}");
    for unit in ["embed", "h.0", "h.1", "h.2", "head", "optimizer", "other"] {
        assert!(text.contains(&format!("\n  {unit} ")), "{unit}:\n{text}");
    }
    assert_eq!(lines.len(), 4, "{lines:?}");
    for l in &lines {
        let mfu = l["mfu"].as_f64().unwrap_or_else(|| panic!("no mfu: {l}"));
        assert!(mfu > 0.0 && mfu < 1.0, "{l}");
        assert_eq!(l.get("flops_profile").is_some(), l["step"] == 2, "{l}");
    }
    let p = &lines[1]["flops_profile"];
    assert_eq!(p["step"], 2);
    assert!(p["flops"].as_u64().unwrap() > 0, "{p}");
    let names: Vec<&str> = p["modules"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["name"].as_str().unwrap())
        .collect();
    assert_eq!(&names[..5], ["embed", "h.0", "h.1", "h.2", "head"], "{p}");
    let bench = bench_line(&text);
    assert!(bench["mfu"].as_f64().is_some_and(|m| m > 0.0), "{bench}");
}

#[test]
fn no_peak_on_the_cpu_is_a_null_mfu_and_a_disabled_profiler_prints_nothing() {
    let dir = TempDir::new("profile-off");
    let (ok, text, lines) = run(dir.path(), &config(serde_json::json!({})), &[]);
    assert!(ok, "{text}");
    assert!(!text.contains("Profile Summary"), "{text}");
    assert!(lines
        .iter()
        .all(|l| l["mfu"].is_null() && l.get("mfu").is_some()));
    assert!(lines.iter().all(|l| l.get("flops_profile").is_none()));
    assert!(bench_line(&text)["mfu"].is_null());
    // The config's peak counts with the profiler off.
    let cfg = config(serde_json::json!({"peak_tflops": 1.0}));
    let (ok, text, lines) = run(dir.path(), &cfg, &[]);
    assert!(ok, "{text}");
    assert!(
        lines.iter().all(|l| l["mfu"].as_f64().is_some()),
        "{lines:?}"
    );
}

#[test]
fn a_bad_peak_flag_or_key_is_refused_by_name() {
    let dir = TempDir::new("profile-bad");
    let (ok, text, _) = run(
        dir.path(),
        &config(serde_json::json!({})),
        &["--peak-tflops=-3"],
    );
    assert!(!ok);
    assert!(
        text.contains("--peak-tflops") && text.contains("positive"),
        "{text}"
    );
    let cfg = config(serde_json::json!({"enabled": true, "profile_step": 0}));
    let (ok, text, _) = run(dir.path(), &cfg, &[]);
    assert!(!ok);
    assert!(text.contains("flops_profiler.profile_step"), "{text}");
}
