//! The runtime's floors, as a test of the text: a lower floor never names a higher one. Tensors
//! know no device backend (their device arm is `backend::DeviceBuf` and its views, whatever
//! backend provides them), nor anything above the backend; the backend (with the device, its
//! storage and its operations) knows nothing of layers, collectives, the engine or its
//! observers; the ledger and the step report sit below both the engine and the monitors, which
//! read them; the monitors never reach into the engine, the layers or the collectives. An
//! upward `crate::` path in code (comments and doc links aside) fails here with its file and
//! line.

mod tidy_common;

use std::path::Path;

use tidy_common::rust_files;

/// (a floor: files or folders under `src/`, the floors above it it must not name).
const FLOORS: &[(&[&str], &[&str])] = &[
    (
        &["tensor"],
        &[
            "backend::cuda",
            "nn",
            "comm",
            "engine",
            "monitor",
            "profiler",
            "ledger",
            "report",
        ],
    ),
    (
        &["backend"],
        &[
            "nn", "comm", "engine", "monitor", "profiler", "ledger", "report",
        ],
    ),
    (&["ledger.rs", "report.rs"], &["engine", "monitor", "comm"]),
    (&["monitor"], &["engine", "nn", "comm"]),
];

#[test]
fn no_floor_names_one_above_it() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut found = Vec::new();
    for (floor, above) in FLOORS {
        let mut files = Vec::new();
        for f in *floor {
            rust_files(&src.join(f), &mut files);
        }
        assert!(!files.is_empty(), "{floor:?}: no files (moved?)");
        for file in files {
            let text = std::fs::read_to_string(&file).expect("a source file reads");
            for (i, line) in text.lines().enumerate() {
                let code = line.split("//").next().unwrap_or_default();
                for a in *above {
                    if code.contains(&format!("crate::{a}::"))
                        || code.contains(&format!("crate::{a};"))
                    {
                        let rel = file.strip_prefix(&src).unwrap_or(&file).display();
                        found.push(format!("src/{rel}:{}: names `{a}`: {}", i + 1, line.trim()));
                    }
                }
            }
        }
    }
    assert!(found.is_empty(), "upward imports:\n{}", found.join("\n"));
}
