//! The local collectives on device buffers: the same entry barrier, descriptor check and
//! release barrier as on host memory, with rank r's share of the data phase computed by its
//! own device (`backend::cuda::peer`: copies between the ranks' device memory, the rank-order
//! reduction in kernels). Each rank fences its stream before announcing its buffers (so peers
//! read finished values) and after its share (so peers, once released, see what it wrote).

use std::sync::Arc;
use std::time::Instant;

use super::desc::Desc;
use super::kernels::chunk;
use super::LocalComm;
use crate::backend::cuda::peer::{copy_between, reduce_runs};
use crate::backend::cuda::{CudaDevice, RawView};
use crate::comm::ReduceOp;
use crate::tensor::{CudaView, CudaViewMut, DType};
use crate::Result;

/// Address, dtype, length and device handle of a device view, for its descriptor.
pub(super) fn parts(v: &CudaView<'_>) -> (usize, DType, usize, usize) {
    let r = v.raw();
    (r.ptr as usize, r.dtype, r.len, r.dev)
}

fn raw_in(d: &Desc) -> RawView {
    RawView {
        ptr: d.src as u64,
        len: d.len_in,
        dtype: d.dtype,
        dev: d.src_dev,
    }
}

fn raw_out(d: &Desc) -> RawView {
    RawView {
        ptr: d.dst as u64,
        len: d.len_out,
        dtype: d.dtype_out,
        dev: d.dst_dev,
    }
}

/// A rank's input as a view.
///
/// # Safety
/// Only between the entry and release barriers of the collective `d` was announced for.
unsafe fn input<'a>(d: &Desc) -> CudaView<'a> {
    // SAFETY: the announcing rank keeps the view borrowed until the release barrier.
    unsafe { CudaView::from_raw(raw_in(d)) }
}

/// A rank's output (or in-place buffer) as a mutable view.
///
/// # Safety
/// As [`input`]; the caller writes only the elements its rank owns in this collective.
unsafe fn output<'a>(d: &Desc, in_place: bool) -> CudaViewMut<'a> {
    let raw = if in_place { raw_in(d) } else { raw_out(d) };
    // SAFETY: the announcing rank keeps the view borrowed until the release barrier, and the
    // data phase gives every element to one writer.
    unsafe { CudaViewMut::from_raw(raw) }
}

/// The device handle a descriptor's field points to (0: none).
///
/// # Safety
/// `dev` is this rank's own announcement, whose view is alive for the call.
unsafe fn handle<'a>(dev: usize) -> Option<&'a Arc<CudaDevice>> {
    // SAFETY: see above.
    (dev != 0).then(|| unsafe { &*(dev as *const Arc<CudaDevice>) })
}

impl LocalComm {
    /// Fences this rank's devices, announces `desc`, runs this rank's share `data` on its
    /// output's device, fences it again and releases (always, so a failed share never leaves
    /// peers waiting).
    fn device_collective(
        &self,
        desc: Desc,
        data: impl FnOnce(&[Desc], &Arc<CudaDevice>) -> Result<()>,
    ) -> Result<()> {
        // SAFETY: both fields come from this rank's live views.
        let (src, dst) = unsafe { (handle(desc.src_dev), handle(desc.dst_dev)) };
        // The fences make this rank's queued work visible to its peers' streams and theirs to
        // it; alone, the share runs on the stream that produced its data, in order.
        let alone = crate::comm::Communicator::world_size(self) == 1;
        // Input and output on one device: one fence covers both.
        let dst_fence = dst.filter(|d| !src.is_some_and(|s| Arc::ptr_eq(s, d)));
        for dev in [src, dst_fence].into_iter().flatten().filter(|_| !alone) {
            dev.synchronize()?;
        }
        // A rank whose two buffers are in different places is refused at the entry check,
        // so a rank that gets past it has its output on a device.
        let Some(own) = dst.or(src) else {
            return Err(crate::Error::Invalid(
                "a device collective without a device buffer".into(),
            ));
        };
        let start = Instant::now();
        self.enter(desc, start)?;
        let r = data(&self.peers.borrow(), own).and_then(|()| match alone {
            true => Ok(()),
            false => own.synchronize(),
        });
        let released = self.release(desc.op, start);
        r.and(released)
    }
}

/// Rank `me`'s share of an all-reduce: chunk `me` of every buffer, summed into all of them.
pub(super) fn all_reduce(c: &LocalComm, d: Desc, op: ReduceOp) -> Result<()> {
    let me = c.rank;
    c.device_collective(d, |peers, own| {
        let n = peers.len();
        if n == 1 {
            return Ok(());
        }
        let (lo, hi) = chunk(peers[0].len_in, n, me);
        // SAFETY: inside the collective; chunk `me` of every buffer is this rank's alone.
        let srcs = peers
            .iter()
            .map(|p| unsafe { input(p) }.range(lo..hi))
            .collect::<Result<Vec<_>>>()?;
        let mut dsts = peers
            .iter()
            .map(|p| unsafe { output(p, true) }.range(lo..hi))
            .collect::<Result<Vec<_>>>()?;
        reduce_runs(own, &srcs, &mut dsts, op)
    })
}

/// Rank `me`'s share of a reduce-scatter: block `me` of every input, into its own output.
pub(super) fn reduce_scatter(c: &LocalComm, d: Desc, op: ReduceOp) -> Result<()> {
    let me = c.rank;
    c.device_collective(d, |peers, own| {
        let m = peers[me].len_out;
        // SAFETY: inside the collective; inputs are only read, the output is this rank's.
        let srcs = peers
            .iter()
            .map(|p| unsafe { input(p) }.range(me * m..(me + 1) * m))
            .collect::<Result<Vec<_>>>()?;
        let mut dst = [unsafe { output(&peers[me], false) }];
        reduce_runs(own, &srcs, &mut dst, op)
    })
}

/// Rank `me`'s share of an all-gather: every input, into its own output.
pub(super) fn all_gather(c: &LocalComm, d: Desc) -> Result<()> {
    let me = c.rank;
    c.device_collective(d, |peers, own| {
        let m = peers[me].len_in;
        // SAFETY: inside the collective; inputs are only read, the output is this rank's.
        let mut out = unsafe { output(&peers[me], false) };
        for (k, p) in peers.iter().enumerate() {
            let dst = out.reborrow().range(k * m..(k + 1) * m)?;
            copy_between(own, unsafe { input(p) }, dst)?;
        }
        Ok(())
    })
}

/// Rank `me`'s share of a broadcast: the root's buffer into its own, unless it is the root.
pub(super) fn broadcast(c: &LocalComm, d: Desc) -> Result<()> {
    let me = c.rank;
    c.device_collective(d, |peers, own| {
        let root = peers[me].root;
        if me == root {
            return Ok(());
        }
        // SAFETY: inside the collective; the root's buffer is only read, ours is this rank's.
        let (src, dst) = unsafe { (input(&peers[root]), output(&peers[me], true)) };
        copy_between(own, src, dst)
    })
}
