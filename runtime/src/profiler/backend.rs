//! `ProfilingBackend`: a decorator over any backend that forwards every operation and, while
//! a step is profiled, times it and counts its FLOPs under the calling thread's module.
//!
//! Each operation's signature is written here once, in `profiled!`'s list, with the family it
//! is timed under (and its FLOPs) or none: adding an operation to a backend trait is one line
//! more in the list, and an operation missing from it fails to compile.

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
use crate::tensor::in_flight::HostPin;
use crate::tensor::{BufRef, DType, FlatBuf, IdBuf, Ids, Storage, View, ViewMut};
use crate::Result;
use ferrozero_offload::optim::LambHyper;
use ferrozero_offload::pool::{BufferPool, Pinning};
use ferrozero_offload::store::{AioSettings, NvmeStore};
use std::path::Path;

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

/// The decorator's impl of each trait, one line per operation: `fn op(args) -> T;` forwards,
/// `fn op(args) -> Result<T> => Family(flops);` forwards timed under `Family`, counting
/// `flops` (an expression over the arguments).
macro_rules! profiled {
    ($(impl $tr:ident {
        $(fn $op:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)?
            $(=> $fam:ident($flops:expr))?;)*
    })*) => {
        $(impl $tr for ProfilingBackend {
            $(fn $op(&self, $($arg: $ty),*) $(-> $ret)? {
                profiled!(@forward self, $op($($arg),*) $(, $fam, $flops)?)
            })*
        })*
    };
    (@forward $s:ident, $op:ident($($arg:ident),*)) => {
        $s.inner.$op($($arg),*)
    };
    (@forward $s:ident, $op:ident($($arg:ident),*), $fam:ident, $flops:expr) => {
        $s.timed(Family::$fam, $flops, || $s.inner.$op($($arg),*))
    };
}

// The methods with defaults are forwarded too: a default here would silently describe the CPU
// instead of the device underneath. Stream operations are never timed: timing waits on them.
profiled! {
    impl Backend {
        fn name() -> String;
    }
    impl MemoryOps {
        fn act_dtype() -> DType;
        fn zeros(dtype: DType, len: usize) -> Result<Storage> => Memory(0);
        fn upload(src: BufRef<'_>) -> Result<Storage> => Memory(0);
        fn upload_ids(ids: &[i32]) -> Result<IdBuf> => Memory(0);
        fn copy(src: View<'_>) -> Result<Storage> => Memory(0);
        fn param_dtype(storage: DType) -> DType;
        fn buffer(dtype: DType, len: usize) -> Result<Storage> => Memory(0);
        fn buffer_uninit(dtype: DType, len: usize) -> Result<Storage>;
        fn recycle(buf: Storage);
        fn adopt(host: FlatBuf) -> Result<Storage> => Memory(0);
        fn adopt_storage(s: Storage) -> Result<Storage> => Memory(0);
        fn set_memory_limit(limit: Option<u64>) -> Result<()>;
        fn memory_stats() -> Option<DeviceMemory>;
        fn page_locked_bytes() -> u64;
        fn pin_host(b: &mut FlatBuf) -> Option<HostPin>;
        fn host_zeros(dtype: DType, len: usize) -> Result<Storage>;
        fn host_backend() -> &dyn Backend;
        fn nvme_store(dir: &Path, settings: &AioSettings) -> Result<NvmeStore>;
        fn host_pool(count: usize, size: usize, pinning: Pinning) -> Result<BufferPool>;
        fn memory_model() -> MemoryModel;
        fn activity() -> Option<DeviceActivity>;
    }
    impl MatmulOps {
        fn matmul(shape: MatmulShape, a: View<'_>, b: View<'_>, c: ViewMut<'_>,
            epilogue: Epilogue<'_>) -> Result<()> => Matmul(flops::matmul(&shape));
    }
    impl ElementwiseOps {
        fn gelu_forward(x: View<'_>, y: ViewMut<'_>) -> Result<()> => Elementwise(0);
        fn gelu_backward(x: View<'_>, dy: View<'_>, dx: ViewMut<'_>)
            -> Result<()> => Elementwise(0);
        fn swiglu_forward(gate: View<'_>, up: View<'_>, y: ViewMut<'_>)
            -> Result<()> => Elementwise(0);
        fn swiglu_backward(gate: View<'_>, up: View<'_>, dy: View<'_>, dgate: ViewMut<'_>,
            dup: ViewMut<'_>) -> Result<()> => Elementwise(0);
        fn add_assign(dst: ViewMut<'_>, src: View<'_>) -> Result<()> => Elementwise(0);
        fn dropout(seed: u64, offset: u64, p: f32, x: ViewMut<'_>) -> Result<()> => Elementwise(0);
        fn sum_rows(m: View<'_>, cols: usize, acc: ViewMut<'_>) -> Result<()> => Elementwise(0);
    }
    impl NormOps {
        fn layernorm_forward(x: View<'_>, gamma: View<'_>, beta: View<'_>, eps: f32, y: ViewMut<'_>,
            mean: ViewMut<'_>, rstd: ViewMut<'_>) -> Result<()> => Norm(0);
        fn layernorm_backward(x: View<'_>, gamma: View<'_>, mean: View<'_>, rstd: View<'_>,
            dy: View<'_>, dx: ViewMut<'_>, dgamma: ViewMut<'_>, dbeta: ViewMut<'_>)
            -> Result<()> => Norm(0);
        fn rmsnorm_forward(x: View<'_>, gamma: View<'_>, eps: f32, y: ViewMut<'_>,
            rstd: ViewMut<'_>) -> Result<()> => Norm(0);
        fn rmsnorm_backward(x: View<'_>, gamma: View<'_>, rstd: View<'_>, dy: View<'_>,
            dx: ViewMut<'_>, dgamma: ViewMut<'_>) -> Result<()> => Norm(0);
        fn residual_layernorm_forward(x: View<'_>, residual: Option<View<'_>>, gamma: View<'_>,
            beta: View<'_>, eps: f32, sum: ViewMut<'_>, y: ViewMut<'_>,
            stats: (ViewMut<'_>, ViewMut<'_>)) -> Result<()> => Norm(0);
        fn residual_rmsnorm_forward(x: View<'_>, residual: Option<View<'_>>, gamma: View<'_>,
            eps: f32, sum: ViewMut<'_>, y: ViewMut<'_>, rstd: ViewMut<'_>) -> Result<()> => Norm(0);
        fn layernorm_backward_residual(x: View<'_>, gamma: View<'_>, stats: (View<'_>, View<'_>),
            dy: View<'_>, dresidual: View<'_>, dx: ViewMut<'_>, dgamma: ViewMut<'_>,
            dbeta: ViewMut<'_>) -> Result<()> => Norm(0);
        fn rmsnorm_backward_residual(x: View<'_>, gamma: View<'_>, rstd: View<'_>, dy: View<'_>,
            dresidual: View<'_>, dx: ViewMut<'_>, dgamma: ViewMut<'_>) -> Result<()> => Norm(0);
    }
    impl AttentionOps {
        fn attention_forward(shape: AttentionShape, q: (View<'_>, RowView), k: (View<'_>, RowView),
            v: (View<'_>, RowView), out: ViewMut<'_>)
            -> Result<Storage> => Attention(flops::attention_forward(&shape));
        fn attention_backward(shape: AttentionShape, q: (View<'_>, RowView), k: (View<'_>, RowView),
            v: (View<'_>, RowView), out: View<'_>, saved: &Storage, dout: View<'_>,
            dqkv: AttentionGrads<'_>) -> Result<()> => Attention(flops::attention_backward(&shape));
        fn rope(x: ViewMut<'_>, batch: usize, seq: usize, heads: usize, head_dim: usize,
            rope: &Rope, direction: Rotation) -> Result<()> => Attention(0);
        fn rope_qk(q: ViewMut<'_>, k: ViewMut<'_>, shape: AttentionShape, rope: &Rope,
            direction: Rotation) -> Result<()> => Attention(0);
    }
    impl TokenOps {
        fn embedding_forward(tokens: Ids<'_>, table: View<'_>, dim: usize, out: ViewMut<'_>,
            acc: Accumulate) -> Result<()> => Elementwise(0);
        fn embedding_backward(tokens: Ids<'_>, dout: View<'_>, dim: usize, dtable: ViewMut<'_>)
            -> Result<()> => Elementwise(0);
        fn position_forward(table: View<'_>, batch: usize, seq: usize, out: ViewMut<'_>)
            -> Result<()> => Elementwise(0);
        fn position_backward(dout: View<'_>, batch: usize, seq: usize, dtable: ViewMut<'_>)
            -> Result<()> => Elementwise(0);
        fn head_loss_forward(shape: HeadShape, x: View<'_>, w: View<'_>, targets: Ids<'_>,
            keep: bool) -> Result<HeadLoss> => Loss(flops::head_forward(&shape));
        fn head_loss_backward(shape: HeadShape, x: View<'_>, w: View<'_>, targets: Ids<'_>,
            saved: Storage, g: f32, dx: ViewMut<'_>, dw: Option<ViewMut<'_>>)
            -> Result<()> => Loss(flops::head_backward(&shape));
        fn head_loss_fused(shape: HeadShape, x: View<'_>, w: View<'_>, targets: Ids<'_>, g: f32,
            dx: ViewMut<'_>, dw: Option<ViewMut<'_>>) -> Result<Storage> => Loss(flops::head_fused(&shape));
        fn argmax_rows(x: View<'_>, width: usize) -> Result<Vec<u32>> => Loss(0);
    }
    impl OptimizerOps {
        fn optimizer_update(rule: &UpdateRule, step: u64, grad_scale: f32, params: ViewMut<'_>,
            grads: GradView<'_>, m: ViewMut<'_>, v: ViewMut<'_>, lp: Option<ViewMut<'_>>)
            -> Result<()> => Optimizer(0);
        fn step_status(losses: &[View<'_>], grads: &[GradView<'_>])
            -> Result<StepStatus> => Memory(0);
        fn optimizer_update_all(rule: &UpdateRule, step: u64, grad_scale: f32,
            tensors: Vec<StepTensor<'_>>) -> Result<()> => Optimizer(0);
        fn whole_step(step: (&UpdateRule, u64, ClipRule), losses: &[View<'_>],
            grads: &[GradView<'_>], tensors: Vec<StepTensor<'_>>)
            -> Result<StepStatus> => Optimizer(0);
        fn lamb_moments(hp: &LambHyper, grad_scale: f32, pg: (View<'_>, GradView<'_>),
            m: ViewMut<'_>, v: ViewMut<'_>) -> Result<(f64, f64)> => Optimizer(0);
        fn lamb_apply(hsc: (&LambHyper, u64, f32), params: ViewMut<'_>,
            mv: (View<'_>, View<'_>), lp: Option<ViewMut<'_>>) -> Result<()> => Optimizer(0);
    }
    impl StreamOps {
        fn record(s: Stream) -> Result<StreamEvent>;
        fn wait_event(s: Stream, e: &StreamEvent) -> Result<()>;
    }
}
