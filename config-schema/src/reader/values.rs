//! Typed getters over spanned values: each records a diagnostic (with a hint where one helps)
//! instead of stopping, and returns `None` for a value it could not read.

use super::Cx;
use crate::model::AutoOr;
use crate::parse::{Kind, Node};

/// `"true"` or `"8"` where a boolean or number is expected: say to drop the quotes.
pub(super) fn quoted_hint(node: &Node, expected: &str) -> Option<String> {
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
