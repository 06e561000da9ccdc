//! The main job runs end to end at a small size: trains, checkpoints, resumes from the
//! checkpoint in a new process, and reports held-out accuracy.

mod train_common;
use train_common::{run_output, train_gpt};

use std::process::Command;

fn run(args: &[&str]) -> String {
    let exe = train_gpt();
    let (ok, text) = run_output(
        Command::new(exe)
            .args(args)
            .current_dir(env!("CARGO_MANIFEST_DIR")),
    );
    assert!(ok, "train_gpt {args:?} failed:\n{text}");
    text
}

#[test]
fn trains_checkpoints_and_resumes() {
    let dir = std::env::temp_dir().join(format!("fz-smoke-{}", std::process::id()));
    let d = dir.to_str().unwrap();
    let common = [
        "--digits",
        "2",
        "--eval-rows",
        "64",
        "--no-progress",
        "--save",
        d,
    ];
    let svg = dir.join("memory.svg");
    let first = run(&[
        &[
            "--steps",
            "6",
            "--save-every",
            "3",
            "--memory-timeline",
            svg.to_str().unwrap(),
        ][..],
        &common,
    ]
    .concat());
    assert!(first.contains("heldout_accuracy="), "{first}");
    let chart = std::fs::read_to_string(&svg).unwrap();
    assert!(
        chart.starts_with("<svg") && chart.contains("Parameters"),
        "{chart}"
    );
    assert!(dir.join("latest").exists());
    // A new process continues from step 6 to 10, at another world size.
    let second = run(&[
        &["--steps", "10", "--resume", d, "--ranks", "1"][..],
        &common,
    ]
    .concat());
    assert!(second.contains("at step 6"), "{second}");
    assert!(second.contains("heldout_accuracy="), "{second}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn token_files_shuffling_and_init_from_consolidated_weights() {
    let dir = std::env::temp_dir().join(format!("fz-smoke-data-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // Little-endian u16 ids below the tiny preset's vocabulary of 64.
    let tokens: Vec<u8> = (0..4096u16)
        .flat_map(|i| ((i * 7 + i / 5) % 64).to_le_bytes())
        .collect();
    let data = dir.join("tokens.bin");
    std::fs::write(&data, tokens).unwrap();
    let ck = dir.join("ck");
    let base = [
        "--model-config",
        "tiny",
        "--data",
        data.to_str().unwrap(),
        "--seq-len",
        "16",
        "--no-progress",
    ];
    run(&[
        &base[..],
        &["--steps", "3", "--shuffle", "--save", ck.to_str().unwrap()],
    ]
    .concat());
    // Consolidate into Hugging Face-named weights and start a new run from them.
    let bin = env!("CARGO_BIN_EXE_ferrozero");
    let weights = dir.join("model.safetensors");
    let out = Command::new(bin)
        .args([
            "checkpoint",
            "consolidate",
            ck.to_str().unwrap(),
            "-o",
            weights.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = run(&[
        &base[..],
        &["--steps", "1", "--init", weights.to_str().unwrap()],
    ]
    .concat());
    assert!(text.contains("trained 1 steps"), "{text}");

    // The same checkpoint as a sharded model directory (a run from a preset has no
    // config.json to carry: a warning says so), and a run from that directory.
    let model_dir = dir.join("model");
    let out = Command::new(bin)
        .args(["checkpoint", "consolidate", ck.to_str().unwrap(), "-o"])
        .args([model_dir.to_str().unwrap(), "--max-shard-size", "20kB"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("warning: the checkpoint carries no config.json"),
        "{err}"
    );
    // An index is written only for more than one shard.
    assert!(model_dir.join("model.safetensors.index.json").is_file());
    let text = run(&[
        &base[..],
        &["--steps", "1", "--init", model_dir.to_str().unwrap()],
    ]
    .concat());
    assert!(text.contains("trained 1 steps"), "{text}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn bad_config_is_a_clear_error() {
    let exe = train_gpt();
    let out = Command::new(exe)
        .args(["--config", "does/not/exist.toml", "--steps", "1"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("does/not/exist.toml"), "{err}");
}

/// The main job on the CUDA backend, with the device emulated on the CPU (CI has no GPU): it
/// trains, its first loss is the CPU's (the same model and batch before any update), its
/// per-step losses stay within f32 reassociation of the CPU's, and every step line counts the
/// device's host syncs and kernel launches (null on the CPU).
#[cfg(feature = "cuda")]
#[test]
fn trains_on_the_emulated_gpu_like_the_cpu() {
    let exe = train_gpt();
    let dir = std::env::temp_dir().join(format!("fz-smoke-gpu-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let losses = |device: &str| -> Vec<f64> {
        let m = dir.join(format!("{device}.jsonl"));
        let args = [
            "--device",
            device,
            "--digits",
            "2",
            "--steps",
            "4",
            "--eval-rows",
            "16",
            "--no-progress",
            "--ranks",
            "1",
            "--metrics",
            m.to_str().unwrap(),
        ];
        let out = Command::new(&exe)
            .args(args)
            .env("FERROZERO_CUDA_EMULATOR", "1")
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "train_gpt --device {device} failed:\n{text}"
        );
        let lines: Vec<serde_json::Value> = std::fs::read_to_string(&m)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        for l in &lines {
            // The driver layer counts the emulated device's work; the CPU has none to count.
            for key in ["host_syncs_per_step", "kernel_launches_per_step"] {
                let counted = l[key].as_u64().is_some_and(|n| n > 0);
                assert_eq!(counted, device == "cuda", "{device}: {key} in {l}");
            }
        }
        lines.iter().map(|l| l["loss"].as_f64().unwrap()).collect()
    };
    let (gpu, cpu) = (losses("cuda"), losses("cpu"));
    assert_eq!(gpu.len(), 4);
    assert!(
        (gpu[0] - cpu[0]).abs() <= 1e-6 * cpu[0],
        "first loss {gpu:?} vs {cpu:?}"
    );
    for (g, c) in gpu.iter().zip(&cpu) {
        assert!((g - c).abs() <= 1e-4 * c, "losses {gpu:?} vs CPU {cpu:?}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// `--device-memory-limit`: too small, the run is refused before the first step with the
/// named error and the estimator's figures; roomy, every step's metrics carry the cap and a
/// device peak at or under it.
#[test]
fn device_memory_limit_flag_refuses_or_holds() {
    let exe = train_gpt();
    let out = Command::new(&exe)
        .args([
            "--steps",
            "2",
            "--no-progress",
            "--device-memory-limit",
            "64KiB",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a 64 KiB cap must refuse:\n{err}");
    assert!(
        err.contains("device memory") && err.contains("estimator"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    let dir = std::env::temp_dir().join(format!("fz-smoke-cap-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let metrics = dir.join("m.jsonl");
    let cap: u64 = 256 << 20;
    run(&[
        "--steps",
        "3",
        "--no-progress",
        "--eval-rows",
        "16",
        "--device-memory-limit",
        "256MiB",
        "--metrics",
        metrics.to_str().unwrap(),
    ]);
    let lines = std::fs::read_to_string(&metrics).unwrap();
    assert_eq!(lines.lines().count(), 3, "{lines}");
    for l in lines.lines() {
        let v: serde_json::Value = serde_json::from_str(l).unwrap();
        assert_eq!(v["device_memory_limit"].as_u64(), Some(cap), "{l}");
        let peak = v["peak_device_bytes"].as_u64().unwrap();
        assert!(peak > 0 && peak <= cap, "{l}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn runs_outside_the_repository_on_the_built_in_config() {
    let dir = std::env::temp_dir().join(format!("fz-smoke-cwd-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = Command::new(train_gpt())
        .args([
            "--digits",
            "2",
            "--steps",
            "2",
            "--eval-rows",
            "16",
            "--no-progress",
        ])
        .current_dir(&dir)
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("heldout_accuracy="), "{text}");
    std::fs::remove_dir_all(&dir).ok();
}
