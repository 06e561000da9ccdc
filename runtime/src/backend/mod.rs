//! Compute backends: one trait per family of operations (matmul, elementwise, normalisation,
//! attention, token ops), so a device can implement them family by family, as burn does.
//!
//! Every kernel works on caller-owned flat f32 slices (activations and engine-lent parameter
//! views) and never allocates its outputs: the layers decide what is kept for backward.
//! Backward kernels that produce parameter gradients *accumulate* (+=), matching the
//! [`crate::nn::Grads`] contract; input gradients are overwritten unless stated.
//!
//! The CPU backend ([`CpuBackend`]) runs on the caller's current rayon pool: the engine runs
//! each local rank inside its own pool, so kernels must never build or use a global pool.

mod cpu;
pub mod cuda;
pub mod rng;

use std::sync::Arc;

pub use cpu::CpuBackend;

use crate::Result;

/// Whether an operand of a matrix product is used as stored or transposed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transpose {
    /// As stored (row-major).
    No,
    /// Transposed.
    Yes,
}

/// Whether a kernel overwrites its destination or adds to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accumulate {
    /// `dst = result`.
    Overwrite,
    /// `dst += result`.
    Add,
}

/// Shape of `C[m, n] = op(A) · op(B)` with `op(A)` of shape `[m, k]` and `op(B)` `[k, n]`.
/// A stored untransposed is `[m, k]`, transposed `[k, m]`; likewise B is `[k, n]` or `[n, k]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatmulShape {
    /// Rows of the result.
    pub m: usize,
    /// Columns of the result.
    pub n: usize,
    /// Contraction length.
    pub k: usize,
    /// How A is used.
    pub ta: Transpose,
    /// How B is used.
    pub tb: Transpose,
}

/// A matrix operand in one of the storage dtypes (e.g. a bf16 parameter copy).
#[derive(Debug, Clone, Copy)]
pub enum Operand<'a> {
    /// Single precision.
    F32(&'a [f32]),
    /// bfloat16.
    Bf16(&'a [half::bf16]),
    /// IEEE half.
    F16(&'a [half::f16]),
}

impl Operand<'_> {
    /// Elements.
    pub fn len(&self) -> usize {
        match self {
            Operand::F32(s) => s.len(),
            Operand::Bf16(s) => s.len(),
            Operand::F16(s) => s.len(),
        }
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The values widened to f32 (exact: every bf16/f16 value is an f32).
    pub fn to_f32(&self) -> std::borrow::Cow<'_, [f32]> {
        use half::slice::HalfFloatSliceExt;
        match self {
            Operand::F32(s) => std::borrow::Cow::Borrowed(s),
            Operand::Bf16(s) => std::borrow::Cow::Owned(s.to_f32_vec()),
            Operand::F16(s) => std::borrow::Cow::Owned(s.to_f32_vec()),
        }
    }
}

/// Dense matrix products with f32 accumulation.
pub trait MatmulOps {
    /// `C (=|+=) op(A) · op(B)`; checks slice lengths against the shape.
    fn matmul(
        &self,
        shape: MatmulShape,
        a: &[f32],
        b: &[f32],
        c: &mut [f32],
        acc: Accumulate,
    ) -> Result<()>;

    /// [`MatmulOps::matmul`] with bf16/f16/f32 inputs, accumulated and written in f32. The
    /// default widens half-precision inputs once (exactly) and runs the f32 product; a
    /// device with native half-precision kernels overrides it.
    fn matmul_mixed(
        &self,
        shape: MatmulShape,
        a: Operand<'_>,
        b: Operand<'_>,
        c: &mut [f32],
        acc: Accumulate,
    ) -> Result<()> {
        self.matmul(shape, &a.to_f32(), &b.to_f32(), c, acc)
    }
}

/// Pointwise operations and dropout.
pub trait ElementwiseOps {
    /// `y = gelu_tanh(x)`.
    fn gelu_forward(&self, x: &[f32], y: &mut [f32]);
    /// `dx = dy · gelu_tanh'(x)`.
    fn gelu_backward(&self, x: &[f32], dy: &[f32], dx: &mut [f32]);
    /// `y = silu(gate) · up`.
    fn swiglu_forward(&self, gate: &[f32], up: &[f32], y: &mut [f32]);
    /// Gradients of [`ElementwiseOps::swiglu_forward`] into `dgate` and `dup` (overwritten).
    fn swiglu_backward(
        &self,
        gate: &[f32],
        up: &[f32],
        dy: &[f32],
        dgate: &mut [f32],
        dup: &mut [f32],
    );
    /// `dst += src` (residual connections).
    fn add_assign(&self, dst: &mut [f32], src: &[f32]);
    /// Inverted dropout in place: each element is zeroed with probability `p` and otherwise
    /// scaled by `1/(1-p)`; the mask is a pure function of `(seed, index)`, so backward
    /// applies the same mask to the gradient by calling this again with the same seed.
    fn dropout(&self, seed: u64, p: f32, x: &mut [f32]);
}

/// Row-wise normalisations over the last dimension of `[rows, dim]` data.
pub trait NormOps {
    /// LayerNorm; writes `y`, the per-row `mean` and reciprocal std `rstd`.
    #[allow(clippy::too_many_arguments)]
    fn layernorm_forward(
        &self,
        x: &[f32],
        gamma: &[f32],
        beta: &[f32],
        eps: f32,
        y: &mut [f32],
        mean: &mut [f32],
        rstd: &mut [f32],
    );
    /// LayerNorm backward: `dx` overwritten, `dgamma`/`dbeta` accumulated.
    #[allow(clippy::too_many_arguments)]
    fn layernorm_backward(
        &self,
        x: &[f32],
        gamma: &[f32],
        mean: &[f32],
        rstd: &[f32],
        dy: &[f32],
        dx: &mut [f32],
        dgamma: &mut [f32],
        dbeta: &mut [f32],
    );
    /// RMSNorm (`y = x · rstd · gamma`); writes `y` and per-row `rstd`.
    fn rmsnorm_forward(&self, x: &[f32], gamma: &[f32], eps: f32, y: &mut [f32], rstd: &mut [f32]);
    /// RMSNorm backward: `dx` overwritten, `dgamma` accumulated.
    fn rmsnorm_backward(
        &self,
        x: &[f32],
        gamma: &[f32],
        rstd: &[f32],
        dy: &[f32],
        dx: &mut [f32],
        dgamma: &mut [f32],
    );
}

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

/// Scaled dot-product attention and rotary position embedding.
pub trait AttentionOps {
    /// Causal attention `O = softmax(Q Kᵀ / √d + mask) V`; `probs` receives the softmax
    /// (`[batch, q_heads, seq, seq]`, needed by backward), `out` is `[batch*seq, q_heads*head_dim]`.
    #[allow(clippy::too_many_arguments)]
    fn attention_forward(
        &self,
        shape: AttentionShape,
        q: (&[f32], RowView),
        k: (&[f32], RowView),
        v: (&[f32], RowView),
        probs: &mut [f32],
        out: &mut [f32],
    ) -> Result<()>;
    /// Attention backward: writes dQ, dK, dV into the same strided views of `dq`, `dk`, `dv`
    /// (overwritten; they may be one fused buffer when the views do not overlap).
    #[allow(clippy::too_many_arguments)]
    fn attention_backward(
        &self,
        shape: AttentionShape,
        q: (&[f32], RowView),
        k: (&[f32], RowView),
        v: (&[f32], RowView),
        probs: &[f32],
        dout: &[f32],
        dqkv: AttentionGrads<'_>,
    ) -> Result<()>;
    /// Rotary embedding in place on `[batch*seq, heads*head_dim]` (Hugging Face's
    /// rotate-half convention: element `i` pairs with `i + head_dim/2`). `direction` Inverse
    /// rotates by `-θ`, which is the backward of Forward.
    #[allow(clippy::too_many_arguments)]
    fn rope(
        &self,
        x: &mut [f32],
        batch: usize,
        seq: usize,
        heads: usize,
        head_dim: usize,
        theta: f32,
        direction: Rotation,
    );
}

/// Destinations of attention's backward.
pub enum AttentionGrads<'a> {
    /// One buffer holding dQ, dK and dV at the views' strides and offsets (GPT-2's fused qkv).
    Fused(&'a mut [f32]),
    /// Three separate buffers with the views' layouts (Llama's q/k/v projections).
    Split {
        /// dQ.
        dq: &'a mut [f32],
        /// dK.
        dk: &'a mut [f32],
        /// dV.
        dv: &'a mut [f32],
    },
}

/// Direction of a rotary embedding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rotation {
    /// Rotate by `+θ·pos` (forward).
    Forward,
    /// Rotate by `-θ·pos` (backward).
    Inverse,
}

/// Token-indexed operations: embeddings and the loss.
pub trait TokenOps {
    /// `out[t] (=|+=) table[tokens[t]]`; fails on a token id outside the table.
    fn embedding_forward(
        &self,
        tokens: &[u32],
        table: &[f32],
        dim: usize,
        out: &mut [f32],
        acc: Accumulate,
    ) -> Result<()>;
    /// `dtable[tokens[t]] += dout[t]` (serial per table row for determinism).
    fn embedding_backward(&self, tokens: &[u32], dout: &[f32], dim: usize, dtable: &mut [f32]);
    /// Softmax cross-entropy with ignore-index over `[rows, vocab]` logits, replaced in place
    /// by the probabilities; returns the **sum** of the losses of non-ignored rows (f64 sum).
    fn cross_entropy_forward(
        &self,
        logits: &mut [f32],
        vocab: usize,
        targets: &[i32],
    ) -> Result<f64>;
    /// Turns the probabilities from forward into `dlogits = g · (p - onehot)` in place;
    /// ignored rows become zero.
    fn cross_entropy_backward(&self, probs: &mut [f32], vocab: usize, targets: &[i32], g: f32);
}

/// A device: all operation families together.
pub trait Backend:
    MatmulOps + ElementwiseOps + NormOps + AttentionOps + TokenOps + Send + Sync
{
    /// Short name, e.g. `cpu`.
    fn name(&self) -> &'static str;
}

/// Which device to compute on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKind {
    /// Host CPU (multi-threaded on the current rayon pool).
    Cpu,
    /// NVIDIA GPU through CUDA.
    Cuda,
}

/// The backend for `kind`, or [`crate::Error::Unavailable`] when this build or machine lacks it.
pub fn select(kind: DeviceKind) -> Result<Arc<dyn Backend>> {
    match kind {
        DeviceKind::Cpu => Ok(cpu()),
        DeviceKind::Cuda => cuda::open(),
    }
}

/// The CPU backend.
pub fn cpu() -> Arc<dyn Backend> {
    Arc::new(CpuBackend)
}
