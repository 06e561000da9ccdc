//! Compute backends: one trait per family of operations (matmul, elementwise, normalisation,
//! attention, token ops), so a device can implement them family by family, as burn does.
//!
//! Operations take [`View`]s and [`ViewMut`]s (borrowed elements on the backend's device) and
//! write caller-allocated outputs; layers allocate through [`MemoryOps`] (never `vec!`) and
//! decide what is kept for backward. Backward operations that produce parameter gradients
//! *accumulate* (+=), matching the [`crate::nn::Grads`] contract; input gradients are
//! overwritten unless stated. An operation handed a view it cannot read (another device, a
//! dtype it does not take, a wrong length) returns an error naming the operation, never panics.
//!
//! Where the best algorithm differs by device (attention, the loss head), the operation
//! returns an opaque [`Storage`] of what backward needs, so the CPU may keep probabilities
//! while a GPU keeps only per-row statistics; layers store it without looking inside.
//!
//! The CPU backend ([`CpuBackend`]) runs on the caller's current rayon pool (the global one,
//! which local ranks share, unless the caller installs its own), so kernels never build a pool
//! of their own, and give the same bits whatever the pool's size. Pools per local rank were
//! measured (2 ranks on 2 cores, GPT 6x384): no change in tokens/s (0.99x), so ranks share.

mod activity;
mod attention_ops;
mod check;
mod cpu;
pub mod cuda;
pub mod memory;
pub mod meta;
pub mod rng;
mod rope;
mod status;
pub mod stream;

use std::sync::Arc;

pub use activity::{DeviceActivity, DeviceMemory};
pub use attention_ops::{AttentionGrads, AttentionOps, AttentionShape, AttnDropout, RowView};
pub use cpu::CpuBackend;
/// The device arm of storage, views and ids, under names that tensors use without naming a
/// device backend: the CUDA backend's (uninhabited in a build without CUDA memory).
pub use cuda::{
    CudaBuf as DeviceBuf, CudaIds as DeviceIds, CudaView as DeviceView,
    CudaViewMut as DeviceViewMut,
};
pub use memory::MemoryModel;
pub use meta::MetaBackend;
pub use rope::{Rope, RopeScaling};
pub use status::{ClipRule, GradView, StepStatus, StepTensor};
pub use stream::{Stream, StreamEvent, StreamOps};

use crate::tensor::{BufRef, DType, FlatBuf, IdBuf, Ids, Storage, View, ViewMut};
use crate::Result;

/// Target value that contributes no loss (as in PyTorch's cross-entropy); the token
/// operations skip it, and `nn` re-exports it for the layers.
pub const IGNORE_INDEX: i32 = -100;

/// Reduction operator of a collective (the device's rank-ordered sums compute it, so it lives
/// here; `comm` re-exports it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    /// Sum in rank order.
    Sum,
    /// Sum in rank order, then divide by the world size.
    Avg,
    /// Element-wise maximum.
    Max,
}

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

impl MatmulShape {
    /// The length of the bias gradient [`Epilogue::AccumulateBiasGrad`] takes from operand
    /// `of`; refused unless the operand is stored `[k, len]` (A used transposed, B as stored),
    /// the only layout whose column sums cuBLASLt's BGRADA/BGRADB reduce.
    pub fn bias_grad_len(&self, of: Operand) -> Result<usize> {
        match (of, self.ta, self.tb) {
            (Operand::A, Transpose::Yes, _) => Ok(self.m),
            (Operand::B, _, Transpose::No) => Ok(self.n),
            _ => Err(crate::Error::Invalid(format!(
                "matmul: a bias gradient of operand {of:?} needs it stored [k, len] (A used \
                 transposed, B as stored); got ta = {:?}, tb = {:?}",
                self.ta, self.tb
            ))),
        }
    }
}

/// What a matrix product does with its result.
#[derive(Debug)]
pub enum Epilogue<'a> {
    /// `C = A·B`.
    Store,
    /// `C += A·B`.
    Accumulate,
    /// `C += alpha·A·B`: a low-rank adapter's branch, scaled by `lora_alpha / r` in the
    /// product itself.
    ScaledAccumulate(f32),
    /// `C = A·B + bias`, the bias (length `n`) added to every row.
    Bias(View<'a>),
    /// `pre = A·B + bias` and `C = gelu_tanh(pre)` (both written; backward needs `pre`).
    BiasGelu {
        /// The bias, length `n`.
        bias: View<'a>,
        /// Receives the pre-activation, `[m, n]` like `C`.
        pre: ViewMut<'a>,
    },
    /// `C += A·B` and `bias_grad += Σ_l` over the contraction of the operand `of`, which must be
    /// stored `[k, len]` (A used transposed, B as stored): a linear layer's weight gradient
    /// and, from the output gradient in the same product, its bias gradient.
    AccumulateBiasGrad {
        /// Which operand holds the output gradient.
        of: Operand,
        /// The bias gradient (f32, length `m` for A, `n` for B), accumulated.
        bias_grad: ViewMut<'a>,
    },
    /// `C = residual + A·B (+ bias)`, overwritten: a projection written over the residual
    /// stream it adds to, in one product on a device (cuBLASLt reads the residual as its C
    /// with beta = 1 and writes D, the bias in its epilogue). On the CPU exactly the steps
    /// layers took before: with a bias, the biased product then `add_assign` of the residual;
    /// without, a copy of the residual then the accumulating product.
    Residual {
        /// The residual stream, `[m, n]` like `C` and of its dtype.
        residual: View<'a>,
        /// The bias, length `n`.
        bias: Option<View<'a>>,
    },
    /// `C = (A·B) ⊙ gelu_tanh'(pre)` and `bias_grad += Σ_rows C`: the gradient through the
    /// next layer and the GELU that [`Epilogue::BiasGelu`] applied, with the gradient of the
    /// bias that produced `pre`, in one product.
    GeluBackwardBiasGrad {
        /// The pre-activation saved by [`Epilogue::BiasGelu`], `[m, n]` like `C`.
        pre: View<'a>,
        /// The bias gradient (f32, length `n`), accumulated.
        bias_grad: ViewMut<'a>,
    },
}

/// One operand of a matrix product.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operand {
    /// The left operand.
    A,
    /// The right operand.
    B,
}

/// Allocation, copies and the activation dtype: what layers need instead of `vec!`.
pub trait MemoryOps {
    /// The dtype activations are computed in on this device (the CPU: always f32).
    fn act_dtype(&self) -> DType;
    /// A zero-filled buffer of `len` elements on this device.
    fn zeros(&self, dtype: DType, len: usize) -> Result<Storage>;
    /// A copy of host values on this device (for device memory: an explicit host-to-device copy).
    fn upload(&self, src: BufRef<'_>) -> Result<Storage>;
    /// Integer indices (token ids, targets) copied to where this backend reads them.
    fn upload_ids(&self, ids: &[i32]) -> Result<IdBuf>;
    /// A copy of `src` (on this device) in new storage of the same dtype.
    fn copy(&self, src: View<'_>) -> Result<Storage>;
    /// The dtype layers read parameters in, given their storage dtype (the CPU widens bf16 and
    /// f16 to f32 once per gather; a GPU reads them as stored).
    fn param_dtype(&self, storage: DType) -> DType;
    /// A zero-filled engine buffer (parameters, gradients, optimizer state, communication
    /// buffers) on this device; hand transient ones back with [`MemoryOps::recycle`].
    fn buffer(&self, dtype: DType, len: usize) -> Result<Storage>;
    /// A buffer (an engine transient or a layer's activation) whose every element the caller
    /// overwrites before reading: no fill, and on the CPU a reused allocation when one of this
    /// size was recycled.
    fn buffer_uninit(&self, dtype: DType, len: usize) -> Result<Storage>;
    /// Hands back a transient buffer or an activation that died, so that a later one of the
    /// same size reuses its memory (the CPU: the thread's buffer cache; a GPU: its caching
    /// allocator).
    fn recycle(&self, buf: Storage);
    /// Host values as an engine buffer on this device (the CPU keeps the allocation; a device
    /// uploads it: an explicit copy).
    fn adopt(&self, host: FlatBuf) -> Result<Storage>;
    /// Storage as an engine buffer on this device: host storage is adopted
    /// ([`MemoryOps::adopt`]), storage already in device memory is kept as it is.
    fn adopt_storage(&self, s: Storage) -> Result<Storage> {
        match s {
            Storage::Host(host) => self.adopt(host),
            device => Ok(device),
        }
    }
    /// A zero-filled buffer of `len` elements in host memory (offloaded state, host copies of
    /// parameters): the host beside this device. A size-only device's host is size-only too.
    fn host_zeros(&self, dtype: DType, len: usize) -> Result<Storage> {
        Ok(Storage::Host(FlatBuf::zeros(dtype, len)))
    }
    /// The backend that computes on [`MemoryOps::host_zeros`]'s memory (the optimizer step of
    /// offloaded state): the CPU backend beside a real device; a size-only device is its own.
    fn host_backend(&self) -> &dyn Backend {
        &CpuBackend
    }
    /// The NVMe store a run on this device swaps through (`offload_optimizer` or
    /// `offload_param` with `device = "nvme"`): the directory `dir`, taken and opened; a
    /// size-only device's store has no directory and no files and keeps only lengths.
    fn nvme_store(
        &self,
        dir: &std::path::Path,
        settings: &ferrozero_offload::store::AioSettings,
    ) -> Result<ferrozero_offload::store::NvmeStore> {
        Ok(ferrozero_offload::store::NvmeStore::open(dir, settings)?)
    }
    /// `count` host buffers of `size` bytes that NVMe tiles move through, locked in RAM when
    /// `pinning` asks; a size-only device never locks them (they are mapped and never
    /// touched, so they cost no memory).
    fn host_pool(
        &self,
        count: usize,
        size: usize,
        pinning: ferrozero_offload::pool::Pinning,
    ) -> Result<ferrozero_offload::pool::BufferPool> {
        Ok(ferrozero_offload::pool::BufferPool::new(
            count, size, pinning,
        )?)
    }
    /// Page-locks host memory `b` for fast copies to and from this device, when the device
    /// has a bus to cross and its driver agrees (best effort: `None` otherwise, and copies
    /// stay correct); the memory stays registered while the guard lives.
    fn pin_host(&self, b: &mut FlatBuf) -> Option<crate::tensor::in_flight::HostPin> {
        let _ = b;
        None
    }
    /// [`MemoryOps::pin_host`] for a size-only host buffer ([`MemoryOps::host_zeros`] of a
    /// size-only device): nothing to register, but the bytes are counted as registered, so a
    /// size-only run prices the page-locked memory the real one would hold.
    fn pin_meta_host(
        &self,
        b: &crate::tensor::meta::MetaBuf,
    ) -> Option<crate::tensor::in_flight::HostPin> {
        let _ = b;
        None
    }
    /// Caps the bytes this device's own allocator may hand out (`device_memory_limit`). The
    /// CPU has no device allocator: the engine's ledger enforces the cap there (and on every
    /// device besides).
    fn set_memory_limit(&self, limit: Option<u64>) -> Result<()> {
        let _ = limit;
        Ok(())
    }
    /// Device memory as the device's own allocator counts it, when it has one (the CPU has
    /// none: the engine's ledger is its only count).
    fn memory_stats(&self) -> Option<DeviceMemory> {
        None
    }
    /// Host bytes the device page-locked for its own copies (staging buffers, the upload
    /// ring); memory the caller registered ([`MemoryOps::pin_host`]) is the caller's to
    /// count. The CPU locks none.
    fn page_locked_bytes(&self) -> u64 {
        0
    }
    /// What this device keeps in memory for training (layers' saved state, working copies,
    /// allocation rounding): the description the estimator prices a run with. The default is
    /// the CPU's.
    fn memory_model(&self) -> MemoryModel {
        MemoryModel::cpu()
    }
    /// What the device was asked to do since it was opened, counted by its driver (the CPU
    /// has no driver: `None`). Differences of two readings give per-step figures.
    fn activity(&self) -> Option<DeviceActivity> {
        None
    }
}

/// The update rule of one optimizer step, its hyper-parameters resolved for the step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum UpdateRule {
    /// Adam or AdamW.
    Adam(ferrozero_offload::optim::AdamHyper),
    /// SGD with momentum.
    Sgd(ferrozero_offload::optim::SgdHyper),
    /// Lion.
    Lion(ferrozero_offload::optim::LionHyper),
}

/// The optimizer step, on the device that holds the optimizer state.
pub trait OptimizerOps {
    /// One step (`step` 1-based) over a run of elements: the f32 `params` (master weights in
    /// mixed precision) from `grads` (any dtype, read as [`GradView`] says, multiplied by
    /// `grad_scale` first), the f32
    /// moments `m` and, for Adam, `v` (empty otherwise); when `lp` is given the updated
    /// values are also written there, rounded to its dtype. Every element is computed alike
    /// whatever its position, so a shard updated alone equals the full update bit for bit.
    #[allow(clippy::too_many_arguments)]
    fn optimizer_update(
        &self,
        rule: &UpdateRule,
        step: u64,
        grad_scale: f32,
        params: ViewMut<'_>,
        grads: GradView<'_>,
        m: ViewMut<'_>,
        v: ViewMut<'_>,
        lp: Option<ViewMut<'_>>,
    ) -> Result<()>;

    /// [`OptimizerOps::optimizer_update`] of every tensor with one `grad_scale`: a device
    /// updates them all in one launch. The same bits as one call per tensor.
    fn optimizer_update_all(
        &self,
        rule: &UpdateRule,
        step: u64,
        grad_scale: f32,
        tensors: Vec<StepTensor<'_>>,
    ) -> Result<()> {
        for t in tensors {
            self.optimizer_update(rule, step, grad_scale, t.params, t.grads, t.m, t.v, t.lp)?;
        }
        Ok(())
    }

    /// The values a step decides on, read back to the host together: each micro-step's loss
    /// (a one-element view) and each gradient's sum of squares in f64 (of its values as
    /// [`GradView`] reads them), summed in the order its length fixes (as
    /// `Storage::sum_squares` over the accumulator they stand for, so the same bits, finite
    /// exactly when every element is). A device computes the sums where the gradients live and
    /// downloads everything in one copy: the step's one wait for it. Views in host memory are
    /// read on the host.
    fn step_status(&self, losses: &[View<'_>], grads: &[GradView<'_>]) -> Result<StepStatus>;

    /// A whole step at one rank: the status of `losses` and `grads` (as
    /// [`OptimizerOps::step_status`]), the gradient scale decided from it by `clip` (no update
    /// when the sums overflowed), and `rule`'s update of every tensor with that scale; the
    /// status comes back with the scale applied (`grad_scale`). A device decides where the
    /// gradients live and updates every tensor in one launch, so its one wait for the
    /// device, the status's download, comes after the update. The result equals
    /// `step_status`, [`ClipRule::decide`] and `optimizer_update` in turn, bit for bit.
    fn whole_step(
        &self,
        (rule, step, clip): (&UpdateRule, u64, ClipRule),
        losses: &[View<'_>],
        grads: &[GradView<'_>],
        tensors: Vec<StepTensor<'_>>,
    ) -> Result<StepStatus> {
        status::whole_step_by_parts(self, (rule, step, clip), losses, grads, tensors)
    }

    /// LAMB's first pass over a run of one parameter tensor's elements
    /// (`ferrozero_offload::optim::lamb_moments`): the f32 moments `m` and `v` updated from
    /// `grads` (read as [`GradView`] says, times `grad_scale`), the f32 weights `params` read
    /// only; returns the run's sums of squares of the weights and of the update direction, in
    /// f64 in the order the run's length fixes. A device without it refuses.
    fn lamb_moments(
        &self,
        hp: &ferrozero_offload::optim::LambHyper,
        grad_scale: f32,
        (params, grads): (View<'_>, GradView<'_>),
        m: ViewMut<'_>,
        v: ViewMut<'_>,
    ) -> Result<(f64, f64)> {
        let _ = (hp, grad_scale, params, grads, m, v);
        Err(lamb_unavailable())
    }

    /// LAMB's second pass over a run of one tensor's elements
    /// (`ferrozero_offload::optim::lamb_apply`): `params -= step_size * coeff * u`, `u`
    /// recomputed from `m`, `v` and the weights; `lp` written as in
    /// [`OptimizerOps::optimizer_update`]. A device without it refuses.
    fn lamb_apply(
        &self,
        (hp, step, coeff): (&ferrozero_offload::optim::LambHyper, u64, f32),
        params: ViewMut<'_>,
        (m, v): (View<'_>, View<'_>),
        lp: Option<ViewMut<'_>>,
    ) -> Result<()> {
        let _ = (hp, step, coeff, params, m, v, lp);
        Err(lamb_unavailable())
    }
}

/// The error of a device whose optimizer kernels have no LAMB.
pub fn lamb_unavailable() -> crate::Error {
    crate::Error::Unavailable {
        what: "optimizer.type = \"Lamb\" with the optimizer state in device memory",
        why: "LAMB runs where the optimizer state is in host memory: set \
              zero_optimization.offload_optimizer.device = \"cpu\""
            .into(),
    }
}

/// Dense matrix products with f32 accumulation.
pub trait MatmulOps {
    /// `C (=|+=) op(A) · op(B)` with the epilogue; checks lengths against the shape. Operands
    /// may be f32, bf16 or f16 (the product always accumulates in f32); `C` is in the
    /// activation dtype.
    fn matmul(
        &self,
        shape: MatmulShape,
        a: View<'_>,
        b: View<'_>,
        c: ViewMut<'_>,
        epilogue: Epilogue<'_>,
    ) -> Result<()>;
}

/// Pointwise operations, dropout and the row reductions layers need.
pub trait ElementwiseOps {
    /// `y = gelu_tanh(x)`.
    fn gelu_forward(&self, x: View<'_>, y: ViewMut<'_>) -> Result<()>;
    /// `dx = dy · gelu_tanh'(x)`.
    fn gelu_backward(&self, x: View<'_>, dy: View<'_>, dx: ViewMut<'_>) -> Result<()>;
    /// `y = silu(gate) · up`.
    fn swiglu_forward(&self, gate: View<'_>, up: View<'_>, y: ViewMut<'_>) -> Result<()>;
    /// Gradients of [`ElementwiseOps::swiglu_forward`] into `dgate` and `dup` (overwritten).
    fn swiglu_backward(
        &self,
        gate: View<'_>,
        up: View<'_>,
        dy: View<'_>,
        dgate: ViewMut<'_>,
        dup: ViewMut<'_>,
    ) -> Result<()>;
    /// `dst += src` (residual connections).
    fn add_assign(&self, dst: ViewMut<'_>, src: View<'_>) -> Result<()>;
    /// Inverted dropout in place: each element is zeroed with probability `p` and otherwise
    /// scaled by `1/(1-p)`. Element `i` is kept when
    /// [`rng::uniform_f32`]`(seed, offset + i)` (wrapping) is at least `p`: a pure function
    /// of `(seed, counter)`, so backward applies the same mask to the gradient by calling this
    /// again with the same arguments, every device draws the same mask, and a buffer holding
    /// rows `R..` of a larger one draws that one's mask when `offset` is `R` times the
    /// elements per row.
    fn dropout(&self, seed: u64, offset: u64, p: f32, x: ViewMut<'_>) -> Result<()>;
    /// `acc[j] += Σ_i m[i, j]` over `[rows, cols]` data, in a fixed order (bias gradients).
    fn sum_rows(&self, m: View<'_>, cols: usize, acc: ViewMut<'_>) -> Result<()>;
}

/// Row-wise normalisations over the last dimension of `[rows, dim]` data; the per-row
/// statistics are f32 whatever the activation dtype.
pub trait NormOps: ElementwiseOps {
    /// LayerNorm; writes `y`, the per-row `mean` and reciprocal std `rstd`.
    #[allow(clippy::too_many_arguments)]
    fn layernorm_forward(
        &self,
        x: View<'_>,
        gamma: View<'_>,
        beta: View<'_>,
        eps: f32,
        y: ViewMut<'_>,
        mean: ViewMut<'_>,
        rstd: ViewMut<'_>,
    ) -> Result<()>;
    /// LayerNorm backward: `dx` overwritten, `dgamma`/`dbeta` accumulated.
    #[allow(clippy::too_many_arguments)]
    fn layernorm_backward(
        &self,
        x: View<'_>,
        gamma: View<'_>,
        mean: View<'_>,
        rstd: View<'_>,
        dy: View<'_>,
        dx: ViewMut<'_>,
        dgamma: ViewMut<'_>,
        dbeta: ViewMut<'_>,
    ) -> Result<()>;
    /// RMSNorm (`y = x · rstd · gamma`); writes `y` and per-row `rstd`.
    fn rmsnorm_forward(
        &self,
        x: View<'_>,
        gamma: View<'_>,
        eps: f32,
        y: ViewMut<'_>,
        rstd: ViewMut<'_>,
    ) -> Result<()>;
    /// RMSNorm backward: `dx` overwritten, `dgamma` accumulated.
    fn rmsnorm_backward(
        &self,
        x: View<'_>,
        gamma: View<'_>,
        rstd: View<'_>,
        dy: View<'_>,
        dx: ViewMut<'_>,
        dgamma: ViewMut<'_>,
    ) -> Result<()>;
    /// A residual connection and the LayerNorm after it in one pass over the residual stream
    /// (llm.c's `fused_residual_forward`): `sum = x + residual` (a copy of `x` when `residual`
    /// is `None`), then [`NormOps::layernorm_forward`] of `sum`. `sum`, `y`, `mean` and `rstd`
    /// are overwritten. Computed as `add_assign` then `layernorm_forward` would (a device rounds
    /// `sum` to the activation dtype before normalising it), so fusing changes no bit.
    #[allow(clippy::too_many_arguments)]
    fn residual_layernorm_forward(
        &self,
        x: View<'_>,
        residual: Option<View<'_>>,
        gamma: View<'_>,
        beta: View<'_>,
        eps: f32,
        sum: ViewMut<'_>,
        y: ViewMut<'_>,
        stats: (ViewMut<'_>, ViewMut<'_>),
    ) -> Result<()>;
    /// [`NormOps::residual_layernorm_forward`] for RMSNorm: `sum = x (+ residual)`, then
    /// [`NormOps::rmsnorm_forward`] of `sum`; `sum`, `y` and `rstd` overwritten.
    #[allow(clippy::too_many_arguments)]
    fn residual_rmsnorm_forward(
        &self,
        x: View<'_>,
        residual: Option<View<'_>>,
        gamma: View<'_>,
        eps: f32,
        sum: ViewMut<'_>,
        y: ViewMut<'_>,
        rstd: ViewMut<'_>,
    ) -> Result<()>;
    /// [`NormOps::layernorm_backward`] whose input gradient also receives the gradient that
    /// reached the same residual stream around the norm: `dx = LN's dx + dresidual`
    /// (overwritten; on a device LN's dx is rounded to the activation dtype before the add, as
    /// the separate `add_assign` would see it), `dgamma`/`dbeta` accumulated.
    /// By default exactly the two calls it replaces.
    #[allow(clippy::too_many_arguments)]
    fn layernorm_backward_residual(
        &self,
        x: View<'_>,
        gamma: View<'_>,
        (mean, rstd): (View<'_>, View<'_>),
        dy: View<'_>,
        dresidual: View<'_>,
        mut dx: ViewMut<'_>,
        dgamma: ViewMut<'_>,
        dbeta: ViewMut<'_>,
    ) -> Result<()> {
        check::expect_len("layernorm backward", "dresidual", dresidual.len(), dx.len())?;
        self.layernorm_backward(x, gamma, mean, rstd, dy, dx.reborrow(), dgamma, dbeta)?;
        self.add_assign(dx, dresidual)
    }
    /// [`NormOps::rmsnorm_backward`] with `dx = RMSNorm's dx + dresidual`, as
    /// [`NormOps::layernorm_backward_residual`].
    #[allow(clippy::too_many_arguments)]
    fn rmsnorm_backward_residual(
        &self,
        x: View<'_>,
        gamma: View<'_>,
        rstd: View<'_>,
        dy: View<'_>,
        dresidual: View<'_>,
        mut dx: ViewMut<'_>,
        dgamma: ViewMut<'_>,
    ) -> Result<()> {
        check::expect_len("rmsnorm backward", "dresidual", dresidual.len(), dx.len())?;
        self.rmsnorm_backward(x, gamma, rstd, dy, dx.reborrow(), dgamma)?;
        self.add_assign(dx, dresidual)
    }
}

/// Direction of a rotary embedding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rotation {
    /// Rotate by `+θ·pos` (forward).
    Forward,
    /// Rotate by `-θ·pos` (backward).
    Inverse,
}

/// Sizes of a language-model head: `rows` hidden states of width `dim`, a weight
/// `[vocab, dim]` (`nn.Linear` layout), logits `[rows, vocab]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadShape {
    /// Hidden states (tokens).
    pub rows: usize,
    /// Hidden width.
    pub dim: usize,
    /// Vocabulary size.
    pub vocab: usize,
}

/// The loss of a language-model head and its backward.
#[derive(Debug)]
pub struct HeadLoss {
    /// A one-element f32 storage holding the **sum** of the token losses (ignored targets
    /// excluded), on the backend's device.
    pub loss: Storage,
    /// What backward needs besides `x`, the weight and the targets (present when asked for).
    pub saved: Option<Storage>,
}

/// Token-indexed operations: embeddings and the loss.
pub trait TokenOps {
    /// `out[t] (=|+=) table[tokens[t]]`; fails on a token id outside the table.
    fn embedding_forward(
        &self,
        tokens: Ids<'_>,
        table: View<'_>,
        dim: usize,
        out: ViewMut<'_>,
        acc: Accumulate,
    ) -> Result<()>;
    /// `dtable[tokens[t]] += dout[t]`, rows summed in position order (deterministic).
    fn embedding_backward(
        &self,
        tokens: Ids<'_>,
        dout: View<'_>,
        dim: usize,
        dtable: ViewMut<'_>,
    ) -> Result<()>;
    /// `out[b, t] += table[t]` over `[batch, seq, dim]` (learned position embeddings).
    fn position_forward(
        &self,
        table: View<'_>,
        batch: usize,
        seq: usize,
        out: ViewMut<'_>,
    ) -> Result<()>;
    /// `dtable[t] += Σ_b dout[b, t]`, summed in increasing `b` (deterministic).
    fn position_backward(
        &self,
        dout: View<'_>,
        batch: usize,
        seq: usize,
        dtable: ViewMut<'_>,
    ) -> Result<()>;
    /// Softmax cross-entropy (ignore-index `-100`) of the logits `x · wᵀ`; the loss is the
    /// sum over non-ignored rows. With `keep` the result holds what backward needs. A
    /// device may compute the logits a chunk of rows at a time so that full-vocabulary
    /// logits never exist at once.
    fn head_loss_forward(
        &self,
        shape: HeadShape,
        x: View<'_>,
        w: View<'_>,
        targets: Ids<'_>,
        keep: bool,
    ) -> Result<HeadLoss>;
    /// Backward of [`TokenOps::head_loss_forward`] for `d(objective)/d(loss sum) = g`:
    /// `dx` overwritten, `dw` accumulated (`None`: the table is frozen, its gradient's
    /// product is skipped). Consumes the saved state.
    #[allow(clippy::too_many_arguments)]
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
    ) -> Result<()>;
    /// [`TokenOps::head_loss_forward`] and [`TokenOps::head_loss_backward`] in one call, for
    /// training where `g = d(objective)/d(loss sum)` is known before the loss: returns the loss
    /// sum (a one-element f32 storage) and writes `dx` (overwritten) and `dw` (accumulated)
    /// as backward would; nothing is kept between. A device computes each chunk's logits
    /// once and turns them into gradients at once (no recompute); by default (the CPU) exactly
    /// forward then backward, so its bits equal theirs.
    #[allow(clippy::too_many_arguments)]
    fn head_loss_fused(
        &self,
        shape: HeadShape,
        x: View<'_>,
        w: View<'_>,
        targets: Ids<'_>,
        g: f32,
        dx: ViewMut<'_>,
        dw: Option<ViewMut<'_>>,
    ) -> Result<Storage> {
        let out = self.head_loss_forward(shape, x, w, targets, true)?;
        let saved = out.saved.ok_or_else(|| {
            crate::Error::Invalid("head loss fused: forward kept no state for backward".into())
        })?;
        self.head_loss_backward(shape, x, w, targets, saved, g, dx, dw)?;
        Ok(out.loss)
    }
    /// Arg-max over the last dimension of `[rows, width]` (ties take the first index),
    /// returned in host memory.
    fn argmax_rows(&self, x: View<'_>, width: usize) -> Result<Vec<u32>>;
}

/// A device: all operation families together.
pub trait Backend:
    MemoryOps
    + MatmulOps
    + ElementwiseOps
    + NormOps
    + AttentionOps
    + TokenOps
    + OptimizerOps
    + StreamOps
    + Send
    + Sync
{
    /// Short name, e.g. `cpu` or `cuda:0`.
    fn name(&self) -> String;
}

pub use ferrozero_config::Device;

/// The backend for `device`, computing activations in `act` where the device can (the CPU
/// always computes in f32). `Auto` takes a GPU when this build and machine have one, else
/// the CPU. Without an ordinal a GPU is chosen by `LOCAL_RANK` when set (one process per GPU),
/// else by `rank` (ranks as threads spread over the GPUs). A device that cannot be used is
/// an error that says why ([`crate::Error::Unavailable`]), never a silent fallback.
pub fn open(device: Device, act: DType, rank: usize) -> Result<Arc<dyn Backend>> {
    match device {
        Device::Cpu => Ok(cpu()),
        Device::Cuda(ordinal) => cuda::open(gpu_ordinal(ordinal, rank)?, act),
        Device::Auto => match cuda::device_count() {
            Ok(n) if n > 0 => cuda::open(gpu_ordinal(None, rank)?, act),
            _ => Ok(cpu()),
        },
    }
}

/// The size-only stand-in for `device` (activations in `act` where the device keeps them so),
/// with no memory limit: the CPU as [`MetaBackend`], a GPU as the real CUDA backend over the
/// size-only driver (an H100's description), so its caching allocator rounds and caches as on
/// the card. What the estimator runs the training step on.
pub fn size_only(device: Device, act: DType) -> Result<Arc<dyn Backend>> {
    if memory_is_host_ram(device) {
        return Ok(Arc::new(MetaBackend));
    }
    size_only_gpu(act)
}

#[cfg(feature = "cuda")]
fn size_only_gpu(act: DType) -> Result<Arc<dyn Backend>> {
    use cuda::driver::{DeviceInfo, LARGE_SEGMENT_ROUND};
    let round = LARGE_SEGMENT_ROUND;
    let unbounded = u64::MAX / 4 / round * round;
    Ok(cuda::meta(
        act,
        DeviceInfo::h100_sizes_only(Some(unbounded)),
    )?)
}

#[cfg(not(feature = "cuda"))]
fn size_only_gpu(_act: DType) -> Result<Arc<dyn Backend>> {
    Err(crate::Error::Unavailable {
        what: "pricing a GPU",
        why: "the estimate runs the CUDA backend on a size-only device, and this build has no \
              CUDA backend: build with `--features cuda` (no GPU is needed), or price the CPU \
              with `device = \"cpu\"`"
            .into(),
    })
}

/// Whether `device`'s memory is the host's RAM: the CPU, or `Auto` where no GPU is usable.
/// The pre-flight check counts a rank's device working set against RAM only then.
pub fn memory_is_host_ram(device: Device) -> bool {
    match device {
        Device::Cpu => true,
        Device::Cuda(_) => false,
        Device::Auto => !matches!(cuda::device_count(), Ok(n) if n > 0),
    }
}

/// The GPU for a rank: the configured ordinal, else `LOCAL_RANK`, else the rank, modulo the
/// GPUs present.
fn gpu_ordinal(ordinal: Option<u32>, rank: usize) -> Result<usize> {
    if let Some(n) = ordinal {
        return Ok(n as usize);
    }
    let local = std::env::var("LOCAL_RANK")
        .ok()
        .and_then(|v| v.parse::<usize>().ok());
    let count = cuda::device_count()?.max(1);
    Ok(local.unwrap_or(rank) % count)
}

/// The CPU backend.
pub fn cpu() -> Arc<dyn Backend> {
    Arc::new(CpuBackend)
}
