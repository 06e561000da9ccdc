//! Walking the spanned tree: typed getters that record a diagnostic instead of stopping, and a
//! table reader that knows which keys were asked for, so every leftover key is reported with
//! its nearest valid spelling.

use std::collections::{HashMap, HashSet};
use std::ops::Range;

use crate::diagnostic::{Diagnostic, DiagnosticKind, LineIndex, Severity};
use crate::model::AutoOr;
use crate::parse::{Entry, Kind, Node};

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

/// `"true"` or `"8"` where a boolean or number is expected: say to drop the quotes.
fn quoted_hint(node: &Node, expected: &str) -> Option<String> {
    let Kind::Str(s) = &node.kind else {
        return None;
    };
    let t = s.trim();
    let looks_right = match expected {
        "a boolean" => matches!(t, "true" | "false" | "True" | "False"),
        _ => t.parse::<f64>().is_ok(),
    };
    looks_right.then(|| {
        format!(
            "remove the quotes: write {} instead of \"{s}\"",
            t.to_lowercase()
        )
    })
}

/// Reads a boolean.
pub(crate) fn to_bool(cx: &mut Cx<'_>, path: &str, node: &Node) -> Option<bool> {
    match node.kind {
        Kind::Bool(b) => Some(b),
        _ => {
            cx.wrong_type(path, node, "a boolean");
            None
        }
    }
}

/// Reads a non-negative integer; integral floats (`5e8` in DeepSpeed JSON) are accepted.
pub(crate) fn to_uint(cx: &mut Cx<'_>, path: &str, node: &Node) -> Option<u64> {
    match node.kind {
        Kind::Int(n) if n >= 0 => Some(n as u64),
        Kind::Int(n) => {
            cx.invalid(path, node, format!("must not be negative, found {n}"), None);
            None
        }
        Kind::Float(f) if f.fract() == 0.0 && (0.0..1.8e19).contains(&f) => Some(f as u64),
        Kind::Float(f) if f.is_finite() && f.fract() == 0.0 && f < 0.0 => {
            cx.invalid(path, node, format!("must not be negative, found {f}"), None);
            None
        }
        Kind::Float(f) => {
            let help =
                Some("integer keys accept only whole numbers such as 500000000 or 5e8".into());
            cx.invalid(
                path,
                node,
                format!("expected a whole number, found {f}"),
                help,
            );
            None
        }
        _ => {
            cx.wrong_type(path, node, "an integer");
            None
        }
    }
}

/// Reads a finite number.
pub(crate) fn to_f64(cx: &mut Cx<'_>, path: &str, node: &Node) -> Option<f64> {
    match node.kind {
        Kind::Int(n) => Some(n as f64),
        Kind::Float(f) if f.is_finite() => Some(f),
        Kind::Float(f) => {
            cx.invalid(
                path,
                node,
                format!("expected a finite number, found {f}"),
                None,
            );
            None
        }
        _ => {
            cx.wrong_type(path, node, "a number");
            None
        }
    }
}

/// Reads a string.
pub(crate) fn to_str<'n>(cx: &mut Cx<'_>, path: &str, node: &'n Node) -> Option<&'n str> {
    match &node.kind {
        Kind::Str(s) => Some(s),
        _ => {
            cx.wrong_type(path, node, "a string");
            None
        }
    }
}

/// Reads `"auto"` or a value through `read`.
pub(crate) fn auto_or<T>(
    cx: &mut Cx<'_>,
    path: &str,
    node: &Node,
    read: impl FnOnce(&mut Cx<'_>, &str, &Node) -> Option<T>,
) -> Option<AutoOr<T>> {
    match &node.kind {
        Kind::Str(s) if s == "auto" => Some(AutoOr::Auto),
        Kind::Str(s) if s.eq_ignore_ascii_case("auto") => {
            let help = Some("write \"auto\" in lower case".to_string());
            cx.invalid(path, node, format!("unknown value \"{s}\""), help);
            None
        }
        _ => read(cx, path, node).map(AutoOr::Value),
    }
}

/// Reads one of a fixed set of strings (case-insensitively, as DeepSpeed does for types).
pub(crate) fn to_choice<T: Copy>(
    cx: &mut Cx<'_>,
    path: &str,
    node: &Node,
    choices: &[(&str, T)],
) -> Option<T> {
    let s = to_str(cx, path, node)?;
    if let Some((_, v)) = choices
        .iter()
        .find(|(name, _)| name.eq_ignore_ascii_case(s))
    {
        return Some(*v);
    }
    let names: Vec<&str> = choices.iter().map(|(n, _)| *n).collect();
    let help = match nearest(s, &names) {
        Some(n) => format!("did you mean \"{n}\"?"),
        None => format!("valid values: {}", quoted_list(&names)),
    };
    cx.invalid(path, node, format!("unknown value \"{s}\""), Some(help));
    None
}

/// The closest candidate by edit distance, if it is close enough to be a plausible typo.
pub(crate) fn nearest<'a>(word: &str, candidates: &[&'a str]) -> Option<&'a str> {
    let lower = word.to_ascii_lowercase();
    candidates
        .iter()
        .map(|c| (strsim::levenshtein(&lower, c), *c))
        .filter(|(d, c)| *d <= (c.len().max(word.len()) / 3).max(2))
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c)
}

fn quoted_list(names: &[&str]) -> String {
    names
        .iter()
        .map(|n| format!("\"{n}\""))
        .collect::<Vec<_>>()
        .join(", ")
}

/// How ferrozero treats a DeepSpeed key it does not implement.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Support {
    /// Ignoring it cannot change training results: warn.
    Ignored(&'static str),
    /// Ignoring it would change results: refuse.
    Refused(&'static str),
}

/// Reads one table, remembering which keys were consumed.
pub(crate) struct TableReader<'n> {
    pub path: String,
    pub span: Range<usize>,
    entries: &'n [Entry],
    used: Vec<bool>,
    known: Vec<&'static str>,
}

impl<'n> TableReader<'n> {
    /// Starts reading `node` as a table; a non-table is reported and yields `None`.
    pub(crate) fn new(cx: &mut Cx<'_>, path: &str, node: &'n Node) -> Option<Self> {
        let Kind::Table(entries) = &node.kind else {
            cx.wrong_type(path, node, "a table");
            return None;
        };
        report_duplicates(cx, path, entries);
        Some(TableReader {
            path: path.to_string(),
            span: node.span.clone(),
            entries,
            used: vec![false; entries.len()],
            known: Vec::new(),
        })
    }

    /// The dotted path of a key of this table.
    pub(crate) fn key_path(&self, key: &str) -> String {
        if self.path.is_empty() {
            key.to_string()
        } else {
            format!("{}.{key}", self.path)
        }
    }

    /// Takes `key` or one of its aliases; both spelled at once is a conflict.
    pub(crate) fn take(
        &mut self,
        cx: &mut Cx<'_>,
        key: &'static str,
        aliases: &[&'static str],
    ) -> Option<&'n Entry> {
        self.known.push(key);
        self.known.extend_from_slice(aliases);
        let mut found: Option<&'n Entry> = None;
        for (i, e) in self.entries.iter().enumerate() {
            let matches = e.key == key || aliases.contains(&e.key.as_str());
            if !matches || self.used[i] {
                continue;
            }
            self.used[i] = true;
            if let Some(first) = found {
                if first.key == e.key {
                    // A duplicate, already reported when the table was opened.
                    continue;
                }
                let path = self.key_path(&e.key);
                cx.error(Report {
                    kind: DiagnosticKind::Conflict,
                    path: &path,
                    span: &e.key_span,
                    message: format!("`{}` and `{}` are the same setting", first.key, e.key),
                    help: Some(format!("keep only one of them (preferred: `{key}`)")),
                });
                cx.relate(&first.key_span, "first set here");
            } else {
                found = Some(e);
                cx.spans.insert(self.key_path(key), e.value.span.clone());
            }
        }
        found
    }

    /// Takes a key and converts it; `None` when absent or invalid (the latter reported).
    pub(crate) fn get<T>(
        &mut self,
        cx: &mut Cx<'_>,
        key: &'static str,
        aliases: &[&'static str],
        read: impl FnOnce(&mut Cx<'_>, &str, &Node) -> Option<T>,
    ) -> Option<T> {
        let entry = self.take(cx, key, aliases)?;
        let path = self.key_path(&entry.key);
        read(cx, &path, &entry.value)
    }

    /// A boolean with a default.
    pub(crate) fn bool(&mut self, cx: &mut Cx<'_>, key: &'static str, default: bool) -> bool {
        self.get(cx, key, &[], to_bool).unwrap_or(default)
    }

    /// A non-negative integer with a default.
    pub(crate) fn uint(&mut self, cx: &mut Cx<'_>, key: &'static str, default: u64) -> u64 {
        self.get(cx, key, &[], to_uint).unwrap_or(default)
    }

    /// A number with a default.
    pub(crate) fn float(&mut self, cx: &mut Cx<'_>, key: &'static str, default: f64) -> f64 {
        self.get(cx, key, &[], to_f64).unwrap_or(default)
    }

    /// The span of a key's value if it is present (for cross-field diagnostics).
    pub(crate) fn value_span(&self, key: &str) -> Option<Range<usize>> {
        self.entries
            .iter()
            .find(|e| e.key == key)
            .map(|e| e.value.span.clone())
    }

    /// Reports every key that was not consumed: unsupported DeepSpeed keys per `support`,
    /// anything else as unknown with the nearest valid key.
    pub(crate) fn finish(self, cx: &mut Cx<'_>, support: &[(&str, Support)]) {
        for (e, used) in self.entries.iter().zip(&self.used) {
            if *used {
                continue;
            }
            let path = self.key_path(&e.key);
            match support.iter().find(|(k, _)| *k == e.key) {
                Some((_, Support::Ignored(why))) => {
                    cx.warn(Report {
                        kind: DiagnosticKind::Unsupported,
                        path: &path,
                        span: &e.key_span,
                        message: "not supported by ferrozero; ignored".into(),
                        help: Some((*why).to_string()),
                    });
                }
                Some((_, Support::Refused(why))) => {
                    cx.error(Report {
                        kind: DiagnosticKind::Unsupported,
                        path: &path,
                        span: &e.key_span,
                        message: "not supported by ferrozero".into(),
                        help: Some((*why).to_string()),
                    });
                }
                None => self.unknown(cx, &path, e),
            }
        }
    }

    fn unknown(&self, cx: &mut Cx<'_>, path: &str, e: &Entry) {
        let help = if cx.suggestions_left == 0 {
            "see `ferrozero schema` for the valid keys".to_string()
        } else {
            cx.suggestions_left -= 1;
            match nearest(&e.key, &self.known) {
                Some(k) => format!("did you mean `{k}`?"),
                None if self.known.is_empty() => "this table takes no keys".to_string(),
                None => {
                    let mut keys = self.known.clone();
                    keys.sort_unstable();
                    keys.dedup();
                    format!("valid keys here: {}", keys.join(", "))
                }
            }
        };
        cx.error(Report {
            kind: DiagnosticKind::UnknownKey,
            path,
            span: &e.key_span,
            message: format!("unknown key `{}`", e.key),
            help: Some(help),
        });
    }
}

/// JSON allows repeated keys syntactically; a repeated config key is always a mistake.
fn report_duplicates(cx: &mut Cx<'_>, path: &str, entries: &[Entry]) {
    let mut seen: HashSet<&str> = HashSet::with_capacity(entries.len());
    for (i, e) in entries.iter().enumerate() {
        if seen.insert(&e.key) {
            continue;
        }
        let first = entries[..i]
            .iter()
            .find(|f| f.key == e.key)
            .expect("seen before");
        let full = if path.is_empty() {
            e.key.clone()
        } else {
            format!("{path}.{}", e.key)
        };
        cx.error(Report {
            kind: DiagnosticKind::Conflict,
            path: &full,
            span: &e.key_span,
            message: format!("duplicate key `{}`", e.key),
            help: Some("remove one of them".into()),
        });
        cx.relate(&first.key_span, "first defined here");
    }
}

/// Reads a non-negative integer that must fit in 32 bits.
pub(crate) fn to_u32(cx: &mut Cx<'_>, path: &str, node: &Node) -> Option<u32> {
    let n = to_uint(cx, path, node)?;
    match u32::try_from(n) {
        Ok(v) => Some(v),
        Err(_) => {
            cx.invalid(
                path,
                node,
                format!("{n} is too large (at most {})", u32::MAX),
                None,
            );
            None
        }
    }
}
