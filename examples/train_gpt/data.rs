//! Training data: the built-in addition task, or a token file (raw little-endian u16 ids, or
//! a `.txt` file read byte by byte), read as consecutive windows.

use std::path::Path;

use ferrozero::runtime::nn::{Batch, IGNORE_INDEX};

/// A source of fixed-length rows, addressed by row number.
pub trait Rows: Send + Sync {
    /// Tokens per row (the model's sequence length).
    fn seq_len(&self) -> usize;
    /// Vocabulary the rows need.
    fn vocab(&self) -> usize;
    /// Row `k`: inputs and targets (targets shifted by one; IGNORE_INDEX contributes no loss).
    fn row(&self, k: u64) -> (Vec<u32>, Vec<i32>);

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

/// `a+b=` followed by the sum's digits in reverse (least significant first, as a carry
/// propagates), with loss only on the answer. Exact-match accuracy under teacher forcing
/// equals greedy-decoding accuracy.
pub struct Addition {
    /// Digits per operand.
    pub digits: u32,
    /// Stream seed: training and held-out streams use different seeds.
    pub seed: u64,
}

const PLUS: u32 = 10;
const EQUALS: u32 = 11;

fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

impl Addition {
    fn operands(&self, k: u64) -> (u64, u64) {
        let m = 10u64.pow(self.digits);
        let h = mix(self.seed ^ mix(k));
        (h % m, (h >> 32) % m)
    }

    fn answer_len(&self) -> usize {
        self.digits as usize + 1
    }

    /// The full token sequence of problem `k` (inputs plus the final target).
    fn sequence(&self, k: u64) -> Vec<u32> {
        let (a, b) = self.operands(k);
        let d = self.digits as usize;
        let digits = |x: u64, n: usize| -> Vec<u32> {
            (0..n)
                .rev()
                .map(|i| ((x / 10u64.pow(i as u32)) % 10) as u32)
                .collect()
        };
        let mut s = digits(a, d);
        s.push(PLUS);
        s.extend(digits(b, d));
        s.push(EQUALS);
        let mut sum = digits(a + b, self.answer_len());
        sum.reverse();
        s.extend(sum);
        s
    }

    /// Positions (in a row) whose targets are answer digits.
    pub fn answer_positions(&self) -> std::ops::Range<usize> {
        let start = 2 * self.digits as usize + 1;
        start..start + self.answer_len()
    }
}

impl Rows for Addition {
    fn seq_len(&self) -> usize {
        3 * self.digits as usize + 2
    }
    fn vocab(&self) -> usize {
        12
    }
    fn row(&self, k: u64) -> (Vec<u32>, Vec<i32>) {
        let s = self.sequence(k);
        let inputs = s[..s.len() - 1].to_vec();
        let answer = self.answer_positions();
        let targets = (0..inputs.len())
            .map(|i| {
                if answer.contains(&i) {
                    s[i + 1] as i32
                } else {
                    IGNORE_INDEX
                }
            })
            .collect();
        (inputs, targets)
    }
}

/// Consecutive windows of a token file: row k takes inputs `tokens[kT .. kT+T]` and targets
/// shifted by one; rows wrap around at the end of the file.
pub struct TokenFile {
    tokens: Vec<u32>,
    seq: usize,
    vocab: usize,
}

impl TokenFile {
    /// Reads `path`: `.txt` as bytes (vocabulary 256), anything else as little-endian u16 ids.
    pub fn open(path: &Path, seq: usize) -> Result<Self, String> {
        let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let text = path.extension().is_some_and(|e| e == "txt");
        let tokens: Vec<u32> = if text {
            bytes.iter().map(|&b| b as u32).collect()
        } else {
            if bytes.len() % 2 != 0 {
                return Err(format!(
                    "{}: odd byte count {}, not a u16 token file",
                    path.display(),
                    bytes.len()
                ));
            }
            bytes
                .chunks_exact(2)
                .map(|c| u16::from_le_bytes([c[0], c[1]]) as u32)
                .collect()
        };
        if tokens.len() < seq + 1 {
            return Err(format!(
                "{}: {} tokens, fewer than one row of {} + 1",
                path.display(),
                tokens.len(),
                seq
            ));
        }
        let vocab = if text {
            256
        } else {
            tokens.iter().max().map_or(1, |&m| m as usize + 1)
        };
        Ok(Self { tokens, seq, vocab })
    }

    /// Rows before the windows wrap.
    pub fn rows(&self) -> u64 {
        ((self.tokens.len() - 1) / self.seq) as u64
    }
}

impl Rows for TokenFile {
    fn seq_len(&self) -> usize {
        self.seq
    }
    fn vocab(&self) -> usize {
        self.vocab
    }
    fn row(&self, k: u64) -> (Vec<u32>, Vec<i32>) {
        let start = (k % self.rows()) as usize * self.seq;
        let inputs = self.tokens[start..start + self.seq].to_vec();
        let targets = self.tokens[start + 1..start + self.seq + 1]
            .iter()
            .map(|&t| t as i32)
            .collect();
        (inputs, targets)
    }
}

/// A seeded permutation of row numbers per pass over `n` rows (for `--shuffle`).
pub struct Shuffled<R> {
    /// The underlying rows.
    pub inner: R,
    /// Rows per pass.
    pub n: u64,
    /// Seed.
    pub seed: u64,
}

impl<R: Rows> Rows for Shuffled<R> {
    fn seq_len(&self) -> usize {
        self.inner.seq_len()
    }
    fn vocab(&self) -> usize {
        self.inner.vocab()
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

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addition_rows_hold_reversed_sums() {
        let a = Addition { digits: 3, seed: 1 };
        let (x, y) = a.row(5);
        assert_eq!(x.len(), a.seq_len());
        let s = a.sequence(5);
        let (p, q) = a.operands(5);
        let ans: u64 = s[8..]
            .iter()
            .enumerate()
            .map(|(i, &d)| d as u64 * 10u64.pow(i as u32))
            .sum();
        assert_eq!(ans, p + q);
        assert_eq!(y.iter().filter(|&&t| t != IGNORE_INDEX).count(), 4);
    }
}
