//! Causal scaled dot-product attention with grouped-query heads, and rotary embeddings.
//!
//! One rayon task per (sequence, key/value head): the query heads of a group run in that
//! task, so the group's dK/dV accumulate without races, and each per-head product is a
//! single-threaded gemm on strided views (no transposition copies). The backward's steps are
//! in `backward`. With probability dropout the forward keeps the undropped P and multiplies V
//! by a dropped copy; backward redraws the same mask from its counter instead of reading it.

mod backward;

use rayon::prelude::*;

use super::simd::simd_kernel;
use super::{f32_in, f32_out, gemm_raw, math, CpuBackend, SendPtr, StridedMat};
use crate::backend::attention_ops::check_rope;
use crate::backend::{
    Accumulate, AttentionGrads, AttentionOps, AttentionShape, AttnDropout, Rope, Rotation, RowView,
};
use crate::tensor::{FlatBuf, Storage, View, ViewMut};
use crate::Result;

/// A host f32 operand with its row view.
fn operand<'a>(
    op: &'static str,
    what: &str,
    x: (View<'a>, RowView),
) -> Result<(&'a [f32], RowView)> {
    Ok((f32_in(op, what, x.0)?, x.1))
}

/// Head `h` of sequence `b` in view `v`, as a `[seq, head_dim]` strided matrix.
fn head(base: *const f32, v: RowView, s: &AttentionShape, b: usize, h: usize) -> StridedMat {
    let off = b * s.seq * v.stride + v.offset + h * s.head_dim;
    StridedMat {
        ptr: base.wrapping_add(off),
        rs: v.stride as isize,
        cs: 1,
    }
}

/// The same head, transposed (`[head_dim, seq]`).
fn head_t(base: *const f32, v: RowView, s: &AttentionShape, b: usize, h: usize) -> StridedMat {
    let m = head(base, v, s, b, h);
    StridedMat {
        ptr: m.ptr,
        rs: m.cs,
        cs: m.rs,
    }
}

fn square(ptr: *const f32, t: usize) -> StridedMat {
    StridedMat {
        ptr,
        rs: t as isize,
        cs: 1,
    }
}

/// Query rows per block of the causal products: block `[r0, r1)` only needs keys `[0, r1)`,
/// which skips most of the masked upper triangle.
const ROW_BLOCK: usize = 32;

fn row_blocks(t: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..t)
        .step_by(ROW_BLOCK)
        .map(move |r0| (r0, (r0 + ROW_BLOCK).min(t)))
}

/// The view starting `r0` rows further down.
fn rows(m: StridedMat, r0: usize) -> StridedMat {
    StridedMat {
        ptr: m.ptr.wrapping_offset(r0 as isize * m.rs),
        ..m
    }
}

/// Zeroes a `[t, d]` row-strided head view.
///
/// # Safety
/// The view must be valid for writes of `t` rows of `d` contiguous elements.
unsafe fn zero_head(m: StridedMat, t: usize, d: usize) {
    for r in 0..t {
        // SAFETY: guaranteed by the caller.
        unsafe {
            std::ptr::write_bytes(m.ptr.wrapping_offset(r as isize * m.rs) as *mut f32, 0, d)
        };
    }
}

simd_kernel! {
    /// Turns `dP` into `dS = P ∘ (dP - rowsum(dP ∘ P)) · scale` in place, zeroing the masked
    /// part (whose dP entries were never computed or are not needed).
    fn softmax_backward(p: &[f32], dp: &mut [f32], t: usize, scale: f32) {
        for (i, (prow, dprow)) in p.chunks(t).zip(dp.chunks_mut(t)).enumerate() {
            let (live, masked) = dprow.split_at_mut(i + 1);
            let dot: f32 = prow[..=i].iter().zip(live.iter()).map(|(a, b)| a * b).sum();
            for (x, &pv) in live.iter_mut().zip(prow) {
                *x = pv * (*x - dot) * scale;
            }
            masked.fill(0.0);
        }
    }
}

simd_kernel! {
    /// Scales, masks and softmaxes each row of a `[t, t]` score block in place.
    fn causal_softmax(p: &mut [f32], t: usize, scale: f32) {
        for (i, row) in p.chunks_mut(t).enumerate() {
            let (live, masked) = row.split_at_mut(i + 1);
            let max = live.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) * scale;
            live.iter_mut()
                .for_each(|v| *v = math::exp(*v * scale - max));
            let sum: f32 = live.iter().sum();
            let inv = 1.0 / sum;
            live.iter_mut().for_each(|v| *v *= inv);
            masked.fill(0.0);
        }
    }
}

/// `out = P ∘ M / (1-p)` for the `[t, t]` probabilities `p` of head `h` of sequence `b`
/// (the masked upper triangle zero, as in `p`).
fn drop_probs(
    dr: &AttnDropout,
    s: &AttentionShape,
    (b, h): (usize, usize),
    p: &[f32],
    out: &mut [f32],
) {
    let (t, scale) = (s.seq, dr.scale());
    for (i, (prow, orow)) in p.chunks(t).zip(out.chunks_mut(t)).enumerate() {
        for (j, (o, &pv)) in orow.iter_mut().zip(prow).enumerate() {
            *o = if j <= i && dr.keep(s, (b, h, i, j)) {
                pv * scale
            } else {
                0.0
            };
        }
    }
}

/// `dP ∘ M / (1-p)` in place on the causal part of head `h` of sequence `b`: the gradient
/// reaching the probabilities through the same mask forward drew.
fn drop_grad(dr: &AttnDropout, s: &AttentionShape, (b, h): (usize, usize), dp: &mut [f32]) {
    let (t, scale) = (s.seq, dr.scale());
    for (i, row) in dp.chunks_mut(t).enumerate() {
        for (j, g) in row[..=i].iter_mut().enumerate() {
            *g = if dr.keep(s, (b, h, i, j)) {
                *g * scale
            } else {
                0.0
            };
        }
    }
}

/// One query head's operands in a forward: Q, Kᵀ and V of its kv head, and its output.
struct Heads {
    q: StridedMat,
    kt: StridedMat,
    v: StridedMat,
    o: StridedMat,
}

/// Head `h` of sequence `b`: scores into `p` (its `[t, t]` block), the causal softmax, then
/// `O = P·V`, through `dropped` (scratch for `P ∘ M / (1-p)`) when `s` has dropout.
///
/// # Safety
/// The heads must be in bounds and the caller the only writer of `m.o`.
unsafe fn head_forward(
    s: &AttentionShape,
    (b, h): (usize, usize),
    m: Heads,
    p: &mut [f32],
    dropped: Option<&mut [f32]>,
) {
    let (t, d) = (s.seq, s.head_dim);
    for (r0, r1) in row_blocks(t) {
        let pr = rows(square(p.as_ptr(), t), r0);
        // SAFETY: guaranteed by the caller; `p` is exclusively borrowed.
        unsafe {
            gemm_raw(
                r1 - r0,
                r1,
                d,
                pr,
                rows(m.q, r0),
                m.kt,
                (Accumulate::Overwrite, 1.0),
                1,
            )
        };
    }
    causal_softmax(p, t, 1.0 / (d as f32).sqrt());
    let pv = match (&s.dropout, dropped) {
        (Some(dr), Some(pd)) => {
            drop_probs(dr, s, (b, h), p, pd);
            pd.as_ptr()
        }
        _ => p.as_ptr(),
    };
    for (r0, r1) in row_blocks(t) {
        let pr = rows(square(pv, t), r0);
        // SAFETY: guaranteed by the caller.
        unsafe {
            gemm_raw(
                r1 - r0,
                d,
                r1,
                rows(m.o, r0),
                pr,
                m.v,
                (Accumulate::Overwrite, 1.0),
                1,
            )
        };
    }
}

impl AttentionOps for CpuBackend {
    fn attention_forward(
        &self,
        s: AttentionShape,
        q: (View<'_>, RowView),
        k: (View<'_>, RowView),
        v: (View<'_>, RowView),
        out: ViewMut<'_>,
    ) -> Result<Storage> {
        const OP: &str = "attention";
        let (q, k, v) = (
            operand(OP, "q", q)?,
            operand(OP, "k", k)?,
            operand(OP, "v", v)?,
        );
        let out = f32_out(OP, "out", out)?;
        s.check_heads(OP)?;
        s.check_qkv(OP, [q.0.len(), k.0.len(), v.0.len()], (q.1, k.1, v.1))?;
        let (t, hq, ov) = (s.seq, s.q_heads, s.out_view());
        s.check_view(OP, "out", out.len(), ov, hq)?;
        let tt = t * t;
        // The CPU keeps the probabilities for backward: the per-head products are small and
        // recomputing them would cost more than the memory.
        // Every element is written: the products fill each row up to the diagonal and the
        // softmax zeroes the masked rest, so a reused buffer needs no fill.
        let mut probs = crate::tensor::spare::take_f32(s.batch * hq * tt);
        let group = hq / s.kv_heads;
        let out_ptr = SendPtr(out.as_mut_ptr());
        probs
            .par_chunks_mut(group * tt)
            .enumerate()
            .for_each(|(task, pg)| {
                let (b, kvh) = (task / s.kv_heads, task % s.kv_heads);
                // With dropout the product reads a dropped copy; `probs` keeps P for backward.
                let mut dropped = s.dropout.map(|_| vec![0.0f32; tt]);
                for (g, p) in pg.chunks_mut(tt).enumerate() {
                    let h = kvh * group + g;
                    let heads = Heads {
                        q: head(q.0.as_ptr(), q.1, &s, b, h),
                        kt: head_t(k.0.as_ptr(), k.1, &s, b, kvh),
                        v: head(v.0.as_ptr(), v.1, &s, b, kvh),
                        o: head(out_ptr.get(), ov, &s, b, h),
                    };
                    // SAFETY: views were bounds-checked; this task alone writes head h of
                    // sequence b in `out` and its own probs block.
                    unsafe { head_forward(&s, (b, h), heads, p, dropped.as_deref_mut()) };
                }
            });
        Ok(Storage::Host(FlatBuf::F32(probs)))
    }

    fn attention_backward(
        &self,
        s: AttentionShape,
        q: (View<'_>, RowView),
        k: (View<'_>, RowView),
        v: (View<'_>, RowView),
        _out: View<'_>,
        saved: &Storage,
        dout: View<'_>,
        grads: AttentionGrads<'_>,
    ) -> Result<()> {
        backward::attention_backward(s, q, k, v, saved, dout, grads)
    }

    fn rope(
        &self,
        x: ViewMut<'_>,
        batch: usize,
        seq: usize,
        heads: usize,
        head_dim: usize,
        rope: &Rope,
        dir: Rotation,
    ) -> Result<()> {
        let x = f32_out("rope", "x", x)?;
        check_rope("x", x.len(), (batch, seq, head_dim), heads)?;
        super::rope::apply(x, (batch, seq, heads, head_dim), rope, dir);
        Ok(())
    }
}
