//! Source text to one spanned value tree, whatever the input format, so that validation walks a
//! single representation and every diagnostic can point at a byte range of the original file.

mod json;
mod toml_src;

use std::ops::Range;

pub(crate) use json::parse_json;
pub(crate) use toml_src::parse_toml;

/// A value with the byte range it came from.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Node {
    pub kind: Kind,
    pub span: Range<usize>,
}

/// The shapes a config value can take once TOML and JSON are unified.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Kind {
    Null,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Array(Vec<Node>),
    Table(Vec<Entry>),
    /// TOML datetimes: no config key accepts one, but they must be reported, not dropped.
    Datetime,
}

/// One `key = value` of a table, with the key's own span for unknown-key diagnostics.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Entry {
    pub key: String,
    pub key_span: Range<usize>,
    pub value: Node,
}

impl Kind {
    /// The type name used in "expected X, found Y" messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            Kind::Null => "null",
            Kind::Bool(_) => "a boolean",
            Kind::Int(_) => "an integer",
            Kind::Float(_) => "a float",
            Kind::Str(_) => "a string",
            Kind::Array(_) => "an array",
            Kind::Table(_) => "a table",
            Kind::Datetime => "a datetime",
        }
    }
}

/// A syntax error: message and byte offset range.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct SyntaxError {
    pub message: String,
    pub span: Range<usize>,
}
