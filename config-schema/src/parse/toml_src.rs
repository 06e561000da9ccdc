//! TOML through `toml`'s span-preserving `DeTable` parser into the shared [`Node`] tree.

use toml::de::{DeTable, DeValue};
use toml::Spanned;

use super::{Entry, Kind, Node, SyntaxError};

/// Parses a TOML document.
pub(crate) fn parse_toml(src: &str) -> Result<Node, SyntaxError> {
    let table = DeTable::parse(src).map_err(|e| SyntaxError {
        message: e.message().to_string(),
        span: e.span().unwrap_or(0..0),
    })?;
    let span = table.span();
    Ok(Node {
        kind: Kind::Table(convert_table(table.get_ref())),
        span,
    })
}

fn convert_table(table: &DeTable<'_>) -> Vec<Entry> {
    table
        .iter()
        .map(|(k, v)| Entry {
            key: k.get_ref().to_string(),
            key_span: k.span(),
            value: convert(v),
        })
        .collect()
}

fn convert(value: &Spanned<DeValue<'_>>) -> Node {
    let kind = match value.get_ref() {
        DeValue::String(s) => Kind::Str(s.to_string()),
        DeValue::Integer(i) => match i64::from_str_radix(i.as_str(), i.radix()) {
            Ok(n) => Kind::Int(n),
            // Out of i64 range: keep the magnitude so range checks can still report it.
            Err(_) => Kind::Float(i.as_str().parse().unwrap_or(f64::INFINITY)),
        },
        DeValue::Float(f) => Kind::Float(f.as_str().parse().unwrap_or(f64::NAN)),
        DeValue::Boolean(b) => Kind::Bool(*b),
        DeValue::Datetime(_) => Kind::Datetime,
        DeValue::Array(a) => Kind::Array(a.iter().map(convert).collect()),
        DeValue::Table(t) => Kind::Table(convert_table(t)),
    };
    Node {
        kind,
        span: value.span(),
    }
}
