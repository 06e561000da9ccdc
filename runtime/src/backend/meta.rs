//! `MetaBackend`: the size-only device. It stands for the CPU backend in a run that measures
//! what the engine holds without computing (see [`crate::tensor::meta`]): its memory
//! operations return meta storage of the requested dtype and length, never reading a source;
//! its compute operations check their operands' lengths and do nothing; its events are
//! complete when recorded. Layers size what they save from [`MemoryOps::memory_model`], which
//! is the CPU's, so a meta run holds what a CPU run holds, buffer for buffer.

use std::path::Path;

use ferrozero_offload::optim::LambHyper;
use ferrozero_offload::pool::{BufferPool, Pinning};
use ferrozero_offload::store::{AioSettings, NvmeStore};

use super::{
    Accumulate, AttentionGrads, AttentionOps, AttentionShape, Backend, ClipRule, ElementwiseOps,
    Epilogue, GradView, HeadLoss, HeadShape, MatmulOps, MatmulShape, MemoryModel, MemoryOps,
    NormOps, OptimizerOps, Rope, Rotation, RowView, StepStatus, Stream, StreamEvent, StreamOps,
    TokenOps, UpdateRule,
};
use crate::tensor::meta::MetaBuf;
use crate::tensor::{BufRef, DType, FlatBuf, IdBuf, Ids, Storage, View, ViewMut};
use crate::{Error, Result};

/// The size-only backend (see the module's documentation).
#[derive(Debug, Clone, Copy, Default)]
pub struct MetaBackend;

fn meta(dtype: DType, len: usize) -> Result<Storage> {
    Ok(Storage::Meta(MetaBuf::new(dtype, len)))
}

/// Fails unless every operand of `op` has `want` elements.
fn lens(op: &'static str, want: usize, got: &[usize]) -> Result<()> {
    match got.iter().find(|&&g| g != want) {
        None => Ok(()),
        Some(g) => Err(Error::Shape {
            op,
            expected: format!("{want} elements"),
            got: format!("{g}"),
        }),
    }
}

fn matmul_lens(s: &MatmulShape, a: usize, b: usize, c: usize) -> Result<()> {
    lens("matmul A", s.m * s.k, &[a])?;
    lens("matmul B", s.k * s.n, &[b])?;
    lens("matmul C", s.m * s.n, &[c])
}

/// f32 elements for `bytes` bytes of saved state, as the CPU's memory model sizes it.
fn f32_state(bytes: usize) -> Result<Storage> {
    meta(DType::F32, bytes / DType::F32.size())
}

/// Each gradient's sum of squares in [`status`]: finite, and large enough that any
/// `gradient_clipping` binds whatever the loss scale (the global norm is about 1e15 times the
/// square root of the tensors' count).
const COSTLIEST_SUM_SQUARES: f64 = 1e30;

/// The status the value-dependent branches of a step decide on, each taken its costlier way:
/// every gradient finite, because an overflow skips the update (no optimizer work, no
/// write-back); a norm over any clipping bound, so clipping binds. (A speculative optimizer
/// overlap's lane stops at the first group such a norm passes its bound, saving nothing: the
/// estimator measures that overlap with a bound above this norm, where every planned group's
/// snapshot is held.) Losses read as zero. A size-only CUDA device reads its status back as
/// this too, so both size-only runs branch alike.
pub(crate) fn status(losses: &[View<'_>], grads: &[GradView<'_>]) -> StepStatus {
    StepStatus {
        losses: vec![0.0; losses.len()],
        sum_squares: vec![COSTLIEST_SUM_SQUARES; grads.len()],
        grad_scale: None,
    }
}

/// [`status`] of a whole step (`OptimizerOps::whole_step`), with the scale applied as the
/// host decides it from those sums (`ClipRule::decide`, NaN for a skipped step): what a
/// device that computed the scale itself would report.
// Only a size-only CUDA device reports a whole step's status this way.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn whole_status(
    clip: ClipRule,
    losses: &[View<'_>],
    grads: &[GradView<'_>],
) -> StepStatus {
    let mut st = status(losses, grads);
    st.grad_scale = Some(clip.decide(&st.sum_squares).unwrap_or(f32::NAN));
    st
}

/// LAMB's partial norms of a run (`OptimizerOps::lamb_moments`) on a size-only device: zero,
/// so the trust ratio is 1 (no value to divide by).
pub(crate) const LAMB_PARTIALS: (f64, f64) = (0.0, 0.0);

/// One impl per trait, one line per operation: its signature and what it does (an
/// expression over the arguments). The body cannot name `self`, so every operation is a
/// function of its operands alone, as a size-only device's should be.
macro_rules! meta_ops {
    ($(impl $tr:ident {
        $(fn $op:ident($($arg:ident: $ty:ty),* $(,)?) -> $ret:ty => $body:expr;)*
    })*) => {
        $(impl $tr for MetaBackend {
            $(#[allow(unused_variables, clippy::unused_unit)]
            fn $op(&self, $($arg: $ty),*) -> $ret { $body })*
        })*
    };
}

meta_ops! {
    impl Backend {
        fn name() -> String => "meta".into();
    }
    impl MemoryOps {
        fn act_dtype() -> DType => DType::F32;
        fn zeros(dtype: DType, len: usize) -> Result<Storage> => meta(dtype, len);
        fn upload(src: BufRef<'_>) -> Result<Storage> => meta(src.dtype(), src.len());
        fn upload_ids(ids: &[i32]) -> Result<IdBuf> => Ok(IdBuf::Host(ids.to_vec()));
        fn copy(src: View<'_>) -> Result<Storage> => meta(src.dtype(), src.len());
        fn param_dtype(storage: DType) -> DType => MemoryModel::cpu().param_dtype(storage);
        fn buffer(dtype: DType, len: usize) -> Result<Storage> => meta(dtype, len);
        fn buffer_uninit(dtype: DType, len: usize) -> Result<Storage> => meta(dtype, len);
        fn recycle(buf: Storage) -> () => drop(buf);
        fn adopt(host: FlatBuf) -> Result<Storage> => meta(host.dtype(), host.len());
        fn host_zeros(dtype: DType, len: usize) -> Result<Storage> => meta(dtype, len);
        fn host_backend() -> &dyn Backend => &MetaBackend;
        fn nvme_store(dir: &Path, settings: &AioSettings) -> Result<NvmeStore> =>
            Ok(NvmeStore::meta(settings)?);
        fn host_pool(count: usize, size: usize, pinning: Pinning) -> Result<BufferPool> =>
            Ok(BufferPool::new(count, size, Pinning::Pageable)?);
        fn memory_model() -> MemoryModel => MemoryModel::for_device(super::Device::Cpu, DType::F32);
    }
    impl MatmulOps {
        fn matmul(shape: MatmulShape, a: View<'_>, b: View<'_>, c: ViewMut<'_>,
            epilogue: Epilogue<'_>) -> Result<()> => matmul_lens(&shape, a.len(), b.len(), c.len());
    }
    impl ElementwiseOps {
        fn gelu_forward(x: View<'_>, y: ViewMut<'_>) -> Result<()> =>
            lens("gelu_forward", x.len(), &[y.len()]);
        fn gelu_backward(x: View<'_>, dy: View<'_>, dx: ViewMut<'_>) -> Result<()> =>
            lens("gelu_backward", x.len(), &[dy.len(), dx.len()]);
        fn swiglu_forward(gate: View<'_>, up: View<'_>, y: ViewMut<'_>) -> Result<()> =>
            lens("swiglu_forward", gate.len(), &[up.len(), y.len()]);
        fn swiglu_backward(gate: View<'_>, up: View<'_>, dy: View<'_>, dgate: ViewMut<'_>,
            dup: ViewMut<'_>) -> Result<()> =>
            lens("swiglu_backward", gate.len(), &[up.len(), dy.len(), dgate.len(), dup.len()]);
        fn add_assign(dst: ViewMut<'_>, src: View<'_>) -> Result<()> =>
            lens("add_assign", dst.len(), &[src.len()]);
        fn dropout(seed: u64, offset: u64, p: f32, x: ViewMut<'_>) -> Result<()> => Ok(());
        fn sum_rows(m: View<'_>, cols: usize, acc: ViewMut<'_>) -> Result<()> =>
            lens("sum_rows", cols, &[acc.len()]);
    }
    impl NormOps {
        fn layernorm_forward(x: View<'_>, gamma: View<'_>, beta: View<'_>, eps: f32, y: ViewMut<'_>,
            mean: ViewMut<'_>, rstd: ViewMut<'_>) -> Result<()> =>
            lens("layernorm_forward", x.len(), &[y.len()]);
        fn layernorm_backward(x: View<'_>, gamma: View<'_>, mean: View<'_>, rstd: View<'_>,
            dy: View<'_>, dx: ViewMut<'_>, dgamma: ViewMut<'_>, dbeta: ViewMut<'_>)
            -> Result<()> => lens("layernorm_backward", x.len(), &[dy.len(), dx.len()]);
        fn rmsnorm_forward(x: View<'_>, gamma: View<'_>, eps: f32, y: ViewMut<'_>,
            rstd: ViewMut<'_>) -> Result<()> => lens("rmsnorm_forward", x.len(), &[y.len()]);
        fn rmsnorm_backward(x: View<'_>, gamma: View<'_>, rstd: View<'_>, dy: View<'_>,
            dx: ViewMut<'_>, dgamma: ViewMut<'_>) -> Result<()> =>
            lens("rmsnorm_backward", x.len(), &[dy.len(), dx.len()]);
        fn residual_layernorm_forward(x: View<'_>, residual: Option<View<'_>>, gamma: View<'_>,
            beta: View<'_>, eps: f32, sum: ViewMut<'_>, y: ViewMut<'_>,
            stats: (ViewMut<'_>, ViewMut<'_>)) -> Result<()> =>
            lens("residual_layernorm_forward", x.len(), &[sum.len(), y.len()]);
        fn residual_rmsnorm_forward(x: View<'_>, residual: Option<View<'_>>, gamma: View<'_>,
            eps: f32, sum: ViewMut<'_>, y: ViewMut<'_>, rstd: ViewMut<'_>) -> Result<()> =>
            lens("residual_rmsnorm_forward", x.len(), &[sum.len(), y.len()]);
        fn layernorm_backward_residual(x: View<'_>, gamma: View<'_>, stats: (View<'_>, View<'_>),
            dy: View<'_>, dresidual: View<'_>, dx: ViewMut<'_>, dgamma: ViewMut<'_>,
            dbeta: ViewMut<'_>) -> Result<()> =>
            lens("layernorm_backward_residual", x.len(), &[dy.len(), dresidual.len(), dx.len()]);
        fn rmsnorm_backward_residual(x: View<'_>, gamma: View<'_>, rstd: View<'_>, dy: View<'_>,
            dresidual: View<'_>, dx: ViewMut<'_>, dgamma: ViewMut<'_>) -> Result<()> =>
            lens("rmsnorm_backward_residual", x.len(), &[dy.len(), dresidual.len(), dx.len()]);
    }
    impl AttentionOps {
        fn attention_forward(shape: AttentionShape, q: (View<'_>, RowView), k: (View<'_>, RowView),
            v: (View<'_>, RowView), out: ViewMut<'_>) -> Result<Storage> =>
            f32_state(MemoryModel::cpu().attention_saved(shape));
        fn attention_backward(shape: AttentionShape, q: (View<'_>, RowView), k: (View<'_>, RowView),
            v: (View<'_>, RowView), out: View<'_>, saved: &Storage, dout: View<'_>,
            dqkv: AttentionGrads<'_>) -> Result<()> => lens("attention_backward", out.len(), &[dout.len()]);
        fn rope(x: ViewMut<'_>, batch: usize, seq: usize, heads: usize, head_dim: usize,
            rope: &Rope, direction: Rotation) -> Result<()> =>
            lens("rope", batch * seq * heads * head_dim, &[x.len()]);
        fn rope_qk(q: ViewMut<'_>, k: ViewMut<'_>, shape: AttentionShape, rope: &Rope,
            direction: Rotation) -> Result<()> => Ok(());
    }
    impl TokenOps {
        fn embedding_forward(tokens: Ids<'_>, table: View<'_>, dim: usize, out: ViewMut<'_>,
            acc: Accumulate) -> Result<()> => lens("embedding_forward", tokens.len() * dim, &[out.len()]);
        fn embedding_backward(tokens: Ids<'_>, dout: View<'_>, dim: usize, dtable: ViewMut<'_>)
            -> Result<()> => lens("embedding_backward", tokens.len() * dim, &[dout.len()]);
        fn position_forward(table: View<'_>, batch: usize, seq: usize, out: ViewMut<'_>)
            -> Result<()> => Ok(());
        fn position_backward(dout: View<'_>, batch: usize, seq: usize, dtable: ViewMut<'_>)
            -> Result<()> => Ok(());
        fn head_loss_forward(shape: HeadShape, x: View<'_>, w: View<'_>, targets: Ids<'_>,
            keep: bool) -> Result<HeadLoss> => Ok(HeadLoss {
                loss: meta(DType::F32, 1)?,
                saved: if keep { Some(f32_state(MemoryModel::cpu().head_saved(shape))?) } else { None },
            });
        fn head_loss_backward(shape: HeadShape, x: View<'_>, w: View<'_>, targets: Ids<'_>,
            saved: Storage, g: f32, dx: ViewMut<'_>, dw: Option<ViewMut<'_>>) -> Result<()> =>
            lens("head_loss_backward", shape.rows * shape.dim, &[x.len(), dx.len()]);
        fn head_loss_fused(shape: HeadShape, x: View<'_>, w: View<'_>, targets: Ids<'_>, g: f32,
            dx: ViewMut<'_>, dw: Option<ViewMut<'_>>) -> Result<Storage> =>
            lens("head_loss_fused", shape.rows * shape.dim, &[x.len(), dx.len()])
                .and_then(|()| meta(DType::F32, 1));
        fn argmax_rows(x: View<'_>, width: usize) -> Result<Vec<u32>> =>
            Ok(vec![0; x.len() / width.max(1)]);
    }
    impl OptimizerOps {
        fn optimizer_update(rule: &UpdateRule, step: u64, grad_scale: f32, params: ViewMut<'_>,
            grads: GradView<'_>, m: ViewMut<'_>, v: ViewMut<'_>, lp: Option<ViewMut<'_>>)
            -> Result<()> => lens("optimizer_update", params.len(), &[grads.len(), m.len()]);
        fn step_status(losses: &[View<'_>], grads: &[GradView<'_>]) -> Result<StepStatus> =>
            Ok(status(losses, grads));
        fn lamb_moments(hp: &LambHyper, grad_scale: f32, pg: (View<'_>, GradView<'_>),
            m: ViewMut<'_>, v: ViewMut<'_>) -> Result<(f64, f64)> =>
            lens("lamb_moments", pg.0.len(), &[pg.1.len(), m.len(), v.len()]).map(|()| LAMB_PARTIALS);
        fn lamb_apply(hsc: (&LambHyper, u64, f32), params: ViewMut<'_>,
            mv: (View<'_>, View<'_>), lp: Option<ViewMut<'_>>) -> Result<()> =>
            lens("lamb_apply", params.len(), &[mv.0.len(), mv.1.len()]);
    }
    impl StreamOps {
        fn record(s: Stream) -> Result<StreamEvent> => Ok(StreamEvent::Complete);
        fn wait_event(s: Stream, e: &StreamEvent) -> Result<()> => match e {
            StreamEvent::Complete => Ok(()),
            StreamEvent::Device(_) => Err(super::stream::foreign_event("meta", e)),
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::CpuBackend;

    #[test]
    fn memory_operations_make_meta_buffers_of_the_size_asked_without_reading() {
        let be = MetaBackend;
        let want = |s: Storage, d: DType, n: usize| {
            assert!(
                matches!(s, Storage::Meta(m) if m == MetaBuf::new(d, n)),
                "{s:?}"
            );
        };
        want(be.zeros(DType::Bf16, 5).unwrap(), DType::Bf16, 5);
        want(be.buffer(DType::F32, 7).unwrap(), DType::F32, 7);
        want(be.buffer_uninit(DType::F16, 9).unwrap(), DType::F16, 9);
        want(be.host_zeros(DType::F32, 11).unwrap(), DType::F32, 11);
        want(be.upload(BufRef::F32(&[1.0; 3])).unwrap(), DType::F32, 3);
        want(
            be.adopt(FlatBuf::zeros(DType::Bf16, 4)).unwrap(),
            DType::Bf16,
            4,
        );
        let src = be.zeros(DType::F16, 6).unwrap();
        want(be.copy(src.view()).unwrap(), DType::F16, 6);
        assert_eq!(be.memory_model(), CpuBackend.memory_model());
        assert_eq!(be.host_backend().name(), "meta");
    }

    /// NVMe on the size-only device: a store with no directory (the one named is not made)
    /// and a pool that is never locked, whatever the config's `pin_memory` asks.
    #[test]
    fn nvme_is_a_meta_store_and_an_unlocked_pool() {
        let dir = std::env::temp_dir().join(format!("fz-meta-nvme-{}", std::process::id()));
        let store = MetaBackend
            .nvme_store(&dir, &AioSettings::default())
            .unwrap();
        assert!(store.is_meta());
        store.write("t", &[0u8; 3]).unwrap();
        assert!(!dir.exists(), "{} was made", dir.display());
        let pool = MetaBackend.host_pool(2, 1 << 30, Pinning::Locked).unwrap();
        assert_eq!(pool.pinning(), Pinning::Pageable);
        assert_eq!((pool.buffer_count(), pool.buffer_size()), (2, 1 << 30));
        let real = CpuBackend.host_pool(1, 4096, Pinning::Pageable).unwrap();
        assert_eq!(real.pinning(), Pinning::Pageable);
        let real = CpuBackend
            .nvme_store(&dir, &AioSettings::default())
            .unwrap();
        assert!(!real.is_meta() && dir.exists());
        drop(real);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn compute_checks_lengths_and_the_status_is_the_costlier_branch() {
        let be = MetaBackend;
        let (a, b, mut c) = (
            be.zeros(DType::F32, 6).unwrap(),
            be.zeros(DType::F32, 12).unwrap(),
            be.zeros(DType::F32, 8).unwrap(),
        );
        let shape = MatmulShape {
            m: 2,
            n: 4,
            k: 3,
            ta: super::super::Transpose::No,
            tb: super::super::Transpose::No,
        };
        be.matmul(shape, a.view(), b.view(), c.view_mut(), Epilogue::Store)
            .unwrap();
        let bad = MatmulShape { k: 4, ..shape };
        assert!(be
            .matmul(bad, a.view(), b.view(), c.view_mut(), Epilogue::Store)
            .is_err());
        assert!(be.add_assign(c.view_mut(), a.view()).is_err());
        let st = be
            .step_status(&[a.view(), c.view()], &[GradView::exact(b.view())])
            .unwrap();
        assert_eq!(st.losses, vec![0.0, 0.0]);
        assert!(st.sum_squares.iter().all(|s| s.is_finite() && *s >= 1e30));
        let clip = ClipRule {
            loss_scale: 1.0,
            clipping: 1.0,
        };
        let whole = whole_status(clip, &[a.view()], &[GradView::exact(b.view())]);
        assert_eq!(whole.sum_squares, st.sum_squares);
        let scale = whole.grad_scale.unwrap();
        assert_eq!(Some(scale), clip.decide(&st.sum_squares));
        assert!(scale > 0.0 && scale < 1e-10, "clipping binds: {scale}");
        let free = whole_status(
            ClipRule {
                clipping: 0.0,
                ..clip
            },
            &[],
            &[GradView::exact(b.view())],
        );
        assert_eq!(free.grad_scale, Some(1.0));
        let e = be.record(Stream::Compute).unwrap();
        assert!(e.is_complete().unwrap());
        be.wait_event(Stream::HostToDevice, &e).unwrap();
    }
}
