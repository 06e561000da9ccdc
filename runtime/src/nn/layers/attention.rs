//! Causal self-attention: the q/k/v projections (GPT-2's one fused product, or Llama's three
//! with grouped-query widths), RoPE on queries and keys when the architecture has it, the
//! backend's attention core, and the output projection.

use super::lora::Draw;
use super::Dense;
use crate::backend::{Accumulate, AttentionGrads, AttentionShape, AttnDropout, Backend};
use crate::backend::{Rope, Rotation, RowView};
use crate::nn::saved::saved_struct;
use crate::nn::{act, Grads, Params};
use crate::tensor::{Storage, View, ViewMut};
use crate::{Error, Result};

/// Causal self-attention over `[rows, width]` inputs.
#[derive(Debug, Clone, PartialEq)]
pub struct Attention {
    /// The q/k/v projections: one fused product whose output columns are q, k and v in turn
    /// (GPT-2's `c_attn`), or three (Llama's `q_proj`, `k_proj`, `v_proj`).
    pub qkv: Vec<Dense>,
    /// The output projection, `[q_heads · head_dim] → width`.
    pub o: Dense,
    /// Query heads.
    pub q_heads: usize,
    /// Key/value heads (fewer than the query heads: grouped-query attention).
    pub kv_heads: usize,
    /// Head width.
    pub head_dim: usize,
    /// Rotary position embedding of queries and keys (needs them projected apart).
    pub rope: Option<Rope>,
    /// Dropout on the attention probabilities while training (0: none).
    pub pdrop: f32,
}

saved_struct!(
    /// What attention keeps for backward: the projections' outputs (q, k and v, after
    /// RoPE), the core's own state and its output.
    AttnActs { qkv: Vec<Storage>, probs: Storage, att: Storage }
);

impl Attention {
    /// The core's shape for `batch` rows of `seq` tokens.
    pub fn shape(&self, batch: usize, seq: usize) -> AttentionShape {
        let (q_heads, kv_heads, head_dim) = (self.q_heads, self.kv_heads, self.head_dim);
        AttentionShape {
            batch,
            seq,
            q_heads,
            kv_heads,
            head_dim,
            dropout: None,
        }
    }

    /// `s` with this layer's probability dropout drawn from `seed` with its counters from
    /// `offset` ([`AttnDropout`]); unchanged when `pdrop` is 0, so training without dropout
    /// does no extra work.
    pub fn with_dropout(&self, s: AttentionShape, (seed, offset): (u64, u64)) -> AttentionShape {
        let dropout = (self.pdrop > 0.0).then_some(AttnDropout {
            seed,
            offset,
            p: self.pdrop,
        });
        AttentionShape { dropout, ..s }
    }

    /// Query heads × head width: the core's output width.
    pub fn width(&self) -> usize {
        self.q_heads * self.head_dim
    }

    /// q, k and v as strided views of the projections' outputs.
    fn views<'a>(&self, bufs: &'a [Storage]) -> [(View<'a>, RowView); 3] {
        let (q, kv) = (self.width(), self.kv_heads * self.head_dim);
        let at = |b: &'a Storage, stride, offset| (b.view(), RowView { stride, offset });
        match bufs {
            [f] => [0, q, q + kv].map(|offset| at(f, q + 2 * kv, offset)),
            _ => [(0, q), (1, kv), (2, kv)].map(|(i, w)| at(&bufs[i], w, 0)),
        }
    }

    /// Buffers for the projections' outputs over `rows` rows (or their gradients).
    fn buffers(&self, be: &dyn Backend, rows: usize) -> Result<Vec<Storage>> {
        self.qkv
            .iter()
            .map(|d| act(be, rows * d.lin.d_out))
            .collect()
    }

    /// Rotates queries and keys (or their gradients) in place.
    fn rotate(
        &self,
        be: &dyn Backend,
        qkv: &mut [Storage],
        s: AttentionShape,
        dir: Rotation,
    ) -> Result<()> {
        match (&self.rope, qkv) {
            (None, _) => Ok(()),
            (Some(rope), [q, k, _]) => be.rope_qk(q.view_mut(), k.view_mut(), s, rope, dir),
            _ => Err(Error::Invalid("RoPE needs q and k projected apart".into())),
        }
    }

    /// Projects `x` to q, k, v and runs the core; the output is the returned state's `att`.
    pub(crate) fn forward(
        &self,
        be: &dyn Backend,
        p: &Params<'_>,
        x: View<'_>,
        (s, drop): (AttentionShape, Option<Draw>),
    ) -> Result<AttnActs> {
        let rows = s.batch * s.seq;
        let mut qkv = self.buffers(be, rows)?;
        for (d, buf) in self.qkv.iter().zip(&mut qkv) {
            d.forward(be, p, (x, None), buf.view_mut(), drop)?;
        }
        self.rotate(be, &mut qkv, s, Rotation::Forward)?;
        let mut att = act(be, rows * self.width())?;
        let [q, k, v] = self.views(&qkv);
        let probs = be.attention_forward(s, q, k, v, att.view_mut())?;
        Ok(AttnActs { qkv, probs, att })
    }

    /// The core's backward from `datt`: the gradients at the projections' outputs.
    pub(crate) fn core_backward(
        &self,
        be: &dyn Backend,
        a: &AttnActs,
        datt: View<'_>,
        s: AttentionShape,
    ) -> Result<Vec<Storage>> {
        let mut grads = self.buffers(be, s.batch * s.seq)?;
        let [q, k, v] = self.views(&a.qkv);
        let out = match grads.as_mut_slice() {
            [fused] => AttentionGrads::Fused(fused.view_mut()),
            [dq, dk, dv] => {
                let (dq, dk, dv) = (dq.view_mut(), dk.view_mut(), dv.view_mut());
                AttentionGrads::Split { dq, dk, dv }
            }
            _ => {
                return Err(Error::Invalid(
                    "attention has one or three projections".into(),
                ))
            }
        };
        be.attention_backward(s, q, k, v, a.att.view(), &a.probs, datt, out)?;
        self.rotate(be, &mut grads, s, Rotation::Inverse)?;
        Ok(grads)
    }

    /// The projections' backward from their outputs' gradients: `dx` overwritten with the
    /// input gradient, their parameters' gradients added from the input `x` forward saw.
    pub(crate) fn projections_backward(
        &self,
        be: &dyn Backend,
        (p, gr): (&Params<'_>, &mut Grads<'_>),
        (x, dqkv): (View<'_>, &[Storage]),
        (mut dx, drop): (ViewMut<'_>, Option<Draw>),
    ) -> Result<()> {
        for (i, (d, dy)) in self.qkv.iter().zip(dqkv).enumerate() {
            let acc = [Accumulate::Overwrite, Accumulate::Add][usize::from(i > 0)];
            d.backward_input(be, p, dy.view(), (dx.reborrow(), acc), drop)?;
        }
        for (d, dy) in self.qkv.iter().zip(dqkv) {
            d.backward_params(be, (p, gr), (x, dy.view()), drop)?;
        }
        Ok(())
    }
}
