//! Reading one table: which keys were consumed, aliases, duplicate keys, and the report of
//! every leftover key (unsupported DeepSpeed key, or unknown with the nearest valid spelling).

use std::collections::HashSet;
use std::ops::Range;

use super::{nearest, to_bool, to_f64, to_uint, Cx, Report};
use crate::diagnostic::DiagnosticKind;
use crate::parse::{Entry, Kind, Node};

/// How ferrozero treats a DeepSpeed key it does not implement.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Support {
    /// Ignoring it cannot change training results: warn.
    Ignored(&'static str),
    /// Ignoring it would change results: refuse.
    Refused(&'static str),
    /// Silent at the values the predicate accepts (what ferrozero does anyway, or "off");
    /// any other value is ignored with a warning.
    IgnoredUnless(fn(&Node) -> bool, &'static str),
    /// Silent at the values the predicate accepts; any other value is refused.
    RefusedUnless(fn(&Node) -> bool, &'static str),
    /// A section that turns a feature on with `enabled: true` (anywhere inside): silent when
    /// nothing in it is enabled, ignored with a warning when something is.
    IgnoredIfEnabled(&'static str),
    /// As [`Support::IgnoredIfEnabled`], but refused when something is enabled: running
    /// without the feature would change the math.
    RefusedIfEnabled(&'static str),
}

/// Predicates for [`Support`]: the values at which a key asks for nothing ferrozero lacks.
pub(crate) mod off {
    use crate::parse::{Kind, Node};

    /// `false` (or `null`).
    pub(crate) fn is_false(n: &Node) -> bool {
        matches!(n.kind, Kind::Bool(false) | Kind::Null)
    }
    /// `true` (or `null`).
    pub(crate) fn is_true(n: &Node) -> bool {
        matches!(n.kind, Kind::Bool(true) | Kind::Null)
    }
    /// A number equal to `v` (or `null`).
    fn number_is(n: &Node, v: f64) -> bool {
        match n.kind {
            Kind::Int(i) => i as f64 == v,
            Kind::Float(f) => f == v,
            Kind::Null => true,
            _ => false,
        }
    }
    /// 1 (or `null`).
    pub(crate) fn is_one(n: &Node) -> bool {
        number_is(n, 1.0)
    }
    /// 0 or 1 (or `null`): a size that turns the feature off.
    pub(crate) fn is_zero_or_one(n: &Node) -> bool {
        number_is(n, 0.0) || number_is(n, 1.0)
    }
    /// An fp32 dtype name as DeepSpeed spells them (or `null`).
    pub(crate) fn is_fp32(n: &Node) -> bool {
        match &n.kind {
            Kind::Str(s) => matches!(
                s.to_ascii_lowercase().as_str(),
                "fp32" | "float32" | "float" | "torch.float32"
            ),
            Kind::Null => true,
            _ => false,
        }
    }
    /// An empty table, list or `null`.
    pub(crate) fn is_empty(n: &Node) -> bool {
        match &n.kind {
            Kind::Table(t) => t.is_empty(),
            Kind::Array(a) => a.is_empty(),
            Kind::Null => true,
            _ => false,
        }
    }
    /// Whether anything inside `n` says `enabled: true` (or `"auto"`, left to the caller's
    /// reading: not enabled).
    pub(crate) fn enables_something(n: &Node) -> bool {
        match &n.kind {
            Kind::Table(entries) => entries.iter().any(|e| {
                (e.key == "enabled" && matches!(e.value.kind, Kind::Bool(true)))
                    || enables_something(&e.value)
            }),
            Kind::Array(items) => items.iter().any(enables_something),
            _ => false,
        }
    }
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
                Some((_, rule)) => report_support(cx, &path, e, *rule),
                None => self.unknown(cx, &path, e),
            }
        }
    }

    fn unknown(&self, cx: &mut Cx<'_>, path: &str, e: &Entry) {
        let help = if cx.suggestions_left == 0 {
            "see `ferrozero schema` for the valid keys".to_string()
        } else {
            cx.suggestions_left -= 1;
            let homes = super::homes::homes_of(&e.key, path);
            match nearest(&e.key, &self.known) {
                Some(k) => format!("did you mean `{k}`?"),
                None if !homes.is_empty() => format!(
                    "`{}` belongs in another table: `{}`",
                    e.key,
                    homes.join("`, `")
                ),
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

/// Reports a DeepSpeed key that ferrozero does not implement, per its [`Support`] rule.
fn report_support(cx: &mut Cx<'_>, path: &str, e: &Entry, rule: Support) {
    let (refuse, why) = match rule {
        Support::Ignored(why) => (false, why),
        Support::Refused(why) => (true, why),
        Support::IgnoredUnless(fine, why) if !fine(&e.value) => (false, why),
        Support::RefusedUnless(fine, why) if !fine(&e.value) => (true, why),
        Support::IgnoredIfEnabled(why) if off::enables_something(&e.value) => (false, why),
        Support::RefusedIfEnabled(why) if off::enables_something(&e.value) => (true, why),
        // The value asks for nothing ferrozero lacks.
        _ => return,
    };
    let report = Report {
        kind: DiagnosticKind::Unsupported,
        path,
        span: &e.key_span,
        message: if refuse {
            "not supported by ferrozero".into()
        } else {
            "not supported by ferrozero; ignored".into()
        },
        help: Some(why.to_string()),
    };
    if refuse {
        cx.error(report);
    } else {
        cx.warn(report);
    }
}
