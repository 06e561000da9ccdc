//! The crate's error type: an unreadable file, an unknown format, or a config with diagnostics
//! (all of them, not only the first).

use std::fmt;
use std::path::PathBuf;

use crate::diagnostic::{Diagnostic, RenderStyle};

/// Rendering more than this many diagnostics helps nobody; the count of the rest is printed.
const RENDER_LIMIT: usize = 100;

/// Why a config could not be loaded or resolved.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The file could not be read (the CLI exits with 2).
    #[error("cannot read `{}`: {source}", path.display())]
    Unreadable {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file name does not say TOML or JSON (the CLI exits with 2).
    #[error("`{}`: unknown config format; expected a `.toml` or `.json` file", path.display())]
    UnknownFormat {
        /// The file.
        path: PathBuf,
    },
    /// The config was read and is invalid; every diagnostic found, warnings included.
    #[error("{}", render_all(diagnostics, origin, RenderStyle::Plain))]
    Invalid {
        /// The file name or other origin.
        origin: String,
        /// Errors and warnings, in source order of discovery.
        diagnostics: Vec<Diagnostic>,
    },
    /// A JSON Schema given to the config reference generator has a shape it cannot document
    /// (a dangling or cyclic `$ref`, a non-local reference, a recursive table, ...).
    #[error("cannot document the JSON Schema at `{key_path}`: {reason}")]
    Schema {
        /// The key path being documented (empty for the root).
        key_path: String,
        /// What is wrong there.
        reason: String,
    },
}

impl LoadError {
    /// The diagnostics of an invalid config (empty for I/O and format errors).
    pub fn diagnostics(&self) -> &[Diagnostic] {
        match self {
            LoadError::Invalid { diagnostics, .. } => diagnostics,
            _ => &[],
        }
    }

    /// The errors only.
    pub fn errors(&self) -> impl Iterator<Item = &Diagnostic> {
        self.diagnostics().iter().filter(|d| d.is_error())
    }

    /// True when the file itself could not be read as a config (CLI exit code 2, not 1).
    pub fn is_unreadable(&self) -> bool {
        !matches!(self, LoadError::Invalid { .. })
    }

    /// Renders the error, coloured or not.
    pub fn render(&self, style: RenderStyle) -> String {
        match self {
            LoadError::Invalid {
                origin,
                diagnostics,
            } => render_all(diagnostics, origin, style),
            other => format!("error: {other}\n"),
        }
    }
}

/// Renders diagnostics rustc-style, followed by a summary line.
pub fn render_all(diagnostics: &[Diagnostic], origin: &str, style: RenderStyle) -> String {
    let mut out = String::new();
    for d in diagnostics.iter().take(RENDER_LIMIT) {
        out.push_str(&d.render(style));
        out.push_str("\n\n");
    }
    if diagnostics.len() > RENDER_LIMIT {
        out.push_str(&format!(
            "... and {} more\n",
            diagnostics.len() - RENDER_LIMIT
        ));
    }
    let errors = diagnostics.iter().filter(|d| d.is_error()).count();
    let warnings = diagnostics.len() - errors;
    out.push_str(&summary(origin, errors, warnings));
    out
}

fn summary(origin: &str, errors: usize, warnings: usize) -> String {
    let plural = |n: usize, word: &str| format!("{n} {word}{}", if n == 1 { "" } else { "s" });
    if errors == 0 {
        format!("{origin}: valid ({})", plural(warnings, "warning"))
    } else {
        format!(
            "{origin}: invalid ({}, {})",
            plural(errors, "error"),
            plural(warnings, "warning")
        )
    }
}

impl fmt::Display for crate::diagnostic::Severity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            crate::diagnostic::Severity::Error => "error",
            crate::diagnostic::Severity::Warning => "warning",
        })
    }
}
