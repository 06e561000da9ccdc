//! Embedding lookup/scatter, learned positions, and the language-model head's softmax
//! cross-entropy with ignore-index.

use rayon::prelude::*;

use super::simd::simd_kernel;
use super::{expect_len, f32_in, f32_out, math, CpuBackend};
use crate::backend::IGNORE_INDEX;
use crate::backend::{check, Accumulate, HeadLoss, HeadShape, MatmulShape, TokenOps, Transpose};
use crate::tensor::{spare, FlatBuf, Ids, Storage, View, ViewMut};
use crate::{Error, Result};

/// Host indices, or an error naming the operation.
fn host_ids<'a>(op: &'static str, ids: Ids<'a>) -> Result<&'a [i32]> {
    match ids {
        Ids::Host(v) => Ok(v),
        Ids::Cuda(_) => Err(Error::Invalid(format!(
            "{op}: the indices are in device memory; the CPU backend reads host indices"
        ))),
    }
}

/// `dtable[ids[i]] += dout[i]`, serially in position order: rows of `dtable` are shared
/// between positions, so a fixed order keeps the sums reproducible.
fn scatter_rows(ids: impl Iterator<Item = usize>, dout: &[f32], dim: usize, dtable: &mut [f32]) {
    for (t, g) in ids.zip(dout.chunks(dim)) {
        let row = &mut dtable[t * dim..][..dim];
        row.iter_mut().zip(g).for_each(|(r, g)| *r += g);
    }
}

/// The width of `[rows, dim]` data given its row count.
fn width(op: &'static str, len: usize, rows: usize) -> Result<usize> {
    check::exact_div(op, len, rows, || format!("{rows} whole rows"))
}

impl TokenOps for CpuBackend {
    fn embedding_forward(
        &self,
        tokens: Ids<'_>,
        table: View<'_>,
        dim: usize,
        out: ViewMut<'_>,
        acc: Accumulate,
    ) -> Result<()> {
        const OP: &str = "embedding";
        let tokens = host_ids(OP, tokens)?;
        let (table, out) = (f32_in(OP, "table", table)?, f32_out(OP, "out", out)?);
        expect_len(OP, "out", out.len(), tokens.len() * dim)?;
        let rows = table.len() / dim.max(1);
        check::token_ids(tokens, rows)?;
        out.par_chunks_mut(dim.max(1))
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

    fn embedding_backward(
        &self,
        tokens: Ids<'_>,
        dout: View<'_>,
        dim: usize,
        dtable: ViewMut<'_>,
    ) -> Result<()> {
        const OP: &str = "embedding backward";
        let tokens = host_ids(OP, tokens)?;
        let (dout, dtable) = (f32_in(OP, "dout", dout)?, f32_out(OP, "dtable", dtable)?);
        expect_len(OP, "dout", dout.len(), tokens.len() * dim)?;
        check::token_ids(tokens, dtable.len() / dim.max(1))?;
        scatter_rows(tokens.iter().map(|&t| t as usize), dout, dim, dtable);
        Ok(())
    }

    fn position_forward(
        &self,
        table: View<'_>,
        batch: usize,
        seq: usize,
        out: ViewMut<'_>,
    ) -> Result<()> {
        const OP: &str = "position embedding";
        let (table, out) = (f32_in(OP, "table", table)?, f32_out(OP, "out", out)?);
        let dim = width(OP, out.len(), batch * seq)?;
        check::positions(OP, table.len(), seq, dim)?;
        out.par_chunks_mut(dim.max(1))
            .enumerate()
            .for_each(|(r, o)| {
                let src = &table[(r % seq) * dim..][..dim];
                o.iter_mut().zip(src).for_each(|(o, s)| *o += s);
            });
        Ok(())
    }

    fn position_backward(
        &self,
        dout: View<'_>,
        batch: usize,
        seq: usize,
        dtable: ViewMut<'_>,
    ) -> Result<()> {
        const OP: &str = "position embedding backward";
        let (dout, dtable) = (f32_in(OP, "dout", dout)?, f32_out(OP, "dtable", dtable)?);
        let dim = width(OP, dout.len(), batch * seq)?;
        check::positions(OP, dtable.len(), seq, dim)?;
        scatter_rows((0..batch * seq).map(|i| i % seq), dout, dim, dtable);
        Ok(())
    }

    fn head_loss_forward(
        &self,
        shape: HeadShape,
        x: View<'_>,
        w: View<'_>,
        targets: Ids<'_>,
        keep: bool,
    ) -> Result<HeadLoss> {
        const OP: &str = "head loss";
        let targets = host_ids(OP, targets)?;
        let (x, w) = (f32_in(OP, "x", x)?, f32_in(OP, "weight", w)?);
        expect_len(OP, "targets", targets.len(), shape.rows)?;
        // Overwritten whole by the product; handed back after backward (or below).
        let mut logits = spare::take_f32(shape.rows * shape.vocab);
        self.matmul_host(
            logits_shape(shape),
            x,
            w,
            &mut logits,
            Accumulate::Overwrite,
        )?;
        let loss = self.cross_entropy_forward(&mut logits, shape.vocab, targets)?;
        let saved = if keep {
            Some(Storage::Host(FlatBuf::F32(logits)))
        } else {
            spare::give_f32(logits);
            None
        };
        Ok(HeadLoss {
            loss: Storage::from_f32(vec![loss as f32]),
            saved,
        })
    }

    fn head_loss_backward(
        &self,
        shape: HeadShape,
        x: View<'_>,
        w: View<'_>,
        targets: Ids<'_>,
        saved: Storage,
        g: f32,
        dx: ViewMut<'_>,
        dw: Option<ViewMut<'_>>,
    ) -> Result<()> {
        const OP: &str = "head loss backward";
        let targets = host_ids(OP, targets)?;
        let (x, w) = (f32_in(OP, "x", x)?, f32_in(OP, "weight", w)?);
        let dx = f32_out(OP, "dx", dx)?;
        let dw = dw.map(|d| f32_out(OP, "dweight", d)).transpose()?;
        let Storage::Host(FlatBuf::F32(mut dlogits)) = saved else {
            return Err(Error::Invalid(format!(
                "{OP}: the saved state is not the CPU's host probabilities"
            )));
        };
        expect_len(
            OP,
            "saved probabilities",
            dlogits.len(),
            shape.rows * shape.vocab,
        )?;
        expect_len(OP, "targets", targets.len(), shape.rows)?;
        check::head_grads(OP, shape, dx.len(), dw.as_ref().map(|d| d.len()))?;
        self.cross_entropy_backward(&mut dlogits, shape.vocab, targets, g);
        // dW += dlogitsᵀ · x ([vocab, dim]), then dx = dlogits · W.
        let dw_shape = MatmulShape {
            m: shape.vocab,
            n: shape.dim,
            k: shape.rows,
            ta: Transpose::Yes,
            tb: Transpose::No,
        };
        if let Some(dw) = dw {
            self.matmul_host(dw_shape, &dlogits, x, dw, Accumulate::Add)?;
        }
        let dx_shape = MatmulShape {
            m: shape.rows,
            n: shape.dim,
            k: shape.vocab,
            ta: Transpose::No,
            tb: Transpose::No,
        };
        let r = self.matmul_host(dx_shape, &dlogits, w, dx, Accumulate::Overwrite);
        spare::give_f32(dlogits);
        r
    }

    fn argmax_rows(&self, x: View<'_>, width: usize) -> Result<Vec<u32>> {
        let x = f32_in("argmax", "x", x)?;
        Ok(x.chunks(width.max(1))
            .map(|row| {
                let mut best = 0;
                for (i, &v) in row.iter().enumerate() {
                    if v > row[best] {
                        best = i;
                    }
                }
                best as u32
            })
            .collect())
    }
}

simd_kernel! {
    /// `v = e^(v - max)` element-wise.
    fn exp_shifted(row: &mut [f32], max: f32) {
        row.iter_mut().for_each(|v| *v = math::exp(*v - max));
    }
}

simd_kernel! {
    /// `v *= by` element-wise.
    fn scale(row: &mut [f32], by: f32) {
        row.iter_mut().for_each(|v| *v *= by);
    }
}

/// Logits `[rows, vocab] = x · wᵀ` with `w` stored `[vocab, dim]`.
fn logits_shape(s: HeadShape) -> MatmulShape {
    MatmulShape {
        m: s.rows,
        n: s.vocab,
        k: s.dim,
        ta: Transpose::No,
        tb: Transpose::Yes,
    }
}

/// Softmax cross-entropy on host logits, in place.
impl CpuBackend {
    /// Replaces `[rows, vocab]` logits by their softmax and returns the summed loss of the
    /// non-ignored rows (an f64 sum).
    fn cross_entropy_forward(
        &self,
        logits: &mut [f32],
        vocab: usize,
        targets: &[i32],
    ) -> Result<f64> {
        check::target_ids(targets, vocab)?;
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
                exp_shifted(row, max);
                let sum: f32 = row.iter().sum();
                let inv = 1.0 / sum;
                let loss = if t == IGNORE_INDEX {
                    0.0
                } else {
                    // log-sum-exp minus the target logit, both shifted by the row max.
                    f64::from(sum.ln()) - f64::from(zt)
                };
                scale(row, inv);
                loss
            })
            .collect();
        Ok(losses.iter().sum())
    }

    /// Turns the probabilities into `dlogits = g · (p - onehot)` in place; ignored rows
    /// become zero.
    fn cross_entropy_backward(&self, probs: &mut [f32], vocab: usize, targets: &[i32], g: f32) {
        probs
            .par_chunks_mut(vocab)
            .zip(targets.par_iter())
            .for_each(|(row, &t)| {
                if t == IGNORE_INDEX {
                    row.fill(0.0);
                    return;
                }
                scale(row, g);
                row[t as usize] -= g;
            });
    }
}
