//! `ferrozero validate` on 1 MB configs answers in well under a second: a valid one (a real
//! config padded with comments and a long table of monitor settings), and invalid ones with
//! tens of thousands of errors, indented and minified onto one line.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

const MB: usize = 1 << 20;

fn write(name: &str, text: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("config_perf");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// Runs validate and returns (exit code, wall time).
fn time_validate(path: &Path, format: &str) -> (i32, Duration) {
    let start = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_ferrozero"))
        .args(["validate", "--format", format])
        .arg(path)
        .output()
        .unwrap();
    (out.status.code().unwrap(), start.elapsed())
}

fn valid_toml() -> String {
    let mut s = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/zero3_offload_nvme.toml"),
    )
    .unwrap();
    // An ignored section, whose contents are not checked: room for padding keys.
    s.push_str("\n[wandb]\n");
    let mut i = 0;
    while s.len() < MB {
        s.push_str(&format!("# padding comment line {i} explaining a setting at length, as generated configs do\nsetting_{i} = \"value {i}\"\n"));
        i += 1;
    }
    s
}

fn invalid_json() -> String {
    let mut s =
        String::from("{\n  \"train_batch_size\": 8,\n  \"zero_optimization\": {\n    \"stage\": 3");
    let mut i = 0;
    while s.len() < MB {
        s.push_str(&format!(",\n    \"stage3_unknown_key_{i}\": {i}"));
        i += 1;
    }
    s.push_str("\n  }\n}\n");
    s
}

/// DeepSpeed configs are often written by `json.dumps` without indentation: one long line.
fn invalid_minified_json() -> String {
    let mut s = String::from("{\"train_batch_size\":8,\"zero_optimization\":{\"stage\":3");
    let mut i = 0;
    while s.len() < MB {
        s.push_str(&format!(",\"stage3_unknown_key_{i}\":{i}"));
        i += 1;
    }
    s.push_str("}}");
    s
}

#[test]
fn one_megabyte_configs_validate_in_well_under_a_second() {
    let valid = write("big_valid.toml", &valid_toml());
    let invalid = write("big_invalid.json", &invalid_json());
    let minified = write("big_minified.json", &invalid_minified_json());
    for (path, expected) in [(&valid, 0), (&invalid, 1), (&minified, 1)] {
        for format in ["human", "json"] {
            let (code, elapsed) = time_validate(path, format);
            let size = std::fs::metadata(path).unwrap().len();
            println!(
                "validate --format {format} {} ({size} bytes): {elapsed:?}",
                path.display()
            );
            assert_eq!(code, expected);
            assert!(
                elapsed < Duration::from_secs(1),
                "{elapsed:?} for {size} bytes"
            );
        }
    }
}
