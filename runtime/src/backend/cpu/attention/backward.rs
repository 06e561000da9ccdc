//! The attention backward, in the steps of the algorithm: check the saved probabilities and
//! the gradient buffers, then per (sequence, key/value head) task zero the head's dK/dV and
//! run each query head of its group through `dV += Pᵀ·dO`, `dP = dO·Vᵀ`, the softmax
//! backward (`dS`), `dQ = dS·K` and `dK += dSᵀ·Q`, row block by row block.

use rayon::prelude::*;

use super::super::{f32_in, f32_out, gemm_raw, SendPtr, StridedMat};
use super::{drop_grad, drop_probs, head, head_t, operand, row_blocks, rows, softmax_backward};
use super::{square, zero_head};
use crate::backend::{Accumulate, AttentionGrads, AttentionShape, RowView};
use crate::tensor::{Storage, View};
use crate::{Error, Result};

const OP: &str = "attention backward";

/// What every task reads: the operands with their row views, the saved probabilities, the
/// output gradient, and the gradients as pointers (the tasks write disjoint heads).
struct Backward<'a> {
    s: AttentionShape,
    q: (&'a [f32], RowView),
    k: (&'a [f32], RowView),
    v: (&'a [f32], RowView),
    probs: &'a [f32],
    dout: &'a [f32],
    /// The row view of `dout` (the forward's output layout).
    ov: RowView,
    dq: SendPtr,
    dk: SendPtr,
    dv: SendPtr,
    scale: f32,
}

/// Key/value head `kvh` of sequence `b`: its K and Vᵀ, and its dK and dV (accumulated over
/// the group's query heads).
struct KvHead {
    b: usize,
    kh: StridedMat,
    vt: StridedMat,
    dkh: StridedMat,
    dvh: StridedMat,
}

/// `AttentionOps::attention_backward` on the CPU.
#[allow(clippy::too_many_arguments)]
pub(super) fn attention_backward(
    s: AttentionShape,
    q: (View<'_>, RowView),
    k: (View<'_>, RowView),
    v: (View<'_>, RowView),
    saved: &Storage,
    dout: View<'_>,
    grads: AttentionGrads<'_>,
) -> Result<()> {
    let (q, k, v) = (
        operand(OP, "q", q)?,
        operand(OP, "k", k)?,
        operand(OP, "v", v)?,
    );
    let probs = f32_in(OP, "saved probabilities", saved.view())?;
    let dout = f32_in(OP, "dout", dout)?;
    s.check_heads(OP)?;
    check_saved(&s, probs)?;
    s.check_qkv(OP, [q.0.len(), k.0.len(), v.0.len()], (q.1, k.1, v.1))?;
    let ov = s.out_view();
    s.check_view(OP, "dout", dout.len(), ov, s.q_heads)?;
    grads.check(OP, &s, (q.1, k.1, v.1))?;
    let (dq, dk, dv) = grad_pointers(grads)?;
    let cx = Backward {
        s,
        q,
        k,
        v,
        probs,
        dout,
        ov,
        dq,
        dk,
        dv,
        scale: 1.0 / (s.head_dim as f32).sqrt(),
    };
    (0..s.batch * s.kv_heads)
        .into_par_iter()
        .for_each(|task| cx.kv_head(task / s.kv_heads, task % s.kv_heads));
    Ok(())
}

/// The forward saved one `[seq, seq]` probability block per (sequence, query head).
fn check_saved(s: &AttentionShape, probs: &[f32]) -> Result<()> {
    let want = s.batch * s.q_heads * s.seq * s.seq;
    if probs.len() != want {
        return Err(Error::Shape {
            op: OP,
            expected: format!("saved probabilities of {want} elements"),
            got: format!("{}", probs.len()),
        });
    }
    Ok(())
}

/// dQ, dK and dV as pointers (checked against their views by the caller): three views of one
/// fused buffer, or three buffers.
fn grad_pointers(grads: AttentionGrads<'_>) -> Result<(SendPtr, SendPtr, SendPtr)> {
    match grads {
        AttentionGrads::Fused(buf) => {
            let buf = f32_out(OP, "dqkv", buf)?;
            let p = SendPtr(buf.as_mut_ptr());
            Ok((p, p, p))
        }
        AttentionGrads::Split { dq, dk, dv } => {
            let (dq, dk, dv) = (
                f32_out(OP, "dq", dq)?,
                f32_out(OP, "dk", dk)?,
                f32_out(OP, "dv", dv)?,
            );
            Ok((
                SendPtr(dq.as_mut_ptr()),
                SendPtr(dk.as_mut_ptr()),
                SendPtr(dv.as_mut_ptr()),
            ))
        }
    }
}

impl Backward<'_> {
    /// One task: key/value head `kvh` of sequence `b` and the query heads of its group.
    fn kv_head(&self, b: usize, kvh: usize) {
        let (s, t, d) = (&self.s, self.s.seq, self.s.head_dim);
        let mut dp = vec![0.0f32; t * t];
        let mut dropped = s.dropout.map(|_| vec![0.0f32; t * t]);
        let kv = KvHead {
            b,
            kh: head(self.k.0.as_ptr(), self.k.1, s, b, kvh),
            vt: head_t(self.v.0.as_ptr(), self.v.1, s, b, kvh),
            dkh: head(self.dk.get(), self.k.1, s, b, kvh),
            dvh: head(self.dv.get(), self.v.1, s, b, kvh),
        };
        // SAFETY: bounds checked by `attention_backward`; this task alone writes kv head kvh
        // of dK/dV and the group's heads of dQ for sequence b.
        unsafe {
            zero_head(kv.dkh, t, d);
            zero_head(kv.dvh, t, d);
        }
        let group = s.q_heads / s.kv_heads;
        for h in kvh * group..(kvh + 1) * group {
            self.query_head(&kv, h, &mut dp, dropped.as_deref_mut());
        }
    }

    /// Query head `h` of `kv`'s group: `dp` is its `[seq, seq]` scratch for dP, then dS;
    /// `dropped`, with dropout, scratch for the dropped probabilities forward multiplied V by.
    fn query_head(&self, kv: &KvHead, h: usize, dp: &mut [f32], dropped: Option<&mut [f32]>) {
        let (s, b, t) = (&self.s, kv.b, self.s.seq);
        let tt = t * t;
        let p = &self.probs[(b * s.q_heads + h) * tt..][..tt];
        let do_h = head(self.dout.as_ptr(), self.ov, s, b, h);
        let pv: &[f32] = match (&s.dropout, dropped) {
            (Some(dr), Some(pd)) => {
                drop_probs(dr, s, (b, h), p, pd);
                pd
            }
            _ => p,
        };
        // SAFETY: as in `kv_head`.
        unsafe { self.value_and_prob_grads(kv, pv, do_h, dp) };
        if let Some(dr) = &s.dropout {
            // rowsum(P ∘ dP ∘ M/(1-p)) is rowsum(dO ∘ O), so the softmax backward is unchanged.
            drop_grad(dr, s, (b, h), dp);
        }
        softmax_backward(p, dp, t, self.scale);
        let qh = head(self.q.0.as_ptr(), self.q.1, s, b, h);
        let dqh = head(self.dq.get(), self.q.1, s, b, h);
        // SAFETY: as in `kv_head`.
        unsafe { self.query_and_key_grads(kv, dp, qh, dqh) };
    }

    /// `dV += Pᵀ·dO` (P as forward multiplied V by) and `dP = dO·Vᵀ`, per row block (only
    /// the causal columns).
    ///
    /// # Safety
    /// The views must be in bounds and this task the only writer of `kv`'s dV.
    unsafe fn value_and_prob_grads(
        &self,
        kv: &KvHead,
        p: &[f32],
        do_h: StridedMat,
        dp: &mut [f32],
    ) {
        let (t, d) = (self.s.seq, self.s.head_dim);
        for (r0, r1) in row_blocks(t) {
            let pt = StridedMat {
                ptr: p.as_ptr().wrapping_add(r0 * t),
                rs: 1,
                cs: t as isize,
            };
            let dpr = rows(square(dp.as_mut_ptr(), t), r0);
            // SAFETY: guaranteed by the caller; `dp` is this task's own scratch.
            unsafe {
                gemm_raw(
                    r1,
                    d,
                    r1 - r0,
                    kv.dvh,
                    pt,
                    rows(do_h, r0),
                    (Accumulate::Add, 1.0),
                    1,
                );
                gemm_raw(
                    r1 - r0,
                    r1,
                    d,
                    dpr,
                    rows(do_h, r0),
                    kv.vt,
                    (Accumulate::Overwrite, 1.0),
                    1,
                );
            }
        }
    }

    /// `dQ = dS·K` and `dK += dSᵀ·Q`, per row block (only the causal columns).
    ///
    /// # Safety
    /// The views must be in bounds and this task the only writer of `dqh` and `kv`'s dK.
    unsafe fn query_and_key_grads(&self, kv: &KvHead, ds: &[f32], qh: StridedMat, dqh: StridedMat) {
        let (t, d) = (self.s.seq, self.s.head_dim);
        for (r0, r1) in row_blocks(t) {
            let dsr = rows(square(ds.as_ptr(), t), r0);
            let dst = StridedMat {
                ptr: ds.as_ptr().wrapping_add(r0 * t),
                rs: 1,
                cs: t as isize,
            };
            // SAFETY: guaranteed by the caller.
            unsafe {
                gemm_raw(
                    r1 - r0,
                    d,
                    r1,
                    rows(dqh, r0),
                    dsr,
                    kv.kh,
                    (Accumulate::Overwrite, 1.0),
                    1,
                );
                gemm_raw(
                    r1,
                    d,
                    r1 - r0,
                    kv.dkh,
                    dst,
                    rows(qh, r0),
                    (Accumulate::Add, 1.0),
                    1,
                );
            }
        }
    }
}
