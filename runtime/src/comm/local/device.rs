//! The local collectives on device buffers: the same entry barrier, descriptor check and
//! release barrier as on host memory, with rank r's share of the data phase computed by its
//! own device (`backend::cuda::peer`: copies between the ranks' device memory, the rank-order
//! reduction in kernels). The host never waits for a device: the streams are ordered by
//! events. Each rank records `ready` on the compute stream of its buffers' devices before it
//! announces them; every rank's collective stream waits for every `ready` before its share,
//! records `done` after it; once every rank has recorded `done` (a second barrier), every
//! rank's compute streams wait for every `done`, so what follows the collective on a rank
//! reads the results and writes its buffers only after every peer is through with them.
//!
//! A rank's two events per device are reused by every collective: a peer waits for the latest
//! record, and neither is recorded again before every peer has issued its waits for the last
//! one (`ready` is recorded before the next entry, which follows the release; `done` after the
//! next entry, which every peer reaches only after its waits).

use std::sync::Arc;
use std::time::Instant;

use super::desc::Desc;
use super::kernels::chunk;
use super::LocalComm;
use crate::backend::cuda::driver::{wait_peer_event, Event, StreamKind};
use crate::backend::cuda::peer::{copy_between, reduce_runs};
use crate::backend::cuda::{CudaDevice, CudaView, CudaViewMut, RawView};
use crate::comm::ReduceOp;
use crate::tensor::DType;
use crate::Result;

/// Address, dtype, length and device handle of a device view, for its descriptor.
pub(super) fn parts(v: &CudaView<'_>) -> (usize, DType, usize, usize) {
    let r = v.raw();
    (r.ptr as usize, r.dtype, r.len, r.dev)
}

/// A rank's input, or with `out` its output, as [`RawView`].
fn raw(d: &Desc, out: bool) -> RawView {
    let (ptr, len, dtype, dev) = match out {
        false => (d.src, d.len_in, d.dtype, d.src_dev),
        true => (d.dst, d.len_out, d.dtype_out, d.dst_dev),
    };
    RawView {
        ptr: ptr as u64,
        len,
        dtype,
        dev,
    }
}

/// A rank's input as a view.
///
/// # Safety
/// Only between the entry and release barriers of the collective `d` was announced for.
unsafe fn input<'a>(d: &Desc) -> CudaView<'a> {
    // SAFETY: the announcing rank keeps the view borrowed until the release barrier.
    unsafe { CudaView::from_raw(raw(d, false)) }
}

/// A rank's output (or in-place buffer) as a mutable view.
///
/// # Safety
/// As [`input`]; the caller writes only the elements its rank owns in this collective.
unsafe fn output<'a>(d: &Desc, in_place: bool) -> CudaViewMut<'a> {
    // SAFETY: the announcing rank keeps the view borrowed until the release barrier, and the
    // data phase gives every element to one writer.
    unsafe { CudaViewMut::from_raw(raw(d, !in_place)) }
}

/// The device handle a descriptor's field points to (0: none).
///
/// # Safety
/// `dev` is from this rank's announcement, or a peer's between the entry and release barriers
/// of the collective it announced (its view is alive until the release).
unsafe fn handle<'a>(dev: usize) -> Option<&'a Arc<CudaDevice>> {
    // SAFETY: see above.
    (dev != 0).then(|| unsafe { &*(dev as *const Arc<CudaDevice>) })
}

pub(super) use crate::comm::events::Marks;

/// The device that computes rank `d`'s share (its output's; a rank whose two buffers are in
/// different places is refused at the entry check).
///
/// # Safety
/// As [`handle`].
unsafe fn own_of<'a>(d: &Desc) -> Option<&'a Arc<CudaDevice>> {
    // SAFETY: see above.
    unsafe { handle(d.dst_dev).or(handle(d.src_dev)) }
}

/// `own`'s collective stream waits for every rank's `ready` events.
///
/// # Safety
/// Between the entry and release barriers of the collective `peers` announced.
unsafe fn wait_ready(own: &CudaDevice, peers: &[Desc]) -> Result<()> {
    for p in peers {
        for (e, dev) in p.ready.iter().zip([p.src_dev, p.dst_dev]) {
            // SAFETY: see above.
            if let (Some(dev), true) = (unsafe { handle(dev) }, *e != 0) {
                wait_peer_event(own.driver(), COLLECTIVE, dev.driver(), Event(*e))?;
            }
        }
    }
    Ok(())
}

/// `devs`' compute streams wait for every rank's `done` event.
///
/// # Safety
/// As [`wait_ready`].
unsafe fn wait_done(devs: &[&Arc<CudaDevice>], peers: &[Desc]) -> Result<()> {
    for p in peers.iter().filter(|p| p.done != 0) {
        // SAFETY: see above.
        let Some(owner) = (unsafe { own_of(p) }) else {
            continue;
        };
        for dev in devs {
            wait_peer_event(
                dev.driver(),
                StreamKind::Compute,
                owner.driver(),
                Event(p.done),
            )?;
        }
    }
    Ok(())
}

/// The stream ranks' shares run on when there are peers.
const COLLECTIVE: StreamKind = StreamKind::Collective;

impl LocalComm {
    /// Announces `desc` and runs this rank's share `data` on its output's device, on the
    /// stream it is given; releases always, so a failed share never leaves peers waiting.
    /// Alone, the share runs on the compute stream that produced the data, in order; with
    /// peers, on the collective stream, ordered by events (see the module documentation).
    fn device_collective(
        &self,
        mut desc: Desc,
        data: impl FnOnce(&[Desc], &Arc<CudaDevice>, StreamKind) -> Result<()>,
    ) -> Result<()> {
        // SAFETY: both fields come from this rank's live views.
        let (src, dst) = unsafe { (handle(desc.src_dev), handle(desc.dst_dev)) };
        let Some(own) = dst.or(src) else {
            return Err(crate::Error::Invalid(
                "a device collective without a device buffer".into(),
            ));
        };
        let start = Instant::now();
        if crate::comm::Communicator::world_size(self) == 1 {
            self.enter(desc, start)?;
            let r = data(&self.peers.borrow(), own, StreamKind::Compute);
            return r.and(self.release(desc.op, start));
        }
        // Input and output on one device: one set of events covers both.
        let second = dst.filter(|d| !src.is_some_and(|s| Arc::ptr_eq(s, d)));
        let devs: Vec<&Arc<CudaDevice>> = [src, second].into_iter().flatten().collect();
        for (slot, dev) in [src, second].into_iter().enumerate() {
            if let Some(dev) = dev {
                let (ready, _) = self.marks.of(dev)?;
                dev.driver().event_record(ready, StreamKind::Compute)?;
                desc.ready[slot] = ready.0;
            }
        }
        let done = self.marks.of(own)?.1;
        desc.done = done.0;
        self.enter(desc, start)?;
        let peers = self.peers.borrow();
        // SAFETY: between this collective's entry and release barriers.
        let r = unsafe { wait_ready(own, &peers) }
            .and_then(|()| data(&peers, own, COLLECTIVE))
            .and_then(|()| own.driver().event_record(done, COLLECTIVE));
        // Past this barrier every rank has recorded `done`.
        let recorded = self.release(desc.op, start);
        let waited = match (&r, &recorded) {
            // SAFETY: peers are held at the release barrier below.
            (Ok(()), Ok(())) => unsafe { wait_done(&devs, &peers) },
            _ => Ok(()),
        };
        let released = self.release(desc.op, start);
        r.and(recorded).and(waited).and(released)
    }
}

/// Rank `me`'s share of an all-reduce: chunk `me` of every buffer, summed into all of them.
pub(super) fn all_reduce(c: &LocalComm, d: Desc, op: ReduceOp) -> Result<()> {
    let me = c.rank;
    c.device_collective(d, |peers, own, s| {
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
        reduce_runs(own, &srcs, &mut dsts, op, s)
    })
}

/// Rank `me`'s share of a reduce-scatter: block `me` of every input, into its own output.
pub(super) fn reduce_scatter(c: &LocalComm, d: Desc, op: ReduceOp) -> Result<()> {
    let me = c.rank;
    c.device_collective(d, |peers, own, s| {
        let m = peers[me].len_out;
        // SAFETY: inside the collective; inputs are only read, the output is this rank's.
        let srcs = peers
            .iter()
            .map(|p| unsafe { input(p) }.range(me * m..(me + 1) * m))
            .collect::<Result<Vec<_>>>()?;
        let mut dst = [unsafe { output(&peers[me], false) }];
        reduce_runs(own, &srcs, &mut dst, op, s)
    })
}

/// Rank `me`'s share of an all-gather: every input, into its own output.
pub(super) fn all_gather(c: &LocalComm, d: Desc) -> Result<()> {
    let me = c.rank;
    c.device_collective(d, |peers, own, s| {
        let m = peers[me].len_in;
        // SAFETY: inside the collective; inputs are only read, the output is this rank's.
        let mut out = unsafe { output(&peers[me], false) };
        for (k, p) in peers.iter().enumerate() {
            let dst = out.reborrow().range(k * m..(k + 1) * m)?;
            copy_between(own, unsafe { input(p) }, dst, s)?;
        }
        Ok(())
    })
}

/// Rank `me`'s share of a broadcast: the root's buffer into its own, unless it is the root.
pub(super) fn broadcast(c: &LocalComm, d: Desc) -> Result<()> {
    let me = c.rank;
    c.device_collective(d, |peers, own, s| {
        let root = peers[me].root;
        if me == root {
            return Ok(());
        }
        // SAFETY: inside the collective; the root's buffer is only read, ours is this rank's.
        let (src, dst) = unsafe { (input(&peers[root]), output(&peers[me], true)) };
        copy_between(own, src, dst, s)
    })
}
