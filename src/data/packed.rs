//! A token stream packed into consecutive rows, the held-out split, and a shuffled order.

use std::path::Path;
use std::sync::Arc;

use super::{file_err, Corpus, Rows};
use ferrozero_runtime::Result;

/// Consecutive windows of a token stream: row k takes inputs `tokens[kT .. kT+T]` and the
/// targets shifted by one; rows wrap around after the last one.
#[derive(Clone)]
pub struct Packed {
    tokens: Arc<Vec<u32>>,
    first: u64,
    rows: u64,
    seq: usize,
    vocab: usize,
}

impl Packed {
    /// All rows of `tokens` (at least one row of `seq` + 1 tokens).
    pub fn new(tokens: Vec<u32>, seq: usize, vocab: usize) -> Self {
        let rows = (tokens.len().saturating_sub(1) / seq.max(1)) as u64;
        Self {
            tokens: Arc::new(tokens),
            first: 0,
            rows,
            seq,
            vocab,
        }
    }

    fn slice(&self, first: u64, rows: u64) -> Self {
        Self {
            first: self.first + first,
            rows,
            ..self.clone()
        }
    }
}

impl Rows for Packed {
    fn seq_len(&self) -> usize {
        self.seq
    }
    fn vocab(&self) -> usize {
        self.vocab
    }
    fn len(&self) -> u64 {
        self.rows
    }
    fn row(&self, k: u64) -> (Vec<u32>, Vec<i32>) {
        let start = (self.first + k % self.rows) as usize * self.seq;
        let inputs = self.tokens[start..start + self.seq].to_vec();
        let targets = self.tokens[start + 1..start + self.seq + 1]
            .iter()
            .map(|&t| t as i32)
            .collect();
        (inputs, targets)
    }
}

/// Packs `tokens` into rows and holds out the last `eval_fraction` of them (at least one).
pub(super) fn split(
    path: &Path,
    tokens: Vec<u32>,
    seq: usize,
    vocab: usize,
    eval_fraction: f64,
    from_cache: bool,
) -> Result<Corpus> {
    if tokens.is_empty() {
        return Err(file_err(path, "the corpus is empty: no tokens"));
    }
    let n = tokens.len();
    let all = Packed::new(tokens, seq, vocab);
    let held = if eval_fraction > 0.0 {
        ((all.rows as f64 * eval_fraction).round() as u64).max(1)
    } else {
        0
    };
    let need = held + 1;
    if all.rows < need {
        let what = if held > 0 {
            "one to train and one to hold out"
        } else {
            "one to train"
        };
        return Err(file_err(
            path,
            format!(
                "the corpus is too short: {n} tokens make {} rows of {seq} + 1 tokens; \
                 it needs {need} ({what}): use a shorter --seq-len or more text",
                all.rows
            ),
        ));
    }
    let train_rows = all.rows - held;
    Ok(Corpus {
        train: all.slice(0, train_rows),
        eval: (held > 0).then(|| all.slice(train_rows, held)),
        tokens: n,
        from_cache,
    })
}

/// A seeded permutation of row numbers per pass over `n` rows.
pub struct Shuffled<R> {
    /// The underlying rows.
    pub inner: R,
    /// Rows per pass.
    pub n: u64,
    /// Seed.
    pub seed: u64,
}

/// SplitMix64's finaliser: a cheap, well-mixed hash of a counter.
pub(crate) fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

impl<R: Rows> Rows for Shuffled<R> {
    fn seq_len(&self) -> usize {
        self.inner.seq_len()
    }
    fn vocab(&self) -> usize {
        self.inner.vocab()
    }
    fn len(&self) -> u64 {
        self.n
    }
    fn row(&self, k: u64) -> (Vec<u32>, Vec<i32>) {
        // A keyed affine permutation of 0..n per pass: cheap, no table, a bijection when the
        // multiplier is coprime with n.
        let (pass, i) = (k / self.n, k % self.n);
        let key = mix(self.seed ^ mix(pass));
        let mut a = (key | 1) % self.n.max(1);
        while gcd(a, self.n) != 1 {
            a = (a + 1) % self.n;
        }
        self.inner
            .row(pass * self.n + (a.wrapping_mul(i) + (key >> 17)) % self.n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_holds_out_the_last_rows_and_targets_shift_by_one() {
        let tokens: Vec<u32> = (0..41).collect();
        let c = split(Path::new("t.bin"), tokens, 4, 64, 0.2, false).unwrap();
        assert_eq!((c.train.len(), c.eval.as_ref().unwrap().len()), (8, 2));
        assert_eq!(c.train.row(1), (vec![4, 5, 6, 7], vec![5, 6, 7, 8]));
        assert_eq!(c.eval.as_ref().unwrap().row(0).0, vec![32, 33, 34, 35]);
        // Training rows wrap within the training split, never into the held-out rows.
        assert_eq!(c.train.row(8).0, vec![0, 1, 2, 3]);
    }

    #[test]
    fn too_short_corpus_names_the_file_and_the_rows() {
        let e = split(Path::new("short.txt"), (0..8).collect(), 4, 64, 0.1, false)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.starts_with("short.txt: the corpus is too short: 8 tokens make 1 rows"),
            "{e}"
        );
        let e = split(Path::new("e.txt"), vec![], 4, 64, 0.0, false)
            .err()
            .unwrap()
            .to_string();
        assert_eq!(e, "e.txt: the corpus is empty: no tokens");
    }
}
