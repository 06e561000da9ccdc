//! "The device is a type, not a branch", as a test: no file under `src/engine` or `src/nn`
//! names the CUDA feature, matches on a device's view or storage variant, or peeks at host
//! storage, except the lines in [`ALLOWED`], each with its reason (the offload placement sites,
//! where host memory is the point). Adding such a line fails with its path and line number.

mod tidy_common;

use std::path::Path;

use tidy_common::rust_files;

/// What engine and layer code must not say: each pattern, and what it would mean.
const FORBIDDEN: &[(&str, &str)] = &[
    ("feature = \"cuda\"", "a build-feature branch"),
    ("View::Cuda", "a device-variant match"),
    ("ViewMut::Cuda", "a device-variant match"),
    ("Storage::Cuda", "a device-variant match"),
    ("View::Host", "a host-variant match"),
    ("ViewMut::Host", "a host-variant match"),
    ("Storage::Host(", "host storage built or matched by hand"),
    (".host()", "host-storage peeking"),
    (".host_mut()", "host-storage peeking"),
    (".host_f32(", "host-storage peeking"),
    (".host_f32_mut(", "host-storage peeking"),
];

/// (file under `src/`, text the line contains, why it may).
const ALLOWED: &[(&str, &str, &str)] = &[
    (
        "engine/param_swap.rs",
        "self.0.host().map(flat_bytes)",
        "the NVMe store writes the bytes of host memory (size-only storage has none)",
    ),
    (
        "engine/param_swap.rs",
        "self.0.host_mut().map(flat_bytes_mut)",
        "the NVMe store reads into the bytes of host memory (size-only storage has none)",
    ),
    (
        "engine/load_params.rs",
        "slot.write_sync(swap, crate::tensor::Storage::Host(b))",
        "an NVMe shard read back to host memory and written again (loading parameters)",
    ),
    (
        "engine/swap.rs",
        "slot.write_sync(swap, crate::tensor::Storage::Host(b))",
        "an NVMe shard read back to host memory and written again (editing parameters)",
    ),
    (
        "engine/group.rs",
        "Storage::Host(crate::tensor::FlatBuf::zeros(d, 0))",
        "an empty stand-in holds no elements, so where it lives does not matter",
    ),
    (
        "engine/checkpoint/save.rs",
        "match b.host() {",
        "checkpoint writing borrows host bytes instead of copying them (device bytes are copied)",
    ),
];

/// Every violation in `text` (the file `rel`): `rel:line: pattern (meaning)`.
fn violations(rel: &str, text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let code = line.trim_start();
        if code.starts_with("//") {
            continue;
        }
        for (pat, meaning) in FORBIDDEN {
            let allowed = ALLOWED
                .iter()
                .any(|(f, needle, _)| *f == rel && line.contains(needle));
            if line.contains(pat) && !allowed {
                out.push(format!("src/{rel}:{}: `{pat}` ({meaning})", i + 1));
            }
        }
    }
    out
}

/// (path under `src/`, text) of every engine and layer file.
fn sources() -> Vec<(String, String)> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    for d in ["engine", "nn"] {
        rust_files(&src.join(d), &mut files);
    }
    files.sort();
    files
        .into_iter()
        .map(|p| {
            let rel = p.strip_prefix(&src).expect("under src");
            let text = std::fs::read_to_string(&p).expect("readable source");
            (rel.to_string_lossy().replace('\\', "/"), text)
        })
        .collect()
}

#[test]
fn engine_and_layers_do_not_branch_on_the_device() {
    let found: Vec<String> = sources()
        .iter()
        .flat_map(|(rel, text)| violations(rel, text))
        .collect();
    assert!(
        found.is_empty(),
        "device branches in engine/nn code (make it a backend op, or add an allow-list entry \
         with its reason in tests/tidy_device_agnostic.rs):\n{}",
        found.join("\n")
    );
}

#[test]
fn every_allowed_line_still_exists() {
    let files = sources();
    for (file, needle, why) in ALLOWED {
        let text = files
            .iter()
            .find(|(rel, _)| rel == file)
            .map(|(_, t)| t)
            .unwrap_or_else(|| panic!("allow-list names src/{file}, which does not exist"));
        assert!(
            text.contains(needle),
            "allow-list entry for src/{file} ({why}) matches no line: remove it"
        );
    }
}

#[test]
fn an_added_device_branch_fails_with_its_path() {
    let text = "fn f(v: View) {\n    // View::Cuda in a comment is fine\n    \
                if let View::Cuda(c) = v {}\n    #[cfg(feature = \"cuda\")]\n}\n";
    let v = violations("engine/step.rs", text);
    assert_eq!(
        v,
        [
            "src/engine/step.rs:3: `View::Cuda` (a device-variant match)",
            "src/engine/step.rs:4: `feature = \"cuda\"` (a build-feature branch)",
        ]
    );
    // An allowed line is allowed only in its own file.
    let line = "    match b.host() {\n";
    assert!(violations("engine/checkpoint/save.rs", line).is_empty());
    assert_eq!(
        violations("nn/linear.rs", line),
        ["src/nn/linear.rs:1: `.host()` (host-storage peeking)"]
    );
}
