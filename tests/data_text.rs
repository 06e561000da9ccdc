//! The library's data path on the shipped Shakespeare corpus and tokenizer: documents joined
//! with the end-of-text token, the cache next to the data and when it is invalidated, token
//! files, and the errors for data that cannot make a row.

use std::path::{Path, PathBuf};

use ferrozero::data::{self, write_tokens, DataOptions, Rows, TextTokenizer};

fn repo(p: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(p)
}

fn scratch(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("fz-data-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn opts(tokenizer: &Path, seq_len: usize) -> DataOptions<'_> {
    DataOptions {
        seq_len,
        vocab: 512,
        tokenizer: Some(tokenizer),
        eos: None,
        eval_fraction: 0.0,
        cache: true,
    }
}

/// Every token of the training rows, in order (rows do not overlap but for the target).
fn stream(rows: &dyn Rows) -> Vec<u32> {
    let mut out: Vec<u32> = (0..rows.len()).flat_map(|k| rows.row(k).0).collect();
    out.push(*rows.row(rows.len() - 1).1.last().unwrap() as u32);
    out
}

#[test]
fn jsonl_documents_are_joined_with_the_end_of_text_token() {
    let dir = scratch("jsonl");
    let tok_path = repo("data/shakespeare/tokenizer.json");
    let tok = TextTokenizer::open(&tok_path, None).unwrap();
    assert_eq!(tok.eos, 0, "<|endoftext|> is the trainer's first token");
    let docs = ["To be, or not to be", "that is the question"];
    let path = dir.join("docs.jsonl");
    let lines: Vec<String> = docs
        .iter()
        .map(|d| serde_json::json!({ "text": d }).to_string())
        .collect();
    std::fs::write(&path, lines.join("\n")).unwrap();
    let mut want = tok.encode(docs[0]).unwrap();
    want.push(0);
    want.extend(tok.encode(docs[1]).unwrap());
    want.push(0);
    let c = data::open(&path, &opts(&tok_path, 1)).unwrap();
    assert_eq!(c.tokens, want.len());
    assert_eq!(stream(&c.train), want);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_text_file_tokenized_by_paragraphs_equals_the_whole() {
    let tok_path = repo("data/shakespeare/tokenizer.json");
    let tok = TextTokenizer::open(&tok_path, None).unwrap();
    let text = std::fs::read_to_string(repo("data/shakespeare/input.txt")).unwrap();
    let dir = scratch("whole");
    let path = dir.join("input.txt");
    std::fs::write(&path, &text).unwrap();
    let c = data::open(
        &path,
        &DataOptions {
            cache: false,
            ..opts(&tok_path, 64)
        },
    )
    .unwrap();
    let mut want = tok.encode(&text).unwrap();
    want.push(tok.eos);
    assert_eq!(c.tokens, want.len());
    let got = stream(&c.train);
    assert_eq!(got[..], want[..got.len()]);
    // The BPE learned merges: about two bytes per token.
    assert!(want.len() * 3 < text.len() * 2, "{} tokens", want.len());
    std::fs::remove_dir_all(&dir).ok();
}

fn caches(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".tokens.bin"))
        .collect();
    v.sort();
    v
}

#[test]
fn the_cache_serves_a_second_read_and_misses_when_data_or_tokenizer_change() {
    let dir = scratch("cache");
    let tok_path = dir.join("tokenizer.json");
    std::fs::copy(repo("data/shakespeare/tokenizer.json"), &tok_path).unwrap();
    let path = dir.join("play.txt");
    std::fs::write(
        &path,
        "ROMEO:\nBut soft, what light through yonder window breaks?\n",
    )
    .unwrap();
    let o = opts(&tok_path, 4);
    let a = data::open(&path, &o).unwrap();
    assert!(!a.from_cache);
    let b = data::open(&path, &o).unwrap();
    assert!(b.from_cache);
    assert_eq!(stream(&a.train), stream(&b.train));
    let first = caches(&dir);
    assert_eq!(first.len(), 1, "{first:?}");
    std::fs::write(
        &path,
        "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?\n",
    )
    .unwrap();
    let c = data::open(&path, &o).unwrap();
    assert!(!c.from_cache);
    assert_ne!(stream(&c.train), stream(&a.train));
    let second = caches(&dir);
    assert_eq!(second.len(), 1, "the stale cache is removed: {second:?}");
    assert_ne!(first, second);
    // Same vocabulary, other bytes: a changed tokenizer file misses too.
    let t: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&tok_path).unwrap()).unwrap();
    std::fs::write(&tok_path, t.to_string()).unwrap();
    assert!(!data::open(&path, &o).unwrap().from_cache);
    assert!(data::open(&path, &o).unwrap().from_cache);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn token_files_carry_their_width_and_are_checked_against_the_vocabulary() {
    let dir = scratch("bin");
    let path = dir.join("ids.bin");
    let ids: Vec<u32> = (0..100).map(|i| 65_000 + i * 7).collect();
    write_tokens(&path, &ids, 70_000).unwrap();
    let o = DataOptions {
        tokenizer: None,
        vocab: 70_000,
        ..opts(Path::new("unused"), 9)
    };
    let c = data::open(&path, &o).unwrap();
    assert_eq!(stream(&c.train), ids[..stream(&c.train).len()]);
    let e = data::open(
        &path,
        &DataOptions {
            vocab: 65_536,
            ..o.clone()
        },
    )
    .err()
    .unwrap();
    assert_eq!(
        e.to_string(),
        format!(
            "{}: token 65539 at byte offset 324 is not below the model's vocabulary size 65536",
            path.display()
        )
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_corpus_shorter_than_one_row_names_the_file() {
    let dir = scratch("short");
    let tok_path = repo("data/shakespeare/tokenizer.json");
    let path = dir.join("line.txt");
    std::fs::write(&path, "Now is the winter of our discontent").unwrap();
    let e = data::open(
        &path,
        &DataOptions {
            cache: false,
            ..opts(&tok_path, 64)
        },
    )
    .err()
    .unwrap()
    .to_string();
    assert!(
        e.starts_with(&format!("{}: the corpus is too short:", path.display())),
        "{e}"
    );
    assert!(e.contains("make 0 rows of 64 + 1 tokens"), "{e}");
    let e = data::open(
        &path,
        &DataOptions {
            eval_fraction: 1.0,
            ..opts(&tok_path, 4)
        },
    )
    .err()
    .unwrap()
    .to_string();
    assert!(
        e.contains("the held-out share is 1; it must be at least 0 and below 1"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).ok();
}
