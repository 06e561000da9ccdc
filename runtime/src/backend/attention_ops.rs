//! The attention family: scaled dot-product attention over strided Q/K/V views (plain and
//! grouped-query heads), its backward, and rotary embeddings applied to Q and K.

use super::{Rope, Rotation};
use crate::tensor::{Storage, View, ViewMut};
use crate::Result;

/// Layout of an attention call: `batch` rows of `seq` tokens; query head `h` reads key/value
/// head `h / (q_heads / kv_heads)` (grouped-query attention; equal counts give plain MHA).
/// Q, K, V rows are strided views: token `t` of head `h` starts at `t * stride + offset + h * head_dim`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionShape {
    /// Sequences.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Query heads.
    pub q_heads: usize,
    /// Key/value heads (divides `q_heads`).
    pub kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Dropout on the probabilities (training only; `None` costs nothing).
    pub dropout: Option<AttnDropout>,
}

/// Dropout on the attention probabilities, as transformers applies it: `O = (P ∘ M / (1-p)) V`.
/// Element (sequence `b`, query head `h`, query `i`, key `j`) is kept when
/// [`rng::uniform_f32`](super::rng::uniform_f32)`(seed, offset + ((b·q_heads + h)·seq + i)·seq + j)`
/// (wrapping in 64 bits) is at least `p`: a pure function of its position, so forward and
/// backward, every backend and every tiling agree without storing the mask, and a batch whose
/// `offset` is `R·q_heads·seq²` draws the masks of sequences `R..` of a larger one.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttnDropout {
    /// The stream the mask is drawn from.
    pub seed: u64,
    /// The counter of element `(0, 0, 0, 0)`: the engine's global index of the batch's first
    /// sequence times `q_heads·seq²`.
    pub offset: u64,
    /// Drop probability, in `(0, 1)`.
    pub p: f32,
}

// Equality is total here: `p` is a validated probability, never NaN.
impl Eq for AttnDropout {}

impl AttnDropout {
    /// Whether element `(b, h, i, j)` of `s`'s probabilities survives.
    #[inline]
    pub fn keep(&self, s: &AttentionShape, (b, h, i, j): (usize, usize, usize, usize)) -> bool {
        let t = s.seq as u64;
        let index = ((b * s.q_heads + h) as u64 * t + i as u64) * t + j as u64;
        let index = self.offset.wrapping_add(index);
        super::rng::uniform_f32(self.seed, index) >= self.p
    }

    /// The factor kept elements are scaled by.
    pub fn scale(&self) -> f32 {
        1.0 / (1.0 - self.p)
    }
}

impl AttentionShape {
    /// Every backend's rule for the head counts: kv heads dividing q heads, a head dim.
    pub(crate) fn check_heads(&self, op: &'static str) -> crate::Result<()> {
        if self.kv_heads == 0 || !self.q_heads.is_multiple_of(self.kv_heads) || self.head_dim == 0 {
            return Err(crate::Error::Invalid(format!(
                "{op} needs kv_heads dividing q_heads and head_dim > 0, got {} q heads, {} kv \
                 heads, head_dim {}",
                self.q_heads, self.kv_heads, self.head_dim
            )));
        }
        Ok(())
    }

    /// Every backend's rule for a strided row view of `len` elements: `batch * seq` rows of
    /// `stride` elements, the heads' columns `[offset, offset + heads * head_dim)` inside each.
    pub(crate) fn check_view(
        &self,
        op: &'static str,
        name: &str,
        len: usize,
        v: RowView,
        heads: usize,
    ) -> crate::Result<()> {
        let rows = self.batch * self.seq;
        let need = if rows == 0 {
            0
        } else {
            (rows - 1) * v.stride + v.offset + heads * self.head_dim
        };
        if len >= need && v.offset + heads * self.head_dim <= v.stride {
            return Ok(());
        }
        Err(crate::Error::Shape {
            op,
            expected: format!(
                "{name}: {rows} rows of stride {} holding {heads} heads of {} at offset {}",
                v.stride, self.head_dim, v.offset
            ),
            got: format!("{len} elements"),
        })
    }
}

impl AttentionShape {
    /// `[rows, q_heads * head_dim]` packed: the layout of the output and its gradient.
    pub(crate) fn out_view(&self) -> RowView {
        RowView {
            stride: self.q_heads * self.head_dim,
            offset: 0,
        }
    }

    /// [`AttentionShape::check_view`] of Q, K and V, of `lens` elements, against their views.
    pub(crate) fn check_qkv(
        &self,
        op: &'static str,
        [q, k, v]: [usize; 3],
        (qv, kv, vv): (RowView, RowView, RowView),
    ) -> crate::Result<()> {
        self.check_view(op, "q", q, qv, self.q_heads)?;
        self.check_view(op, "k", k, kv, self.kv_heads)?;
        self.check_view(op, "v", v, vv, self.kv_heads)
    }
}

/// Every backend's check of a rotary embedding's buffer: `len` elements are `batch * seq` rows
/// of `heads` heads of an even `head_dim`.
pub(crate) fn check_rope(
    what: &str,
    len: usize,
    (batch, seq, head_dim): (usize, usize, usize),
    heads: usize,
) -> Result<()> {
    if head_dim.is_multiple_of(2) && len == batch * seq * heads * head_dim {
        return Ok(());
    }
    Err(crate::Error::Shape {
        op: "rope",
        expected: format!(
            "{what}: {batch}x{seq} rows of {heads} heads of an even head_dim {head_dim}"
        ),
        got: format!("{len} elements"),
    })
}

/// A strided `[batch * seq, heads * head_dim]` view inside a larger row (e.g. the q, k or v
/// third of GPT-2's fused `c_attn` output).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowView {
    /// Elements between consecutive tokens.
    pub stride: usize,
    /// Offset of head 0 within a token's row.
    pub offset: usize,
}

/// Causal scaled dot-product attention and rotary position embedding.
pub trait AttentionOps {
    /// Causal attention `O = softmax(Q Kᵀ / √d + mask) V` into `out`
    /// (`[batch*seq, q_heads*head_dim]`); returns what backward needs besides Q, K, V and O
    /// (the CPU: the probabilities; a flash-attention device: per-row log-sum-exp).
    fn attention_forward(
        &self,
        shape: AttentionShape,
        q: (View<'_>, RowView),
        k: (View<'_>, RowView),
        v: (View<'_>, RowView),
        out: ViewMut<'_>,
    ) -> Result<Storage>;
    /// Attention backward from forward's output `out`, its saved state and `dout`: writes dQ,
    /// dK, dV into the same strided views of `dq`, `dk`, `dv` (overwritten; they may be one
    /// fused buffer when the views do not overlap).
    #[allow(clippy::too_many_arguments)]
    fn attention_backward(
        &self,
        shape: AttentionShape,
        q: (View<'_>, RowView),
        k: (View<'_>, RowView),
        v: (View<'_>, RowView),
        out: View<'_>,
        saved: &Storage,
        dout: View<'_>,
        dqkv: AttentionGrads<'_>,
    ) -> Result<()>;
    /// Rotary embedding in place on `[batch*seq, heads*head_dim]` (Hugging Face's
    /// rotate-half convention: element `i` pairs with `i + head_dim/2`). `direction` Inverse
    /// rotates by `-θ`, which is the backward of Forward. The angles are [`Rope::angles`]'s
    /// on every backend.
    #[allow(clippy::too_many_arguments)]
    fn rope(
        &self,
        x: ViewMut<'_>,
        batch: usize,
        seq: usize,
        heads: usize,
        head_dim: usize,
        rope: &Rope,
        direction: Rotation,
    ) -> Result<()>;
    /// [`AttentionOps::rope`] on the queries and the keys of one attention call at once (one
    /// launch on a device): `q` holds `shape.q_heads` heads per row, `k` `shape.kv_heads`; the
    /// same arithmetic as two `rope` calls, so the bits are theirs (by default: those calls).
    fn rope_qk(
        &self,
        q: ViewMut<'_>,
        k: ViewMut<'_>,
        s: AttentionShape,
        rope: &Rope,
        direction: Rotation,
    ) -> Result<()> {
        let (b, t, d) = (s.batch, s.seq, s.head_dim);
        check_rope("q", q.len(), (b, t, d), s.q_heads)?;
        check_rope("k", k.len(), (b, t, d), s.kv_heads)?;
        self.rope(q, b, t, s.q_heads, d, rope, direction)?;
        self.rope(k, b, t, s.kv_heads, d, rope, direction)
    }
}

/// Destinations of attention's backward.
#[derive(Debug)]
pub enum AttentionGrads<'a> {
    /// One buffer holding dQ, dK and dV at the views' strides and offsets (GPT-2's fused qkv).
    Fused(ViewMut<'a>),
    /// Three separate buffers with the views' layouts (Llama's q/k/v projections).
    Split {
        /// dQ.
        dq: ViewMut<'a>,
        /// dK.
        dk: ViewMut<'a>,
        /// dV.
        dv: ViewMut<'a>,
    },
}

impl AttentionGrads<'_> {
    /// Every backend's check of the gradients' destinations against the views of Q, K and V:
    /// each view inside its buffer, and in one fused buffer (written concurrently) a shared
    /// stride and disjoint head columns.
    pub(crate) fn check(
        &self,
        op: &'static str,
        s: &AttentionShape,
        (q, k, v): (RowView, RowView, RowView),
    ) -> crate::Result<()> {
        let lens = match self {
            AttentionGrads::Fused(buf) => [buf.len(); 3],
            AttentionGrads::Split { dq, dk, dv } => [dq.len(), dk.len(), dv.len()],
        };
        s.check_view(op, "dq", lens[0], q, s.q_heads)?;
        s.check_view(op, "dk", lens[1], k, s.kv_heads)?;
        s.check_view(op, "dv", lens[2], v, s.kv_heads)?;
        if matches!(self, AttentionGrads::Split { .. }) {
            return Ok(());
        }
        let cols = |r: RowView, heads: usize| (r.offset, r.offset + heads * s.head_dim);
        let spans = [cols(q, s.q_heads), cols(k, s.kv_heads), cols(v, s.kv_heads)];
        let same_stride = q.stride == k.stride && k.stride == v.stride;
        let overlap = |a: (usize, usize), b: (usize, usize)| a.0 < b.1 && b.0 < a.1;
        if same_stride
            && !overlap(spans[0], spans[1])
            && !overlap(spans[0], spans[2])
            && !overlap(spans[1], spans[2])
        {
            return Ok(());
        }
        Err(crate::Error::Invalid(format!(
            "{op}: fused dq/dk/dv views must share one stride and hold disjoint columns, got q \
             {q:?}, k {k:?}, v {v:?}"
        )))
    }
}
