//! The built-in addition task (a token file goes through the library's `ferrozero::data`).

use ferrozero::data::Rows;
use ferrozero::runtime::nn::IGNORE_INDEX;

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
    fn len(&self) -> u64 {
        // An endless stream: problem k is drawn from k.
        u64::MAX
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
