//! A small span-preserving JSON parser (RFC 8259). serde_json drops positions of values, and the
//! config loader needs the byte range of every key and value for its diagnostics.

use super::{Entry, Kind, Node, SyntaxError};

/// Nesting deeper than this is rejected instead of risking the stack on hostile input.
const MAX_DEPTH: usize = 128;

/// Parses a JSON document; the top level may be any value (the validator demands an object).
pub(crate) fn parse_json(src: &str) -> Result<Node, SyntaxError> {
    let mut p = Parser {
        src,
        bytes: src.as_bytes(),
        pos: 0,
    };
    // A UTF-8 byte-order mark is common in files saved by Windows editors.
    if src.starts_with('\u{feff}') {
        p.pos = 3;
    }
    let node = p.value(0)?;
    p.skip_ws();
    if p.pos < p.bytes.len() {
        return Err(p.error("trailing characters after the JSON value", p.pos));
    }
    Ok(node)
}

struct Parser<'s> {
    src: &'s str,
    bytes: &'s [u8],
    pos: usize,
}

impl Parser<'_> {
    fn error(&self, message: &str, at: usize) -> SyntaxError {
        let end = self.src.ceil_char_boundary_compat(at + 1);
        SyntaxError {
            message: message.to_string(),
            span: at..end,
        }
    }

    fn skip_ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.bytes.get(self.pos) {
            self.pos += 1;
        }
    }

    fn value(&mut self, depth: usize) -> Result<Node, SyntaxError> {
        if depth > MAX_DEPTH {
            return Err(self.error("JSON nested too deeply", self.pos));
        }
        self.skip_ws();
        let start = self.pos;
        let kind = match self.bytes.get(self.pos) {
            None => return Err(self.error("unexpected end of input, expected a value", start)),
            Some(b'{') => Kind::Table(self.object(depth)?),
            Some(b'[') => Kind::Array(self.array(depth)?),
            Some(b'"') => Kind::Str(self.string()?),
            Some(b't') => self.literal("true", Kind::Bool(true))?,
            Some(b'f') => self.literal("false", Kind::Bool(false))?,
            Some(b'n') => self.literal("null", Kind::Null)?,
            Some(b'-' | b'0'..=b'9') => self.number()?,
            Some(_) => return Err(self.error("expected a JSON value", start)),
        };
        Ok(Node {
            kind,
            span: start..self.pos,
        })
    }

    fn literal(&mut self, word: &str, kind: Kind) -> Result<Kind, SyntaxError> {
        if self.bytes[self.pos..].starts_with(word.as_bytes()) {
            self.pos += word.len();
            Ok(kind)
        } else {
            Err(self.error(&format!("invalid literal, expected `{word}`"), self.pos))
        }
    }

    fn object(&mut self, depth: usize) -> Result<Vec<Entry>, SyntaxError> {
        self.pos += 1;
        let mut entries = Vec::new();
        self.skip_ws();
        if self.bytes.get(self.pos) == Some(&b'}') {
            self.pos += 1;
            return Ok(entries);
        }
        loop {
            self.skip_ws();
            let key_start = self.pos;
            if self.bytes.get(self.pos) != Some(&b'"') {
                return Err(self.error("expected a string key", self.pos));
            }
            let key = self.string()?;
            let key_span = key_start..self.pos;
            self.skip_ws();
            if self.bytes.get(self.pos) != Some(&b':') {
                return Err(self.error("expected `:` after the key", self.pos));
            }
            self.pos += 1;
            let value = self.value(depth + 1)?;
            entries.push(Entry {
                key,
                key_span,
                value,
            });
            self.skip_ws();
            match self.bytes.get(self.pos) {
                Some(b',') => self.pos += 1,
                Some(b'}') => {
                    self.pos += 1;
                    return Ok(entries);
                }
                _ => return Err(self.error("expected `,` or `}`", self.pos)),
            }
        }
    }

    fn array(&mut self, depth: usize) -> Result<Vec<Node>, SyntaxError> {
        self.pos += 1;
        let mut items = Vec::new();
        self.skip_ws();
        if self.bytes.get(self.pos) == Some(&b']') {
            self.pos += 1;
            return Ok(items);
        }
        loop {
            items.push(self.value(depth + 1)?);
            self.skip_ws();
            match self.bytes.get(self.pos) {
                Some(b',') => self.pos += 1,
                Some(b']') => {
                    self.pos += 1;
                    return Ok(items);
                }
                _ => return Err(self.error("expected `,` or `]`", self.pos)),
            }
        }
    }

    fn string(&mut self) -> Result<String, SyntaxError> {
        let open = self.pos;
        self.pos += 1;
        let mut out = String::new();
        loop {
            let run_start = self.pos;
            while let Some(&b) = self.bytes.get(self.pos) {
                if b == b'"' || b == b'\\' || b < 0x20 {
                    break;
                }
                self.pos += 1;
            }
            // Only ASCII bytes stop the scan, so both ends are char boundaries.
            out.push_str(&self.src[run_start..self.pos]);
            match self.bytes.get(self.pos) {
                None => return Err(self.error("unterminated string", open)),
                Some(b'"') => {
                    self.pos += 1;
                    return Ok(out);
                }
                Some(b'\\') => out.push(self.escape()?),
                Some(_) => return Err(self.error("control character in string", self.pos)),
            }
        }
    }

    fn escape(&mut self) -> Result<char, SyntaxError> {
        let at = self.pos;
        self.pos += 1;
        let c = match self.bytes.get(self.pos) {
            Some(b'"') => '"',
            Some(b'\\') => '\\',
            Some(b'/') => '/',
            Some(b'b') => '\u{8}',
            Some(b'f') => '\u{c}',
            Some(b'n') => '\n',
            Some(b'r') => '\r',
            Some(b't') => '\t',
            Some(b'u') => {
                self.pos += 1;
                return self.unicode_escape(at);
            }
            _ => return Err(self.error("invalid escape sequence", at)),
        };
        self.pos += 1;
        Ok(c)
    }

    fn hex4(&mut self, at: usize) -> Result<u32, SyntaxError> {
        let digits = self
            .bytes
            .get(self.pos..self.pos + 4)
            .and_then(|d| std::str::from_utf8(d).ok())
            .and_then(|d| u32::from_str_radix(d, 16).ok())
            .ok_or_else(|| self.error("invalid \\u escape", at))?;
        self.pos += 4;
        Ok(digits)
    }

    fn unicode_escape(&mut self, at: usize) -> Result<char, SyntaxError> {
        let hi = self.hex4(at)?;
        let code = if (0xD800..0xDC00).contains(&hi) {
            if !self.bytes[self.pos..].starts_with(b"\\u") {
                return Err(self.error("unpaired surrogate in \\u escape", at));
            }
            self.pos += 2;
            let lo = self.hex4(at)?;
            if !(0xDC00..0xE000).contains(&lo) {
                return Err(self.error("invalid surrogate pair in \\u escape", at));
            }
            0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00)
        } else {
            hi
        };
        char::from_u32(code).ok_or_else(|| self.error("invalid \\u escape", at))
    }

    fn number(&mut self) -> Result<Kind, SyntaxError> {
        let start = self.pos;
        let mut integral = true;
        if self.bytes[self.pos] == b'-' {
            self.pos += 1;
        }
        match self.bytes.get(self.pos) {
            Some(b'0') => self.pos += 1,
            Some(b'1'..=b'9') => self.digits(),
            _ => return Err(self.error("invalid number", start)),
        }
        if self.bytes.get(self.pos) == Some(&b'.') {
            integral = false;
            self.pos += 1;
            self.required_digits(start)?;
        }
        if let Some(b'e' | b'E') = self.bytes.get(self.pos) {
            integral = false;
            self.pos += 1;
            if let Some(b'+' | b'-') = self.bytes.get(self.pos) {
                self.pos += 1;
            }
            self.required_digits(start)?;
        }
        let text = &self.src[start..self.pos];
        if integral {
            if let Ok(n) = text.parse::<i64>() {
                return Ok(Kind::Int(n));
            }
        }
        // Digits and an optional exponent always parse as f64 (huge ones to infinity).
        Ok(Kind::Float(text.parse().unwrap_or(f64::NAN)))
    }

    fn digits(&mut self) {
        while let Some(b'0'..=b'9') = self.bytes.get(self.pos) {
            self.pos += 1;
        }
    }

    fn required_digits(&mut self, start: usize) -> Result<(), SyntaxError> {
        if !matches!(self.bytes.get(self.pos), Some(b'0'..=b'9')) {
            return Err(self.error("invalid number: expected digits", start));
        }
        self.digits();
        Ok(())
    }
}

/// `str::ceil_char_boundary` is not stable on the workspace's minimum Rust version.
trait CeilBoundary {
    fn ceil_char_boundary_compat(&self, at: usize) -> usize;
}

impl CeilBoundary for str {
    fn ceil_char_boundary_compat(&self, at: usize) -> usize {
        let mut i = at.min(self.len());
        while !self.is_char_boundary(i) {
            i += 1;
        }
        i
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_point_at_values() {
        let src = r#"{"a": [1, 2.5e3], "b": "x\u00e9\ud83d\ude00"}"#;
        let Kind::Table(entries) = parse_json(src).unwrap().kind else {
            panic!("not a table")
        };
        assert_eq!(&src[entries[0].key_span.clone()], "\"a\"");
        assert_eq!(&src[entries[0].value.span.clone()], "[1, 2.5e3]");
        assert_eq!(entries[1].value.kind, Kind::Str("xé😀".into()));
    }

    #[test]
    fn rejects_malformed_input_with_position() {
        for (src, at) in [
            ("{\"a\": }", 6),
            ("[1,]", 3),
            ("{\"a\" 1}", 5),
            ("01", 1),
            ("\"ab", 0),
        ] {
            let err = parse_json(src).unwrap_err();
            assert_eq!(err.span.start, at, "{src}: {err:?}");
        }
    }

    #[test]
    fn deep_nesting_is_an_error_not_a_crash() {
        let src = "[".repeat(100_000);
        assert!(parse_json(&src).unwrap_err().message.contains("deeply"));
    }
}
