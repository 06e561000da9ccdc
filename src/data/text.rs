//! Text corpora: documents from `.txt` or `.jsonl`, tokenized in parallel with the model's
//! `tokenizer.json` and joined with its end-of-text token.

use std::path::{Path, PathBuf};

use rayon::prelude::*;

use super::file_err;
use ferrozero_runtime::Result;

/// End-of-text tokens as common tokenizers spell them, tried when neither the caller nor
/// `tokenizer_config.json` names one.
const EOS_NAMES: [&str; 5] = [
    "<|endoftext|>",
    "</s>",
    "<|end_of_text|>",
    "<eos>",
    "<|im_end|>",
];

/// A Hugging Face tokenizer with the id that ends each document.
pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
    /// The end-of-text id appended to every document.
    pub eos: u32,
}

impl TextTokenizer {
    /// Reads `tokenizer.json`. The end-of-text id is `eos` when given, else the `eos_token` of
    /// a `tokenizer_config.json` beside it, else the first of the usual spellings it holds.
    pub fn open(path: &Path, eos: Option<u32>) -> Result<Self> {
        let bytes = std::fs::read(path)
            .map_err(|e| file_err(path, format!("cannot read the tokenizer: {e}")))?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes)
            .map_err(|e| file_err(path, format!("not a valid tokenizer.json: {e}")))?;
        let eos = match eos {
            Some(id) => id,
            None => find_eos(path, &inner)?,
        };
        Ok(Self {
            inner,
            path: path.to_path_buf(),
            eos,
        })
    }

    /// Tokens in the vocabulary, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Token ids of one document (no special tokens added).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode_fast(text, false)
            .map_err(|e| file_err(&self.path, format!("tokenizing failed: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Every piece's ids, tokenized in parallel, in order.
    pub fn encode_all(&self, pieces: &[String]) -> Result<Vec<Vec<u32>>> {
        pieces.par_iter().map(|d| self.encode(d)).collect()
    }

    /// Every document's ids followed by the end-of-text id, tokenized in parallel, in order.
    pub fn encode_documents(&self, docs: &[String]) -> Result<Vec<u32>> {
        let parts = self.encode_all(docs)?;
        let mut out = Vec::with_capacity(parts.iter().map(|p| p.len() + 1).sum());
        for p in parts {
            out.extend(p);
            out.push(self.eos);
        }
        Ok(out)
    }
}

fn find_eos(path: &Path, tok: &tokenizers::Tokenizer) -> Result<u32> {
    let config = path.with_file_name("tokenizer_config.json");
    if let Ok(text) = std::fs::read_to_string(&config) {
        let v: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| file_err(&config, format!("not valid JSON: {e}")))?;
        let name = match v.get("eos_token") {
            Some(serde_json::Value::String(s)) => Some(s.as_str()),
            Some(o) => o.get("content").and_then(|c| c.as_str()),
            None => None,
        };
        if let Some(name) = name {
            return tok.token_to_id(name).ok_or_else(|| {
                file_err(
                    path,
                    format!(
                        "eos_token `{name}` of {} is not in the vocabulary",
                        config.display()
                    ),
                )
            });
        }
    }
    EOS_NAMES
        .iter()
        .find_map(|n| tok.token_to_id(n))
        .ok_or_else(|| {
            file_err(
                path,
                format!(
                    "no end-of-text token: no tokenizer_config.json beside it names an eos_token, \
                     and the vocabulary has none of {EOS_NAMES:?}"
                ),
            )
        })
}

/// The documents of a text file: a `.jsonl` file's `text` fields, one per line, or a `.txt`
/// file as one document cut at blank lines (so it tokenizes in parallel).
pub(super) fn documents(path: &Path, text: &str) -> Result<Vec<String>> {
    if path.extension().is_some_and(|e| e == "jsonl") {
        return jsonl(path, text);
    }
    Ok(paragraphs(text))
}

/// A `.txt` file in pieces that end after a blank line. Byte-level BPE pre-tokenizers split
/// at whitespace, so tokens never cross such a cut and the pieces tokenize as the whole would.
fn paragraphs(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find("\n\n") {
        let (head, tail) = rest.split_at(i + 2);
        out.push(head.to_string());
        rest = tail;
    }
    if !rest.is_empty() {
        out.push(rest.to_string());
    }
    out
}

fn jsonl(path: &Path, text: &str) -> Result<Vec<String>> {
    let mut docs = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = |reason: String| file_err(path, format!("line {}: {reason}", i + 1));
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| at(format!("not valid JSON: {e}")))?;
        match v.get("text") {
            Some(serde_json::Value::String(s)) => docs.push(s.clone()),
            Some(_) => return Err(at("the \"text\" field is not a string".into())),
            None => return Err(at("no \"text\" field".into())),
        }
    }
    Ok(docs)
}

/// A `.txt` file read byte by byte (vocabulary 256), for models without a tokenizer.
pub(super) fn bytes(path: &Path, vocab: usize) -> Result<Vec<u32>> {
    if vocab < 256 {
        return Err(file_err(
            path,
            format!("read byte by byte it needs vocabulary 256; the model has {vocab}"),
        ));
    }
    let bytes = std::fs::read(path).map_err(|e| file_err(path, e))?;
    Ok(bytes.into_iter().map(u32::from).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paragraphs_cover_the_text_exactly() {
        let t = "a b\n\nc\n\n\nd e\n";
        let p = paragraphs(t);
        assert_eq!(p, vec!["a b\n\n", "c\n\n", "\nd e\n"]);
        assert_eq!(p.concat(), t);
    }

    #[test]
    fn jsonl_errors_name_the_line() {
        let p = Path::new("c.jsonl");
        assert_eq!(
            jsonl(p, "{\"text\": \"a\"}\n\n{\"text\": \"b\"}\n").unwrap(),
            vec!["a", "b"]
        );
        let e = jsonl(p, "{\"text\": \"a\"}\n{\"body\": \"b\"}\n")
            .unwrap_err()
            .to_string();
        assert_eq!(e, "c.jsonl: line 2: no \"text\" field");
        let e = jsonl(p, "{\"text\": 3}").unwrap_err().to_string();
        assert_eq!(e, "c.jsonl: line 1: the \"text\" field is not a string");
        let e = jsonl(p, "{\"text\": \"a\"}\nnot json")
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("c.jsonl: line 2: not valid JSON"), "{e}");
    }
}
