//! The colour rule of the logs (escape codes in a log file or a CI page are noise): ANSI colour
//! only when stderr is a terminal, never with `NO_COLOR` set, and never in the JSON metrics file. `train_gpt` runs three times:
//! into pipes, and on a pseudo-terminal (util-linux `script`) with and without `NO_COLOR`.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const ESC: char = '\u{1b}';

/// `target/<profile>/examples/train_gpt`, built by `cargo test` next to this test binary.
fn example() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap().parent().unwrap();
    let p = dir.join("examples").join("train_gpt");
    assert!(
        p.exists(),
        "cargo test builds examples/train_gpt next to the tests"
    );
    p
}

fn args(metrics: &Path) -> Vec<String> {
    [
        "--digits",
        "2",
        "--steps",
        "2",
        "--eval-rows",
        "8",
        "--no-progress",
        "--metrics",
        metrics.to_str().unwrap(),
    ]
    .map(String::from)
    .to_vec()
}

fn text(out: &Output) -> String {
    let t = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "train_gpt failed:\n{t}");
    t
}

/// Every line of the metrics file is a JSON object, and none carries an escape.
fn check_metrics(path: &Path) {
    let m = std::fs::read_to_string(path).unwrap();
    assert!(!m.contains(ESC), "colour in the metrics file:\n{m:?}");
    assert!(m.lines().count() >= 2, "{m}");
    for line in m.lines() {
        let v: serde_json::Value = serde_json::from_str(line).expect("a JSON line");
        assert!(v.is_object(), "{line}");
    }
}

fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("fz-colour-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

#[test]
fn logs_into_pipes_are_plain_text() {
    let metrics = tmp("pipe.jsonl");
    let out = Command::new(example())
        .args(args(&metrics))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env_remove("NO_COLOR")
        .output()
        .unwrap();
    let t = text(&out);
    assert!(t.contains("trained 2 steps"), "{t}");
    assert!(!t.contains(ESC), "colour codes in piped output:\n{t:?}");
    check_metrics(&metrics);
}

/// Runs train_gpt on a pseudo-terminal; `None` where `script` is missing.
fn on_a_terminal(metrics: &Path, no_color: Option<&str>) -> Option<String> {
    let script = ["/usr/bin/script", "/bin/script"]
        .into_iter()
        .find(|p| Path::new(p).exists())?;
    let mut line = example().to_str().unwrap().to_string();
    for a in args(metrics) {
        line.push(' ');
        line.push_str(&a);
    }
    let mut cmd = Command::new(script);
    cmd.args(["-q", "-e", "-c", &line, "/dev/null"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env_remove("NO_COLOR")
        .env("RUST_LOG", "info");
    if let Some(v) = no_color {
        cmd.env("NO_COLOR", v);
    }
    Some(text(&cmd.output().unwrap()))
}

#[test]
fn a_terminal_gets_colour_unless_no_color_is_set() {
    let metrics = tmp("tty.jsonl");
    let Some(coloured) = on_a_terminal(&metrics, None) else {
        eprintln!("SKIPPED: util-linux `script` not found; cannot open a pseudo-terminal");
        return;
    };
    assert!(coloured.contains("trained 2 steps"), "{coloured}");
    assert!(
        coloured.contains(ESC),
        "no colour on a terminal:\n{coloured:?}"
    );
    check_metrics(&metrics);
    let metrics = tmp("tty_no_color.jsonl");
    let plain = on_a_terminal(&metrics, Some("1")).expect("script found above");
    assert!(plain.contains("trained 2 steps"), "{plain}");
    assert!(!plain.contains(ESC), "colour despite NO_COLOR:\n{plain:?}");
    check_metrics(&metrics);
}
