//! Causal self-attention: the q/k/v projections (GPT-2's one fused product, or Llama's three
//! with grouped-query widths), RoPE on queries and keys when the architecture has it, the
//! backend's attention core, and the output projection.

use super::Dense;
use crate::backend::{
    Accumulate, AttentionGrads, AttentionShape, Backend, MemoryModel, Rope, Rotation, RowView,
};
use crate::nn::saved::saved_struct;
use crate::nn::{act, Grads, Params};
use crate::tensor::{Storage, View};
use crate::{Error, Result};

/// How queries, keys and values are projected.
#[derive(Debug, Clone, PartialEq)]
pub enum Qkv {
    /// One product whose output columns are q, k and v in turn (GPT-2's `c_attn`).
    Fused(Dense),
    /// Three products, q, k and v (Llama's `q_proj`, `k_proj`, `v_proj`).
    Split([Dense; 3]),
}

/// Causal self-attention over `[rows, width]` inputs.
#[derive(Debug, Clone, PartialEq)]
pub struct Attention {
    /// The q/k/v projections.
    pub qkv: Qkv,
    /// The output projection, `[q_heads · head_dim] → width`.
    pub o: Dense,
    /// Query heads.
    pub q_heads: usize,
    /// Key/value heads (fewer than the query heads: grouped-query attention).
    pub kv_heads: usize,
    /// Head width.
    pub head_dim: usize,
    /// Rotary position embedding of queries and keys (needs [`Qkv::Split`]).
    pub rope: Option<Rope>,
}

saved_struct!(
    /// What attention keeps for backward: q, k and v (one fused buffer or three; after
    /// RoPE), the core's own state and its output.
    AttnActs { qkv: Vec<Storage>, probs: Storage, att: Storage }
);

impl Attention {
    /// The core's shape for `batch` rows of `seq` tokens.
    pub fn shape(&self, batch: usize, seq: usize) -> AttentionShape {
        AttentionShape {
            batch,
            seq,
            q_heads: self.q_heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
        }
    }

    /// Query heads × head width: the core's output width.
    pub fn width(&self) -> usize {
        self.q_heads * self.head_dim
    }

    /// Widths of q, k and v.
    fn widths(&self) -> [usize; 3] {
        let kv = self.kv_heads * self.head_dim;
        [self.width(), kv, kv]
    }

    /// The widths of the projection buffers: one fused, or q, k and v.
    fn buffer_widths(&self) -> Vec<usize> {
        match self.qkv {
            Qkv::Fused(_) => vec![self.widths().iter().sum()],
            Qkv::Split(_) => self.widths().to_vec(),
        }
    }

    fn projections(&self) -> &[Dense] {
        match &self.qkv {
            Qkv::Fused(d) => std::slice::from_ref(d),
            Qkv::Split(d) => d,
        }
    }

    /// q, k and v as strided views of the projection buffers.
    fn views<'a>(&self, bufs: &'a [Storage]) -> [(View<'a>, RowView); 3] {
        let w = self.widths();
        match bufs {
            [fused] => {
                let stride = w.iter().sum();
                [0, w[0], w[0] + w[1]].map(|offset| (fused.view(), RowView { stride, offset }))
            }
            _ => [0, 1, 2].map(|i| {
                (
                    bufs[i].view(),
                    RowView {
                        stride: w[i],
                        offset: 0,
                    },
                )
            }),
        }
    }

    /// Buffers for the projections of `rows` rows (or their gradients).
    fn buffers(&self, be: &dyn Backend, rows: usize) -> Result<Vec<Storage>> {
        let widths = self.buffer_widths();
        widths.iter().map(|w| act(be, rows * w)).collect()
    }

    /// Rotates queries and keys (or their gradients) in place.
    fn rotate(
        &self,
        be: &dyn Backend,
        bufs: &mut [Storage],
        s: AttentionShape,
        dir: Rotation,
    ) -> Result<()> {
        let Some(rope) = &self.rope else {
            return Ok(());
        };
        match bufs {
            [q, k, _] => be.rope_qk(q.view_mut(), k.view_mut(), s, rope, dir),
            _ => Err(Error::Invalid("RoPE needs q and k projected apart".into())),
        }
    }

    /// Projects `x` to q, k, v and runs the core; the output is the returned state's `att`.
    pub(crate) fn forward(
        &self,
        be: &dyn Backend,
        p: &Params<'_>,
        x: View<'_>,
        shape: AttentionShape,
    ) -> Result<AttnActs> {
        let rows = shape.batch * shape.seq;
        let mut qkv = self.buffers(be, rows)?;
        for (d, buf) in self.projections().iter().zip(&mut qkv) {
            d.forward(be, p, x, buf.view_mut())?;
        }
        self.rotate(be, &mut qkv, shape, Rotation::Forward)?;
        let mut att = act(be, rows * self.width())?;
        let [q, k, v] = self.views(&qkv);
        let probs = be.attention_forward(shape, q, k, v, att.view_mut())?;
        Ok(AttnActs { qkv, probs, att })
    }

    /// The core's backward from `datt`: the gradients of q, k and v (before RoPE), in the
    /// projection buffers' layout.
    pub(crate) fn core_backward(
        &self,
        be: &dyn Backend,
        s: &AttnActs,
        datt: View<'_>,
        shape: AttentionShape,
    ) -> Result<Vec<Storage>> {
        let mut grads = self.buffers(be, shape.batch * shape.seq)?;
        let [q, k, v] = self.views(&s.qkv);
        let out = match grads.as_mut_slice() {
            [fused] => AttentionGrads::Fused(fused.view_mut()),
            [dq, dk, dv] => AttentionGrads::Split {
                dq: dq.view_mut(),
                dk: dk.view_mut(),
                dv: dv.view_mut(),
            },
            _ => {
                return Err(Error::Invalid(
                    "attention has one or three projections".into(),
                ))
            }
        };
        be.attention_backward(shape, q, k, v, s.att.view(), &s.probs, datt, out)?;
        self.rotate(be, &mut grads, shape, Rotation::Inverse)?;
        Ok(grads)
    }

    /// The projections' backward: `dx` overwritten with the input gradient, their weights'
    /// (and biases') gradients added from the input `x` forward saw.
    pub(crate) fn projections_backward(
        &self,
        be: &dyn Backend,
        (p, gr): (&Params<'_>, &mut Grads<'_>),
        x: View<'_>,
        dqkv: &[Storage],
        mut dx: crate::tensor::ViewMut<'_>,
    ) -> Result<()> {
        let each = self.projections().iter().zip(dqkv);
        for (i, (d, dy)) in each.clone().enumerate() {
            let acc = if i == 0 {
                Accumulate::Overwrite
            } else {
                Accumulate::Add
            };
            d.backward_input(be, p, dy.view(), dx.reborrow(), acc)?;
        }
        for (d, dy) in each {
            d.backward_params(be, gr, x, dy.view())?;
        }
        Ok(())
    }

    /// Bytes forward keeps for `rows` rows.
    pub(crate) fn saved_bytes(&self, shape: AttentionShape, m: &MemoryModel) -> usize {
        let rows = shape.batch * shape.seq;
        let qkv: usize = self
            .buffer_widths()
            .iter()
            .map(|w| m.act_bytes(rows * w))
            .sum();
        qkv + m.act_bytes(rows * self.width()) + m.attention_saved(shape)
    }

    /// Bytes of the q/k/v gradients for `rows` rows.
    pub(crate) fn grad_bytes(&self, rows: usize, m: &MemoryModel) -> usize {
        self.buffer_widths()
            .iter()
            .map(|w| m.act_bytes(rows * w))
            .sum()
    }
}
