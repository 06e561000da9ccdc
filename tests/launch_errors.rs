//! `ferrozero launch` running `train_gpt` ranks that fail: the launcher's verdict names the
//! failing rank and quotes its own error (the file and the cause), so the user reads why
//! without searching the interleaved output. Needs the examples built
//! (`cargo build --release --features cuda --example train_gpt --bin ferrozero`).

use std::path::{Path, PathBuf};
use std::process::Command;

/// `target/<profile>/examples/train_gpt`, next to this test binary.
fn train_gpt() -> PathBuf {
    let dir = std::env::current_exe().unwrap();
    let p = dir.parent().unwrap().parent().unwrap();
    p.join("examples").join("train_gpt")
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Launches two `train_gpt` ranks with `args`; returns the launcher's exit code and stderr.
fn launch(args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_ferrozero"))
        .args(["launch", "--nproc-per-node", "2", "--no-cpu-bind"])
        .args(["--master-port", &free_port().to_string(), "--"])
        .arg(train_gpt())
        .args(args)
        .args(["--steps", "1", "--no-progress"])
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

/// The verdict block: the launcher's "rank N failed" line and the rank's quoted lines.
fn verdict(stderr: &str) -> String {
    let start = stderr
        .find("ferrozero launch: rank ")
        .unwrap_or_else(|| panic!("no verdict in:\n{stderr}"));
    stderr[start..].to_string()
}

fn assert_names(stderr: &str, file: &Path, cause: &str) {
    let v = verdict(stderr);
    let rank = v["ferrozero launch: rank ".len()..]
        .split(' ')
        .next()
        .unwrap();
    assert!(rank == "0" || rank == "1", "{v}");
    assert!(v.contains("failed (exit status: 1)"), "{v}");
    let said = format!("rank {rank} said:\n    error: {}: {cause}", file.display());
    assert!(v.contains(&said), "missing {said:?} in:\n{v}");
}

#[test]
fn an_unreadable_init_directory_is_named_with_the_rank_and_the_cause() {
    let missing = std::env::temp_dir().join(format!("fz-no-such-model-{}", std::process::id()));
    let (code, stderr) = launch(&["--init", missing.to_str().unwrap()]);
    assert_eq!(code, Some(1), "{stderr}");
    assert_names(&stderr, &missing, "No such file or directory");
}

#[test]
fn a_bad_data_file_is_named_with_the_rank_and_the_cause() {
    let bad = std::env::temp_dir().join(format!("fz-bad-tokens-{}.bin", std::process::id()));
    std::fs::write(&bad, b"garbage!").unwrap();
    let (code, stderr) = launch(&["--data", bad.to_str().unwrap()]);
    std::fs::remove_file(&bad).unwrap();
    assert_eq!(code, Some(1), "{stderr}");
    assert_names(
        &stderr,
        &bad,
        "token 24935 at byte offset 0 is not below the model's vocabulary size",
    );
}
