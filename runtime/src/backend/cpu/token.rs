//! Embedding lookup/scatter and softmax cross-entropy with ignore-index.

use rayon::prelude::*;

use super::{math, CpuBackend};
use crate::backend::{Accumulate, TokenOps};
use crate::nn::IGNORE_INDEX;
use crate::{Error, Result};

impl TokenOps for CpuBackend {
    fn embedding_forward(
        &self,
        tokens: &[u32],
        table: &[f32],
        dim: usize,
        out: &mut [f32],
        acc: Accumulate,
    ) -> Result<()> {
        let rows = table.len() / dim.max(1);
        if let Some((pos, &t)) = tokens.iter().enumerate().find(|(_, &t)| t as usize >= rows) {
            return Err(Error::Invalid(format!(
                "token id {t} at position {pos} is outside the embedding table of {rows} rows"
            )));
        }
        out.par_chunks_mut(dim)
            .zip(tokens.par_iter())
            .for_each(|(o, &t)| {
                let src = &table[t as usize * dim..][..dim];
                match acc {
                    Accumulate::Overwrite => o.copy_from_slice(src),
                    Accumulate::Add => o.iter_mut().zip(src).for_each(|(o, s)| *o += s),
                }
            });
        Ok(())
    }

    fn embedding_backward(&self, tokens: &[u32], dout: &[f32], dim: usize, dtable: &mut [f32]) {
        // Tokens repeat, so rows of dtable are shared between positions: scatter serially in
        // position order, which keeps the sum order fixed.
        for (t, g) in tokens.iter().zip(dout.chunks(dim)) {
            let row = &mut dtable[*t as usize * dim..][..dim];
            row.iter_mut().zip(g).for_each(|(r, g)| *r += g);
        }
    }

    fn cross_entropy_forward(
        &self,
        logits: &mut [f32],
        vocab: usize,
        targets: &[i32],
    ) -> Result<f64> {
        if let Some(&t) = targets
            .iter()
            .find(|&&t| t != IGNORE_INDEX && (t < 0 || t as usize >= vocab))
        {
            return Err(Error::Invalid(format!(
                "target id {t} is outside the vocabulary of {vocab} (use {IGNORE_INDEX} to ignore a position)"
            )));
        }
        let losses: Vec<f64> = logits
            .par_chunks_mut(vocab)
            .zip(targets.par_iter())
            .map(|(row, &t)| {
                let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
                let zt = if t == IGNORE_INDEX {
                    0.0
                } else {
                    row[t as usize] - max
                };
                // Separate passes: the exp loop vectorises, the ordered sum cannot.
                row.iter_mut().for_each(|v| *v = math::exp(*v - max));
                let sum: f32 = row.iter().sum();
                let inv = 1.0 / sum;
                let loss = if t == IGNORE_INDEX {
                    0.0
                } else {
                    // log-sum-exp minus the target logit, both shifted by the row max.
                    f64::from(sum.ln()) - f64::from(zt)
                };
                row.iter_mut().for_each(|v| *v *= inv);
                loss
            })
            .collect();
        Ok(losses.iter().sum())
    }

    fn cross_entropy_backward(&self, probs: &mut [f32], vocab: usize, targets: &[i32], g: f32) {
        probs
            .par_chunks_mut(vocab)
            .zip(targets.par_iter())
            .for_each(|(row, &t)| {
                if t == IGNORE_INDEX {
                    row.fill(0.0);
                    return;
                }
                row.iter_mut().for_each(|p| *p *= g);
                row[t as usize] -= g;
            });
    }
}
