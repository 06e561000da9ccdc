//! Rotary position embedding (Hugging Face's rotate-half convention) on `[rows, heads·d]`.

use rayon::prelude::*;

use crate::backend::{Rope, Rotation};

/// Rotates every head of every row by its position's angles; `Inverse` undoes `Forward`.
/// `x` holds `batch * seq` rows of `heads` heads of `head_dim`.
pub(super) fn apply(
    x: &mut [f32],
    shape: (usize, usize, usize, usize),
    rope: &Rope,
    dir: Rotation,
) {
    let (batch, seq, heads, head_dim) = shape;
    let half = head_dim / 2;
    let mut table = rope.angles(seq, head_dim);
    if dir == Rotation::Inverse {
        // sin(-a) = -sin(a) exactly, so the inverse negates the rounded sine.
        table.iter_mut().for_each(|cs| cs.1 = -cs.1);
    }
    let row = heads * head_dim;
    x.par_chunks_mut(row)
        .enumerate()
        .take(batch * seq)
        .for_each(|(r, xr)| {
            let pos = r % seq;
            let cs = &table[pos * half..][..half];
            for hd in xr.chunks_mut(head_dim) {
                let (lo, hi) = hd.split_at_mut(half);
                for i in 0..half {
                    let (c, s) = cs[i];
                    let (a, b) = (lo[i], hi[i]);
                    lo[i] = a * c - b * s;
                    hi[i] = b * c + a * s;
                }
            }
        });
}
