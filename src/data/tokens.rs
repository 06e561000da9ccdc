//! Pre-tokenized `.bin` files. A file written here starts with a 16-byte header: the magic
//! `FZTOKENS`, the token width in bytes (2 or 4, little-endian u32) and a reserved zero u32,
//! then the ids as little-endian u16 or u32. A file without the magic is read as raw
//! little-endian u16 ids (the format `train_gpt` always read).

use std::path::Path;

use super::file_err;
use ferrozero_runtime::Result;

const MAGIC: &[u8; 8] = b"FZTOKENS";
const HEADER: usize = 16;

/// How wide each stored id is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenWidth {
    /// Two bytes: vocabularies up to 65,536.
    U16,
    /// Four bytes: larger vocabularies.
    U32,
}

impl TokenWidth {
    /// The narrowest width that holds every id below `vocab`.
    pub fn for_vocab(vocab: usize) -> Self {
        if vocab <= 1 << 16 {
            TokenWidth::U16
        } else {
            TokenWidth::U32
        }
    }

    fn bytes(self) -> usize {
        match self {
            TokenWidth::U16 => 2,
            TokenWidth::U32 => 4,
        }
    }
}

/// Writes `tokens` to `path` with the header, in the narrowest width for `vocab`.
pub fn write_tokens(path: &Path, tokens: &[u32], vocab: usize) -> Result<()> {
    let width = TokenWidth::for_vocab(vocab);
    let mut out = Vec::with_capacity(HEADER + tokens.len() * width.bytes());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(width.bytes() as u32).to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    for &t in tokens {
        match width {
            TokenWidth::U16 => out.extend_from_slice(&(t as u16).to_le_bytes()),
            TokenWidth::U32 => out.extend_from_slice(&t.to_le_bytes()),
        }
    }
    std::fs::write(path, out).map_err(|e| file_err(path, e))
}

/// Reads a `.bin` token file; every id must be below `vocab`.
pub fn read_tokens(path: &Path, vocab: usize) -> Result<Vec<u32>> {
    let bytes = std::fs::read(path).map_err(|e| file_err(path, e))?;
    let (width, body) = if bytes.starts_with(MAGIC) {
        if bytes.len() < HEADER {
            return Err(file_err(path, "truncated token file header"));
        }
        match u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) {
            2 => (TokenWidth::U16, HEADER),
            4 => (TokenWidth::U32, HEADER),
            w => {
                return Err(file_err(
                    path,
                    format!("token width {w} in the header; expected 2 or 4 bytes"),
                ))
            }
        }
    } else {
        (TokenWidth::U16, 0)
    };
    let data = &bytes[body..];
    let w = width.bytes();
    if data.len() % w != 0 {
        return Err(file_err(
            path,
            format!(
                "{} bytes of ids is not a whole number of {w}-byte tokens",
                data.len()
            ),
        ));
    }
    let tokens: Vec<u32> = data
        .chunks_exact(w)
        .map(|c| match width {
            TokenWidth::U16 => u16::from_le_bytes([c[0], c[1]]) as u32,
            TokenWidth::U32 => u32::from_le_bytes([c[0], c[1], c[2], c[3]]),
        })
        .collect();
    if let Some(i) = tokens.iter().position(|&t| t as usize >= vocab) {
        return Err(file_err(
            path,
            format!(
                "token {} at byte offset {} is not below the model's vocabulary size {vocab}",
                tokens[i],
                body + i * w
            ),
        ));
    }
    Ok(tokens)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> std::path::PathBuf {
        std::env::temp_dir().join(format!("fz-tokens-{}-{name}", std::process::id()))
    }

    #[test]
    fn round_trips_in_both_widths() {
        let p = tmp("wide.bin");
        let ids = vec![0, 70_000, 5];
        write_tokens(&p, &ids, 100_000).unwrap();
        assert_eq!(std::fs::metadata(&p).unwrap().len(), 16 + 12);
        assert_eq!(read_tokens(&p, 100_000).unwrap(), ids);
        write_tokens(&p, &[1, 2, 3], 50_000).unwrap();
        assert_eq!(std::fs::metadata(&p).unwrap().len(), 16 + 6);
        assert_eq!(read_tokens(&p, 50_000).unwrap(), vec![1, 2, 3]);
        std::fs::remove_file(&p).ok();
    }

    #[test]
    fn a_token_past_the_vocabulary_names_file_and_offset() {
        let p = tmp("raw.bin");
        std::fs::write(&p, [1u8, 0, 9, 0, 200, 0]).unwrap();
        let e = read_tokens(&p, 100).unwrap_err().to_string();
        assert_eq!(
            e,
            format!(
                "{}: token 200 at byte offset 4 is not below the model's vocabulary size 100",
                p.display()
            )
        );
        std::fs::write(&p, [1u8, 0, 9]).unwrap();
        let e = read_tokens(&p, 100).unwrap_err().to_string();
        assert!(
            e.contains("3 bytes of ids is not a whole number of 2-byte tokens"),
            "{e}"
        );
        std::fs::remove_file(&p).ok();
    }
}
