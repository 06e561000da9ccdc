//! The engine's state stays in owned parts, as a test of the text: `Engine` holds at most
//! [`MAX_FIELDS`] fields, none of them an `Option` (a feature that is off is a part that does
//! nothing, not a missing field), and its methods live in at most [`MAX_IMPL_FILES`] files
//! (the rest are methods of the parts, which take the other parts they need). A breach fails
//! here with its file and line.

mod tidy_common;

use std::path::{Path, PathBuf};

use tidy_common::rust_files;

/// The most fields `Engine` may have.
const MAX_FIELDS: usize = 12;

/// The most files that may hold an `impl Engine` block.
const MAX_IMPL_FILES: usize = 4;

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// `Engine`'s fields: (line number, the field's line), from `pub struct Engine {` to its `}`.
fn engine_fields() -> (PathBuf, Vec<(usize, String)>) {
    let file = src().join("engine/core.rs");
    let text = std::fs::read_to_string(&file).expect("engine/core.rs reads");
    let lines: Vec<&str> = text.lines().collect();
    let start = lines
        .iter()
        .position(|l| l.starts_with("pub struct Engine {"))
        .expect("engine/core.rs declares `pub struct Engine {`");
    let fields = lines[start + 1..]
        .iter()
        .enumerate()
        .take_while(|(_, l)| !l.starts_with('}'))
        .filter(|(_, l)| {
            let code = l.split("//").next().unwrap_or_default().trim();
            !code.is_empty() && !code.starts_with('#') && code.contains(':')
        })
        .map(|(i, l)| (start + 2 + i, l.trim().to_string()))
        .collect();
    (file, fields)
}

#[test]
fn the_engine_has_few_fields_and_no_option() {
    let (file, fields) = engine_fields();
    let at = |n: usize| format!("{}:{n}", file.display());
    assert!(
        fields.len() <= MAX_FIELDS,
        "`Engine` has {} fields, at most {MAX_FIELDS}: group them into parts\n{}",
        fields.len(),
        fields
            .iter()
            .map(|(n, l)| format!("{}: {l}", at(*n)))
            .collect::<Vec<_>>()
            .join("\n")
    );
    let options: Vec<String> = fields
        .iter()
        .filter(|(_, l)| {
            l.split_once(':')
                .is_some_and(|(_, ty)| ty.contains("Option<"))
        })
        .map(|(n, l)| format!("{}: {l}", at(*n)))
        .collect();
    assert!(
        options.is_empty(),
        "`Engine` fields that are an `Option` (make a part that does nothing when off):\n{}",
        options.join("\n")
    );
}

#[test]
fn impl_engine_lives_in_few_files() {
    let mut files = Vec::new();
    rust_files(&src(), &mut files);
    let mut found = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).expect("a source file reads");
        for (i, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or_default();
            let rest = code.trim_start().strip_prefix("impl Engine");
            if rest.is_some_and(|r| r.trim_start().starts_with('{')) {
                let rel = file.strip_prefix(src()).unwrap_or(&file).display();
                found.push(format!("src/{rel}:{}", i + 1));
            }
        }
    }
    let mut in_files: Vec<&str> = found
        .iter()
        .map(|f| f.rsplit_once(':').map_or(f.as_str(), |(p, _)| p))
        .collect();
    in_files.dedup();
    assert!(
        in_files.len() <= MAX_IMPL_FILES,
        "`impl Engine` in {} files, at most {MAX_IMPL_FILES}: make the methods a part's\n{}",
        in_files.len(),
        found.join("\n")
    );
}
