//! The main job runs end to end at a small size: trains, checkpoints, resumes from the
//! checkpoint in a new process, and reports held-out accuracy.

use std::path::PathBuf;
use std::process::Command;

/// `target/<profile>/examples/train_gpt`, built by `cargo test` next to this test binary.
fn example() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?.parent()?;
    let p = dir.join("examples").join("train_gpt");
    p.exists().then_some(p)
}

fn run(args: &[&str]) -> String {
    let exe = example().expect("cargo test builds examples/train_gpt next to the tests");
    let out = Command::new(exe)
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "train_gpt {args:?} failed:\n{text}");
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
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn bad_config_is_a_clear_error() {
    let exe = example().expect("example built");
    let out = Command::new(exe)
        .args(["--config", "does/not/exist.toml", "--steps", "1"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("does/not/exist.toml"), "{err}");
}
