//! Rotary position embedding (Hugging Face's rotate-half convention) on `[rows, heads·d]`.

use rayon::prelude::*;

use crate::backend::Rotation;

/// Rotates every head of every row by its position's angles; `Inverse` undoes `Forward`.
pub(super) fn apply(
    x: &mut [f32],
    batch: usize,
    seq: usize,
    heads: usize,
    head_dim: usize,
    theta: f32,
    dir: Rotation,
) {
    let half = head_dim / 2;
    let sign = match dir {
        Rotation::Forward => 1.0f64,
        Rotation::Inverse => -1.0,
    };
    // cos/sin per (position, frequency), computed once in f64 like HF's float32 tables
    // rounded from exact values.
    let table: Vec<(f32, f32)> = (0..seq)
        .flat_map(|pos| {
            (0..half).map(move |i| {
                let inv = (theta as f64).powf(-((2 * i) as f64) / head_dim as f64);
                let a = pos as f64 * inv;
                (a.cos() as f32, (sign * a.sin()) as f32)
            })
        })
        .collect();
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
