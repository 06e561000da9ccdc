//! What the `rules*` tests share: a base config and the diagnostics of a config with the
//! checks of one diagnostic's severity, kind, position and message.
#![allow(dead_code)]

use ferrozero_config::{parse, Diagnostic, DiagnosticKind, Format, Severity};

pub const BASE: &str = "train_micro_batch_size_per_gpu = 2\n";

/// All diagnostics of a TOML config (errors make parsing fail; warnings ride along).
pub fn diags(src: &str) -> Vec<Diagnostic> {
    match parse(src, Format::Toml, "t.toml") {
        Ok(l) => l.warnings,
        Err(e) => e.diagnostics().to_vec(),
    }
}

pub fn json_diags(src: &str) -> Vec<Diagnostic> {
    match parse(src, Format::Json, "t.json") {
        Ok(l) => l.warnings,
        Err(e) => e.diagnostics().to_vec(),
    }
}

/// Finds the diagnostic at `path` and checks severity, kind, position and message.
#[track_caller]
pub fn expect(
    ds: &[Diagnostic],
    sev: Severity,
    kind: DiagnosticKind,
    path: &str,
    pos: (usize, usize),
    msg: &str,
) -> Diagnostic {
    let d = ds
        .iter()
        .find(|d| d.path == path && d.kind == kind)
        .unwrap_or_else(|| panic!("no {kind:?} at `{path}` in {ds:#?}"));
    assert_eq!(d.severity, sev, "{d:#?}");
    let loc = d.location.as_ref().expect("a location");
    assert_eq!((loc.line, loc.column), pos, "{d}");
    assert!(
        d.message.contains(msg),
        "message {:?} lacks {msg:?}",
        d.message
    );
    d.clone()
}
