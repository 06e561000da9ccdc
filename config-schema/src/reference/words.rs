//! Types and values in words: `integer from 0 to 3`, `number or "auto"`, `one of "cpu", "nvme"`.

use serde_json::Value;

use super::shape::{Alt, Alternatives};

/// A JSON value as the user writes it, in a code span.
pub(super) fn value_text(value: &Value) -> String {
    code(&value.to_string())
}

/// A default as written, with large round integers also in scientific notation (`5e8`, as
/// DeepSpeed's docs write bucket sizes), which is easier to read than nine digits.
pub(super) fn default_text(value: &Value) -> String {
    let text = value_text(value);
    let Some(n) = value.as_u64().filter(|n| *n >= 10_000) else {
        return text;
    };
    let zeros = n.to_string().len() - n.to_string().trim_end_matches('0').len();
    let mantissa = n / 10u64.pow(zeros as u32);
    if mantissa < 10 {
        format!("{text} ({mantissa}e{zeros})")
    } else {
        text
    }
}

/// Wraps text in a Markdown code span, widening the fence when the text holds backticks.
pub(super) fn code(text: &str) -> String {
    let longest_run = text.split(|c| c != '`').map(str::len).max().unwrap_or(0);
    let fence = "`".repeat(longest_run + 1);
    let pad = if text.starts_with('`') || text.ends_with('`') {
        " "
    } else {
        ""
    };
    format!("{fence}{pad}{text}{pad}{fence}")
}

/// What a key accepts, in words; `null` is left out (the default column says "unset").
pub(super) fn type_text(alts: &Alternatives<'_>) -> String {
    let mut parts: Vec<String> = alts
        .values
        .iter()
        .filter(|a| !matches!(a, Alt::Const { .. }))
        .map(alt_text)
        .collect();
    if !alts.objects.is_empty() {
        parts.push("table".to_string());
    }
    let consts: Vec<String> = alts
        .values
        .iter()
        .filter_map(|a| match a {
            Alt::Const { value, .. } => Some(value_text(value)),
            _ => None,
        })
        .collect();
    match consts.len() {
        0 => {}
        1 => parts.push(consts[0].clone()),
        _ => parts.push(format!("one of {}", consts.join(", "))),
    }
    if parts.is_empty() {
        return "no value (the schema accepts none)".to_string();
    }
    parts.join(" or ")
}

fn alt_text(alt: &Alt<'_>) -> String {
    match alt {
        Alt::Const { value, .. } => value_text(value),
        Alt::Scalar { kind, schema } => scalar_text(kind, schema),
        Alt::Array(schema) => array_text(schema),
        Alt::Map => "table of any keys".to_string(),
        Alt::Any => "any value".to_string(),
    }
}

fn scalar_text(kind: &str, schema: &Value) -> String {
    let mut text = kind.to_string();
    let bounds = bounds_text(schema);
    if !bounds.is_empty() {
        text.push(' ');
        text.push_str(&bounds);
    }
    if let Some(pattern) = schema.get("pattern").and_then(Value::as_str) {
        text.push_str(&format!(" matching {}", code(pattern)));
    }
    text
}

/// `from 0 to 3` when both ends are inclusive, else each bound as a comparison.
fn bounds_text(schema: &Value) -> String {
    let get = |k: &str| schema.get(k).filter(|v| v.is_number());
    if let (Some(lo), Some(hi)) = (get("minimum"), get("maximum")) {
        if get("exclusiveMinimum").is_none() && get("exclusiveMaximum").is_none() {
            return format!("from {lo} to {hi}");
        }
    }
    let length = |k: &str| schema.get(k).and_then(Value::as_u64);
    let mut out = Vec::new();
    for (keyword, op) in [
        ("minimum", "≥"),
        ("exclusiveMinimum", ">"),
        ("maximum", "≤"),
        ("exclusiveMaximum", "<"),
    ] {
        if let Some(v) = get(keyword) {
            out.push(format!("{op} {v}"));
        }
    }
    if let Some(n) = length("minLength") {
        out.push(format!("of at least {n} characters"));
    }
    if let Some(n) = length("maxLength") {
        out.push(format!("of at most {n} characters"));
    }
    out.join(", ")
}

/// `array of 2 numbers`, `array of 1 to 4 strings`, `array of integer ≥ 0`.
fn array_text(schema: &Value) -> String {
    let items = schema.get("items");
    let item = match items.and_then(|i| Some((i, i.get("type")?.as_str()?))) {
        Some((items, kind)) => {
            let bounds = bounds_text(items);
            if bounds.is_empty() {
                format!("{kind}s")
            } else {
                format!("{kind}s {bounds}")
            }
        }
        None => "values".to_string(),
    };
    let min = schema.get("minItems").and_then(Value::as_u64);
    let max = schema.get("maxItems").and_then(Value::as_u64);
    match (min, max) {
        (Some(a), Some(b)) if a == b => format!("array of {a} {item}"),
        (Some(a), Some(b)) => format!("array of {a} to {b} {item}"),
        (Some(a), None) => format!("array of at least {a} {item}"),
        (None, Some(b)) => format!("array of at most {b} {item}"),
        (None, None) => format!("array of {item}"),
    }
}
