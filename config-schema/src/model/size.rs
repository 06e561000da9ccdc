//! Byte sizes written as a number of bytes or a string with a unit (`"40GB"`, `"40GiB"`), for
//! `device_memory_limit` (ferrozero's own key) and the command-line size flags.

use std::borrow::Cow;

use schemars::{json_schema, JsonSchema, Schema, SchemaGenerator};
use serde::{Serialize, Serializer};

use crate::parse::{Kind, Node};
use crate::reader::{to_uint, Cx};

/// A size in bytes. Written as an integer (bytes) or a string: `"40GB"` (10^9), `"40GiB"`
/// (2^30), `"512MiB"`, `"1.5TB"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ByteSize(pub u64);

impl ByteSize {
    /// The number of bytes.
    pub fn bytes(self) -> u64 {
        self.0
    }
}

/// Serialized as the exact byte count, so a converted config means the same bytes.
impl Serialize for ByteSize {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(self.0)
    }
}

impl JsonSchema for ByteSize {
    fn inline_schema() -> bool {
        true
    }

    fn schema_name() -> Cow<'static, str> {
        "ByteSize".into()
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "anyOf": [
                { "type": "integer", "minimum": 1 },
                { "type": "string", "pattern": "^\\s*[0-9.eE]+\\s*([kKmMgGtT]i?[bB]|[bB])?\\s*$" }
            ]
        })
    }
}

/// Parses `40GB`, `40 GiB`, `512MiB`, `1.5TB` or a plain byte count. Decimal units are
/// powers of 1000 and binary units (`KiB`, `MiB`, ...) powers of 1024, as disk and GPU
/// vendors write them.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == 'e' || c == 'E'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("`{s}` is not a size (e.g. 40GB, 40GiB, 1073741824)"))?;
    let mult = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        "kib" => 1024.0,
        "mib" => 1024f64.powi(2),
        "gib" => 1024f64.powi(3),
        "tib" => 1024f64.powi(4),
        u => {
            return Err(format!(
                "unknown size unit `{u}` in `{s}` (use GB, GiB, ...)"
            ))
        }
    };
    let b = n * mult;
    if !(0.0..=u64::MAX as f64).contains(&b) {
        return Err(format!("`{s}` is out of range"));
    }
    Ok(b as u64)
}

/// Reads a positive size: an integer number of bytes or a string with a unit.
pub(crate) fn read_size(cx: &mut Cx<'_>, path: &str, node: &Node) -> Option<ByteSize> {
    let bytes = match &node.kind {
        Kind::Str(s) => match parse_size(s) {
            Ok(b) => b,
            Err(e) => {
                let help = Some("write bytes or a size such as \"40GB\" or \"40GiB\"".into());
                cx.invalid(path, node, e, help);
                return None;
            }
        },
        _ => to_uint(cx, path, node)?,
    };
    if bytes == 0 {
        let help = Some("leave the key out for no limit".into());
        cx.invalid(path, node, "a size limit must be positive".into(), help);
        return None;
    }
    Some(ByteSize(bytes))
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes_parse_in_both_unit_families() {
        assert_eq!(parse_size("40GB").unwrap(), 40_000_000_000);
        assert_eq!(parse_size("40 GiB").unwrap(), 40 << 30);
        assert_eq!(parse_size("1.5TB").unwrap(), 1_500_000_000_000);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        for bad in ["", "GB", "40XB", "-1GB", "1e400GB"] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
    }
}
