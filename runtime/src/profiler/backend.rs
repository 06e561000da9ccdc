//! `ProfilingBackend`: a decorator over any backend that forwards every operation and, while
//! a step is profiled, times it and counts its FLOPs under the calling thread's module.

use std::sync::Arc;
use std::time::Instant;

use super::flops;
use super::record::{Family, Recorder};
use crate::backend::{
    Accumulate, AttentionGrads, AttentionOps, AttentionShape, Backend, ClipRule, DeviceActivity,
    DeviceMemory, ElementwiseOps, Epilogue, GradView, HeadLoss, HeadShape, MatmulOps, MatmulShape,
    MemoryModel, MemoryOps, NormOps, OptimizerOps, Rope, Rotation, RowView, StepStatus, StepTensor,
    Stream, StreamEvent, StreamOps, TokenOps, UpdateRule,
};
use crate::tensor::{BufRef, DType, FlatBuf, IdBuf, Ids, Storage, View, ViewMut};
use crate::Result;

/// Forwards every operation to `inner`; while recording, each one starts and ends with a
/// wait on a compute-stream event so that the time taken is the operation's own on every
/// device, not work queued before it (the CPU's events are complete when recorded: the
/// waits cost nothing there).
pub struct ProfilingBackend {
    inner: Arc<dyn Backend>,
    rec: Arc<Recorder>,
}

impl ProfilingBackend {
    /// Wraps `inner`, recording into `rec`.
    pub(super) fn new(inner: Arc<dyn Backend>, rec: Arc<Recorder>) -> Self {
        Self { inner, rec }
    }

    fn timed<T>(&self, family: Family, flops: u64, op: impl FnOnce() -> Result<T>) -> Result<T> {
        if !self.rec.active() {
            return op();
        }
        // Work queued before (the engine's own buffer kernels) is not this operation's.
        self.inner.record(Stream::Compute)?.synchronize()?;
        let t = Instant::now();
        let out = op()?;
        self.inner.record(Stream::Compute)?.synchronize()?;
        self.rec.add(family, flops, t.elapsed().as_secs_f64());
        Ok(out)
    }
}

impl Backend for ProfilingBackend {
    fn name(&self) -> String {
        self.inner.name()
    }
}

impl MemoryOps for ProfilingBackend {
    fn act_dtype(&self) -> DType {
        self.inner.act_dtype()
    }
    fn zeros(&self, dtype: DType, len: usize) -> Result<Storage> {
        self.timed(Family::Memory, 0, || self.inner.zeros(dtype, len))
    }
    fn upload(&self, src: BufRef<'_>) -> Result<Storage> {
        self.timed(Family::Memory, 0, || self.inner.upload(src))
    }
    fn upload_ids(&self, ids: &[i32]) -> Result<IdBuf> {
        self.timed(Family::Memory, 0, || self.inner.upload_ids(ids))
    }
    fn copy(&self, src: View<'_>) -> Result<Storage> {
        self.timed(Family::Memory, 0, || self.inner.copy(src))
    }
    fn param_dtype(&self, storage: DType) -> DType {
        self.inner.param_dtype(storage)
    }
    fn buffer(&self, dtype: DType, len: usize) -> Result<Storage> {
        self.timed(Family::Memory, 0, || self.inner.buffer(dtype, len))
    }
    fn buffer_uninit(&self, dtype: DType, len: usize) -> Result<Storage> {
        self.inner.buffer_uninit(dtype, len)
    }
    fn recycle(&self, buf: Storage) {
        self.inner.recycle(buf)
    }
    fn adopt(&self, host: FlatBuf) -> Result<Storage> {
        self.timed(Family::Memory, 0, || self.inner.adopt(host))
    }
    fn adopt_storage(&self, s: Storage) -> Result<Storage> {
        self.timed(Family::Memory, 0, || self.inner.adopt_storage(s))
    }
    fn set_memory_limit(&self, limit: Option<u64>) -> Result<()> {
        self.inner.set_memory_limit(limit)
    }
    fn memory_stats(&self) -> Option<DeviceMemory> {
        self.inner.memory_stats()
    }
    fn page_locked_bytes(&self) -> u64 {
        self.inner.page_locked_bytes()
    }
    // The methods with defaults are forwarded too: a default here would silently describe
    // the CPU instead of the device underneath.
    fn pin_host(&self, b: &mut FlatBuf) -> Option<crate::tensor::in_flight::HostPin> {
        self.inner.pin_host(b)
    }
    fn memory_model(&self) -> MemoryModel {
        self.inner.memory_model()
    }
    fn activity(&self) -> Option<DeviceActivity> {
        self.inner.activity()
    }
}

impl MatmulOps for ProfilingBackend {
    fn matmul(
        &self,
        shape: MatmulShape,
        a: View<'_>,
        b: View<'_>,
        c: ViewMut<'_>,
        epilogue: Epilogue<'_>,
    ) -> Result<()> {
        self.timed(Family::Matmul, flops::matmul(&shape), || {
            self.inner.matmul(shape, a, b, c, epilogue)
        })
    }
}

impl ElementwiseOps for ProfilingBackend {
    fn gelu_forward(&self, x: View<'_>, y: ViewMut<'_>) -> Result<()> {
        self.timed(Family::Elementwise, 0, || self.inner.gelu_forward(x, y))
    }
    fn gelu_backward(&self, x: View<'_>, dy: View<'_>, dx: ViewMut<'_>) -> Result<()> {
        self.timed(Family::Elementwise, 0, || {
            self.inner.gelu_backward(x, dy, dx)
        })
    }
    fn swiglu_forward(&self, gate: View<'_>, up: View<'_>, y: ViewMut<'_>) -> Result<()> {
        self.timed(Family::Elementwise, 0, || {
            self.inner.swiglu_forward(gate, up, y)
        })
    }
    fn swiglu_backward(
        &self,
        gate: View<'_>,
        up: View<'_>,
        dy: View<'_>,
        dgate: ViewMut<'_>,
        dup: ViewMut<'_>,
    ) -> Result<()> {
        self.timed(Family::Elementwise, 0, || {
            self.inner.swiglu_backward(gate, up, dy, dgate, dup)
        })
    }
    fn add_assign(&self, dst: ViewMut<'_>, src: View<'_>) -> Result<()> {
        self.timed(Family::Elementwise, 0, || self.inner.add_assign(dst, src))
    }
    fn dropout(&self, seed: u64, p: f32, x: ViewMut<'_>) -> Result<()> {
        self.timed(Family::Elementwise, 0, || self.inner.dropout(seed, p, x))
    }
    fn sum_rows(&self, m: View<'_>, cols: usize, acc: ViewMut<'_>) -> Result<()> {
        self.timed(Family::Elementwise, 0, || self.inner.sum_rows(m, cols, acc))
    }
}

impl NormOps for ProfilingBackend {
    fn layernorm_forward(
        &self,
        x: View<'_>,
        gamma: View<'_>,
        beta: View<'_>,
        eps: f32,
        y: ViewMut<'_>,
        mean: ViewMut<'_>,
        rstd: ViewMut<'_>,
    ) -> Result<()> {
        self.timed(Family::Norm, 0, || {
            self.inner
                .layernorm_forward(x, gamma, beta, eps, y, mean, rstd)
        })
    }
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
    ) -> Result<()> {
        self.timed(Family::Norm, 0, || {
            self.inner
                .layernorm_backward(x, gamma, mean, rstd, dy, dx, dgamma, dbeta)
        })
    }
    fn rmsnorm_forward(
        &self,
        x: View<'_>,
        gamma: View<'_>,
        eps: f32,
        y: ViewMut<'_>,
        rstd: ViewMut<'_>,
    ) -> Result<()> {
        self.timed(Family::Norm, 0, || {
            self.inner.rmsnorm_forward(x, gamma, eps, y, rstd)
        })
    }
    fn rmsnorm_backward(
        &self,
        x: View<'_>,
        gamma: View<'_>,
        rstd: View<'_>,
        dy: View<'_>,
        dx: ViewMut<'_>,
        dgamma: ViewMut<'_>,
    ) -> Result<()> {
        self.timed(Family::Norm, 0, || {
            self.inner.rmsnorm_backward(x, gamma, rstd, dy, dx, dgamma)
        })
    }
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
    ) -> Result<()> {
        self.timed(Family::Norm, 0, || {
            self.inner
                .residual_layernorm_forward(x, residual, gamma, beta, eps, sum, y, stats)
        })
    }
    fn residual_rmsnorm_forward(
        &self,
        x: View<'_>,
        residual: Option<View<'_>>,
        gamma: View<'_>,
        eps: f32,
        sum: ViewMut<'_>,
        y: ViewMut<'_>,
        rstd: ViewMut<'_>,
    ) -> Result<()> {
        self.timed(Family::Norm, 0, || {
            self.inner
                .residual_rmsnorm_forward(x, residual, gamma, eps, sum, y, rstd)
        })
    }
    fn layernorm_backward_residual(
        &self,
        x: View<'_>,
        gamma: View<'_>,
        stats: (View<'_>, View<'_>),
        dy: View<'_>,
        dresidual: View<'_>,
        dx: ViewMut<'_>,
        dgamma: ViewMut<'_>,
        dbeta: ViewMut<'_>,
    ) -> Result<()> {
        self.timed(Family::Norm, 0, || {
            self.inner
                .layernorm_backward_residual(x, gamma, stats, dy, dresidual, dx, dgamma, dbeta)
        })
    }
    fn rmsnorm_backward_residual(
        &self,
        x: View<'_>,
        gamma: View<'_>,
        rstd: View<'_>,
        dy: View<'_>,
        dresidual: View<'_>,
        dx: ViewMut<'_>,
        dgamma: ViewMut<'_>,
    ) -> Result<()> {
        self.timed(Family::Norm, 0, || {
            self.inner
                .rmsnorm_backward_residual(x, gamma, rstd, dy, dresidual, dx, dgamma)
        })
    }
}

impl AttentionOps for ProfilingBackend {
    fn attention_forward(
        &self,
        shape: AttentionShape,
        q: (View<'_>, RowView),
        k: (View<'_>, RowView),
        v: (View<'_>, RowView),
        out: ViewMut<'_>,
    ) -> Result<Storage> {
        self.timed(Family::Attention, flops::attention_forward(&shape), || {
            self.inner.attention_forward(shape, q, k, v, out)
        })
    }
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
    ) -> Result<()> {
        self.timed(Family::Attention, flops::attention_backward(&shape), || {
            self.inner
                .attention_backward(shape, q, k, v, out, saved, dout, dqkv)
        })
    }
    fn rope(
        &self,
        x: ViewMut<'_>,
        batch: usize,
        seq: usize,
        heads: usize,
        head_dim: usize,
        rope: &Rope,
        direction: Rotation,
    ) -> Result<()> {
        self.timed(Family::Attention, 0, || {
            self.inner
                .rope(x, batch, seq, heads, head_dim, rope, direction)
        })
    }
    fn rope_qk(
        &self,
        q: ViewMut<'_>,
        k: ViewMut<'_>,
        shape: AttentionShape,
        rope: &Rope,
        direction: Rotation,
    ) -> Result<()> {
        self.timed(Family::Attention, 0, || {
            self.inner.rope_qk(q, k, shape, rope, direction)
        })
    }
}

impl TokenOps for ProfilingBackend {
    fn embedding_forward(
        &self,
        tokens: Ids<'_>,
        table: View<'_>,
        dim: usize,
        out: ViewMut<'_>,
        acc: Accumulate,
    ) -> Result<()> {
        self.timed(Family::Elementwise, 0, || {
            self.inner.embedding_forward(tokens, table, dim, out, acc)
        })
    }
    fn embedding_backward(
        &self,
        tokens: Ids<'_>,
        dout: View<'_>,
        dim: usize,
        dtable: ViewMut<'_>,
    ) -> Result<()> {
        self.timed(Family::Elementwise, 0, || {
            self.inner.embedding_backward(tokens, dout, dim, dtable)
        })
    }
    fn position_forward(
        &self,
        table: View<'_>,
        batch: usize,
        seq: usize,
        out: ViewMut<'_>,
    ) -> Result<()> {
        self.timed(Family::Elementwise, 0, || {
            self.inner.position_forward(table, batch, seq, out)
        })
    }
    fn position_backward(
        &self,
        dout: View<'_>,
        batch: usize,
        seq: usize,
        dtable: ViewMut<'_>,
    ) -> Result<()> {
        self.timed(Family::Elementwise, 0, || {
            self.inner.position_backward(dout, batch, seq, dtable)
        })
    }
    fn head_loss_forward(
        &self,
        shape: HeadShape,
        x: View<'_>,
        w: View<'_>,
        targets: Ids<'_>,
        keep: bool,
    ) -> Result<HeadLoss> {
        self.timed(Family::Loss, flops::head_forward(&shape), || {
            self.inner.head_loss_forward(shape, x, w, targets, keep)
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
        dw: ViewMut<'_>,
    ) -> Result<()> {
        self.timed(Family::Loss, flops::head_backward(&shape), || {
            self.inner
                .head_loss_backward(shape, x, w, targets, saved, g, dx, dw)
        })
    }
    fn head_loss_fused(
        &self,
        shape: HeadShape,
        x: View<'_>,
        w: View<'_>,
        targets: Ids<'_>,
        g: f32,
        dx: ViewMut<'_>,
        dw: ViewMut<'_>,
    ) -> Result<Storage> {
        self.timed(Family::Loss, flops::head_fused(&shape), || {
            self.inner.head_loss_fused(shape, x, w, targets, g, dx, dw)
        })
    }
    fn argmax_rows(&self, x: View<'_>, width: usize) -> Result<Vec<u32>> {
        self.timed(Family::Loss, 0, || self.inner.argmax_rows(x, width))
    }
}

impl OptimizerOps for ProfilingBackend {
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
    ) -> Result<()> {
        self.timed(Family::Optimizer, 0, || {
            self.inner
                .optimizer_update(rule, step, grad_scale, params, grads, m, v, lp)
        })
    }
    fn step_status(&self, losses: &[View<'_>], grads: &[GradView<'_>]) -> Result<StepStatus> {
        self.timed(Family::Memory, 0, || self.inner.step_status(losses, grads))
    }
    fn optimizer_update_all(
        &self,
        rule: &UpdateRule,
        step: u64,
        grad_scale: f32,
        tensors: Vec<StepTensor<'_>>,
    ) -> Result<()> {
        self.timed(Family::Optimizer, 0, || {
            self.inner
                .optimizer_update_all(rule, step, grad_scale, tensors)
        })
    }
    fn whole_step(
        &self,
        step: (&UpdateRule, u64, ClipRule),
        losses: &[View<'_>],
        grads: &[GradView<'_>],
        tensors: Vec<StepTensor<'_>>,
    ) -> Result<StepStatus> {
        self.timed(Family::Optimizer, 0, || {
            self.inner.whole_step(step, losses, grads, tensors)
        })
    }
}

impl StreamOps for ProfilingBackend {
    fn record(&self, s: Stream) -> Result<StreamEvent> {
        self.inner.record(s)
    }
    fn wait_event(&self, s: Stream, e: &StreamEvent) -> Result<()> {
        self.inner.wait_event(s, e)
    }
}
