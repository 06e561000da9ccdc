//! Training data: a corpus file (`.txt`, `.jsonl` through the model's `tokenizer.json`, or
//! pre-tokenized `.bin`) packed into fixed-length rows, with a held-out split.
//!
//! Text documents are tokenized in parallel, joined with the tokenizer's end-of-text token and
//! cached next to the data as a `.bin` file keyed by a hash of the data and the tokenizer, so a
//! second run reads tokens instead of tokenizing again.

mod cache;
mod packed;
mod text;
mod tokens;

use std::path::Path;

pub use packed::{Packed, Shuffled};
pub use text::TextTokenizer;
pub use tokens::{read_tokens, write_tokens, TokenWidth};

use ferrozero_runtime::nn::Batch;
use ferrozero_runtime::{Error, Result};

/// A source of fixed-length rows, addressed by row number.
pub trait Rows: Send + Sync {
    /// Tokens per row (the model's sequence length).
    fn seq_len(&self) -> usize;
    /// Vocabulary the rows need.
    fn vocab(&self) -> usize;
    /// Rows before the source repeats (`u64::MAX` for an endless one).
    fn len(&self) -> u64;
    /// Row `k`: inputs and targets (targets shifted by one; `IGNORE_INDEX` adds no loss).
    fn row(&self, k: u64) -> (Vec<u32>, Vec<i32>);

    /// Whether the source has no rows (never true for a source that opened).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Rows `first..first + n` as one micro-batch.
    fn batch(&self, first: u64, n: usize) -> Batch {
        let mut tokens = Vec::with_capacity(n * self.seq_len());
        let mut targets = Vec::with_capacity(n * self.seq_len());
        for k in first..first + n as u64 {
            let (t, y) = self.row(k);
            tokens.extend(t);
            targets.extend(y);
        }
        Batch {
            batch: n,
            seq: self.seq_len(),
            tokens,
            targets,
        }
    }
}

/// How to read a corpus.
#[derive(Debug, Clone)]
pub struct DataOptions<'a> {
    /// Tokens per row.
    pub seq_len: usize,
    /// The model's vocabulary: every token must be below it.
    pub vocab: usize,
    /// `tokenizer.json` for text; without one a `.txt` file is read byte by byte.
    pub tokenizer: Option<&'a Path>,
    /// The end-of-text id when the caller knows it (e.g. the model's `eos_token_id`).
    pub eos: Option<u32>,
    /// Share of the rows held out for evaluation (the last ones); 0 for none.
    pub eval_fraction: f64,
    /// Cache tokenized text next to the data.
    pub cache: bool,
}

/// A corpus packed into rows: the training rows and the held-out ones.
pub struct Corpus {
    /// Training rows.
    pub train: Packed,
    /// Held-out rows (`None` when `eval_fraction` is 0).
    pub eval: Option<Packed>,
    /// Tokens in the corpus (documents and their end-of-text tokens).
    pub tokens: usize,
    /// Whether the tokens came from the cache next to the data.
    pub from_cache: bool,
}

/// An error about `path`.
pub(crate) fn file_err(path: &Path, reason: impl std::fmt::Display) -> Error {
    Error::File {
        path: path.display().to_string(),
        reason: reason.to_string(),
    }
}

/// Reads `path` by its extension (`.txt`, `.jsonl`, `.bin`) and packs it into rows.
pub fn open(path: &Path, opts: &DataOptions) -> Result<Corpus> {
    if opts.seq_len == 0 {
        return Err(Error::Invalid(
            "the sequence length must be positive".into(),
        ));
    }
    if !(0.0..1.0).contains(&opts.eval_fraction) {
        return Err(Error::Invalid(format!(
            "the held-out share is {}; it must be at least 0 and below 1",
            opts.eval_fraction
        )));
    }
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    let (tokens, from_cache) = match ext {
        "bin" => (read_tokens(path, opts.vocab)?, false),
        "txt" | "jsonl" => match opts.tokenizer {
            Some(t) => cache::tokens(path, t, opts)?,
            None if ext == "txt" => (text::bytes(path, opts.vocab)?, false),
            None => return Err(file_err(path, "a .jsonl corpus needs a tokenizer.json")),
        },
        other => {
            return Err(file_err(
                path,
                format!("unknown data extension `{other}`: expected .txt, .jsonl or .bin"),
            ))
        }
    };
    let vocab = match (ext, opts.tokenizer) {
        ("txt", None) => 256,
        _ => opts.vocab,
    };
    packed::split(
        path,
        tokens,
        opts.seq_len,
        vocab,
        opts.eval_fraction,
        from_cache,
    )
}
