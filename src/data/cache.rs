//! Tokenized text cached next to the data: `<data file>.<key>.tokens.bin`, where the key
//! hashes the data's bytes, the tokenizer's bytes and the end-of-text id, so a change to any
//! of them misses the cache (and the stale files of that data file are removed).

use std::path::{Path, PathBuf};

use xxhash_rust::xxh3::Xxh3;

use super::text::{documents, TextTokenizer};
use super::tokens::{read_tokens, write_tokens};
use super::{file_err, DataOptions};
use ferrozero_runtime::Result;

/// Bumped when the way text becomes tokens changes, so old caches stop matching.
const VERSION: &[u8] = b"ferrozero-tokens-1";
const SUFFIX: &str = ".tokens.bin";

/// The tokens of text file `path`: from the cache when it matches, else tokenized (and cached
/// when `opts.cache`). Returns whether the cache served them.
pub(super) fn tokens(
    path: &Path,
    tokenizer: &Path,
    opts: &DataOptions,
) -> Result<(Vec<u32>, bool)> {
    let tok = TextTokenizer::open(tokenizer, opts.eos)?;
    if tok.vocab_size() > opts.vocab {
        return Err(file_err(
            tokenizer,
            format!(
                "the tokenizer has {} tokens; the model's vocabulary is {}",
                tok.vocab_size(),
                opts.vocab
            ),
        ));
    }
    let data = std::fs::read(path).map_err(|e| file_err(path, e))?;
    let tok_bytes = std::fs::read(tokenizer).map_err(|e| file_err(tokenizer, e))?;
    let cached = cache_path(path, &data, &tok_bytes, tok.eos);
    if opts.cache && cached.exists() {
        if let Ok(t) = read_tokens(&cached, opts.vocab) {
            return Ok((t, true));
        }
    }
    let text =
        String::from_utf8(data).map_err(|e| file_err(path, format!("not UTF-8 text: {e}")))?;
    let docs = documents(path, &text)?;
    let ids = if docs.iter().all(|d| d.trim().is_empty()) {
        Vec::new()
    } else if path.extension().is_some_and(|e| e == "jsonl") {
        tok.encode_documents(&docs)?
    } else {
        // A .txt file is one document cut into paragraphs: one end-of-text at its end.
        let mut ids = tok.encode_all(&docs)?.concat();
        ids.push(tok.eos);
        ids
    };
    if opts.cache {
        store(path, &cached, &ids, opts.vocab);
    }
    Ok((ids, false))
}

fn cache_path(path: &Path, data: &[u8], tokenizer: &[u8], eos: u32) -> PathBuf {
    let mut h = Xxh3::new();
    for part in [VERSION, data, tokenizer, &eos.to_le_bytes()] {
        h.update(&(part.len() as u64).to_le_bytes());
        h.update(part);
    }
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    path.with_file_name(format!("{name}.{:032x}{SUFFIX}", h.digest128()))
}

/// Writes the cache by rename and removes this data file's stale caches. A cache that cannot
/// be written (a read-only data directory) only costs the next run the tokenizing.
fn store(path: &Path, cached: &Path, ids: &[u32], vocab: usize) {
    let tmp = cached.with_extension(format!("partial-{}", std::process::id()));
    let written = write_tokens(&tmp, ids, vocab)
        .and_then(|()| std::fs::rename(&tmp, cached).map_err(|e| file_err(cached, e)));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        tracing::warn!("not caching the tokens: {e}");
        return;
    }
    let prefix = format!(
        "{}.",
        path.file_name().unwrap_or_default().to_string_lossy()
    );
    let dir = cached
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    // By name: for a bare relative path the listing's entries read `./<name>`, which no
    // path comparison would match with the cache just written.
    let keep = cached.file_name().unwrap_or_default();
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let stale = name.starts_with(&prefix) && name.ends_with(SUFFIX) && e.file_name() != keep;
        if stale && name.len() == prefix.len() + 32 + SUFFIX.len() {
            let _ = std::fs::remove_file(e.path());
        }
    }
}
