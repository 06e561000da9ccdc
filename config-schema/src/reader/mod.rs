//! Walking the spanned tree: typed getters that record a diagnostic instead of stopping, and a
//! table reader that knows which keys were asked for, so every leftover key is reported with
//! its nearest valid spelling.

mod homes;
mod table;
mod values;

use std::collections::HashMap;
use std::ops::Range;

use crate::diagnostic::{Diagnostic, DiagnosticKind, LineIndex, Severity};
use crate::parse::Node;

pub(crate) use table::{off, Support, TableReader};
use values::quoted_hint;
pub(crate) use values::{auto_or, nearest, to_bool, to_choice, to_f64, to_str, to_u32, to_uint};

/// Collects diagnostics while the tree is walked.
pub(crate) struct Cx<'s> {
    index: LineIndex<'s>,
    pub diags: Vec<Diagnostic>,
    /// Value span of every key read, by canonical dotted path, for cross-field rules.
    pub spans: HashMap<String, Range<usize>>,
    /// Edit-distance suggestions left to compute: each costs O(len²) per candidate, and a
    /// generated file with tens of thousands of bad keys must still be answered at once.
    suggestions_left: usize,
}

/// Arguments of one diagnostic; built with struct syntax at call sites to keep them readable.
pub(crate) struct Report<'a> {
    pub kind: DiagnosticKind,
    pub path: &'a str,
    pub span: &'a Range<usize>,
    pub message: String,
    pub help: Option<String>,
}

impl<'s> Cx<'s> {
    pub(crate) fn new(src: &'s str, origin: &'s str) -> Self {
        Cx {
            index: LineIndex::new(src, origin),
            diags: Vec::new(),
            spans: HashMap::new(),
            suggestions_left: 1000,
        }
    }

    fn push(&mut self, severity: Severity, r: Report<'_>) -> &mut Diagnostic {
        self.diags.push(Diagnostic {
            severity,
            kind: r.kind,
            path: r.path.to_string(),
            message: r.message,
            help: r.help,
            notes: Vec::new(),
            location: Some(self.index.locate(r.span)),
            related: Vec::new(),
        });
        self.diags.last_mut().expect("just pushed")
    }

    /// Records an error.
    pub(crate) fn error(&mut self, r: Report<'_>) -> &mut Diagnostic {
        self.push(Severity::Error, r)
    }

    /// Records a warning.
    pub(crate) fn warn(&mut self, r: Report<'_>) -> &mut Diagnostic {
        self.push(Severity::Warning, r)
    }

    /// Warns that the key at `path` (spanning `span`) is accepted but ignored, saying `why`.
    pub(crate) fn ignored(&mut self, path: &str, span: &Range<usize>, why: impl Into<String>) {
        self.warn(Report {
            kind: DiagnosticKind::Unsupported,
            path,
            span,
            message: "not supported by ferrozero; ignored".into(),
            help: Some(why.into()),
        });
    }

    /// [`Cx::ignored`] for a key read earlier, when the config set it.
    pub(crate) fn ignored_if_set(&mut self, path: &str, why: impl Into<String>) {
        if let Some(span) = self.span_of(path) {
            self.ignored(path, &span, why);
        }
    }

    /// The value span of a key read earlier, by canonical dotted path.
    pub(crate) fn span_of(&self, path: &str) -> Option<Range<usize>> {
        self.spans.get(path).cloned()
    }

    /// Adds a secondary location to the last diagnostic.
    pub(crate) fn relate(&mut self, span: &Range<usize>, label: &str) {
        let loc = self.index.locate(span);
        if let Some(d) = self.diags.last_mut() {
            d.related.push((loc, label.to_string()));
        }
    }

    pub(crate) fn wrong_type(&mut self, path: &str, node: &Node, expected: &str) {
        let help = quoted_hint(node, expected);
        self.error(Report {
            kind: DiagnosticKind::WrongType,
            path,
            span: &node.span,
            message: format!("expected {expected}, found {}", node.kind.type_name()),
            help,
        });
    }

    pub(crate) fn invalid(
        &mut self,
        path: &str,
        node: &Node,
        message: String,
        help: Option<String>,
    ) {
        self.error(Report {
            kind: DiagnosticKind::InvalidValue,
            path,
            span: &node.span,
            message,
            help,
        });
    }
}
