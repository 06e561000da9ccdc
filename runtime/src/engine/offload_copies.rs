//! The offloaded optimizer's copies on the copy streams, ordered by events (ZeRO-Offload's data
//! path without a stalled compute stream). For each group whose optimizer state is in host
//! memory:
//!
//! 0. The gradient is in host memory already: with the state off the device the accumulator
//!    is host memory, fed bucket by bucket during backward (`grad_download.rs`).
//! 1. [`fetch`]: once its gradient is final, an event recorded on the compute stream, the
//!    device-to-host stream waiting for it, and whatever the step reads from device memory
//!    (the parameters, when they are their own master weights) downloaded on that stream into
//!    page-locked staging memory. The issuing thread does not wait.
//! 2. [`host_step`]: the host update waits for that group's download alone (a host wait on
//!    its event), runs in `sub_group_size` tiles, writes the stored parameters into staging
//!    memory and queues their upload on the host-to-device stream.
//! 3. [`Landing::await_on`]: the compute stream waits for the upload's event only where the
//!    parameters are next used (the unit's gather in the next forward, a publish, a rollback,
//!    a read by the caller); the host never waits for it.
//! 4. [`UploadWindow`]: the staging memory an upload goes up from is held until
//!    [`rules::UPLOADS_IN_FLIGHT`] later groups have queued theirs, then given back (a host
//!    wait on that upload alone, long complete by then). So the staging pool holds a few
//!    groups' parameters, not the whole model's (a 7B's 12.6 GiB page-locked otherwise).
//!
//! On the CPU every view is host memory: nothing is copied, every event is complete, and the
//! update runs in place on the same tiles with the same arithmetic, so no bit changes.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use super::group::{owned_params, Group, ParamStore};
use super::optimizer::StepValues;
use super::partition::chunks;
use super::rules;
use crate::backend::{Backend, GradView, Stream, UpdateRule};
use crate::tensor::in_flight::HostCopy;
use crate::tensor::{Storage, View, ViewMut};
use crate::{Error, Result};

/// What a group's host step reads from device memory, on its way down. The default is
/// "not fetched": the step then fetches it itself and waits at once.
#[derive(Debug, Default)]
pub struct Inbound {
    fetched: bool,
    /// The owned range of the gradient.
    grads: Option<HostCopy>,
    /// The owned parameters, when the step updates them in place (no separate master weights).
    params: Option<HostCopy>,
}

/// The staging copies of one group's upload, shared by the group's [`Landing`] (which orders
/// readers after them) and the [`UploadWindow`] (which gives their memory back).
type Copies = Arc<Mutex<Vec<HostCopy>>>;

fn lock(c: &Copies) -> Result<MutexGuard<'_, Vec<HostCopy>>> {
    c.lock()
        .map_err(|_| Error::Invalid("a parameter upload's copies were poisoned by a panic".into()))
}

/// A group's updated parameters on their way up.
#[derive(Debug, Default)]
pub struct Landing {
    copies: Copies,
    /// Whether the compute stream already waits (readers of parameters hold `&Group`).
    awaited: AtomicBool,
}

impl Landing {
    /// Orders the compute stream after the uploads (the host does not wait); a no-op when
    /// nothing is in flight or the compute stream already waits.
    pub fn await_on(&self, be: &dyn Backend) -> Result<()> {
        if self.awaited.load(Ordering::Acquire) {
            return Ok(());
        }
        // The host-to-device stream runs in issue order: the last upload's event covers all.
        // Copies the window gave back were waited for: nothing to order after.
        if let Some(e) = lock(&self.copies)?.iter().rev().find_map(HostCopy::event) {
            be.wait_event(Stream::Compute, e)?;
        }
        self.awaited.store(true, Ordering::Release);
        Ok(())
    }
}

/// The staging memory of the last [`rules::UPLOADS_IN_FLIGHT`] groups' parameter uploads,
/// oldest first, shared by every thread that steps groups (the engine's and the optimizer
/// lane's). The second step holds what the first leaves here, which is why the estimate
/// measures two.
#[derive(Debug, Default)]
pub struct UploadWindow {
    held: Mutex<VecDeque<Copies>>,
}

impl UploadWindow {
    /// Holds `landing`'s staging; gives back the oldest held beyond the window, after a host
    /// wait on its upload.
    fn admit(&self, landing: &Landing) -> Result<()> {
        let mut held = self
            .held
            .lock()
            .map_err(|_| Error::Invalid("the upload window was poisoned by a panic".into()))?;
        held.push_back(landing.copies.clone());
        while held.len() > rules::UPLOADS_IN_FLIGHT {
            let Some(old) = held.pop_front() else { break };
            let mut copies = lock(&old)?;
            copies.iter_mut().try_for_each(HostCopy::wait)?;
            // Dropped after their wait: the staging goes back to the device's pool.
            copies.clear();
        }
        Ok(())
    }
}

/// Queues the downloads group `g`'s host step reads, after the compute stream's work so far.
pub(super) fn fetch(g: &Group, be: &dyn Backend) -> Result<Inbound> {
    let ready = be.record(Stream::Compute)?;
    be.wait_event(Stream::DeviceToHost, &ready)?;
    let r = g.owned.start - g.grad_offset..g.owned.end - g.grad_offset;
    let grads = g.grad.range(r)?.download_async(Stream::DeviceToHost)?;
    let own = match &g.params {
        ParamStore::Replicated(b) => Some((b, g.owned.start)),
        // A shard on NVMe that is not in yet is host memory when it comes in.
        ParamStore::Partitioned { shard, .. } => shard.resident().map(|b| (b, 0)),
    };
    let params = match (&g.master, own) {
        (None, Some((b, off))) => b
            .range(off..off + g.owned.len())?
            .download_async(Stream::DeviceToHost)?,
        _ => None,
    };
    Ok(Inbound {
        fetched: true,
        grads,
        params,
    })
}

/// A read of an offloaded group on the host, by `read`, over the owned range: the values the
/// step updates (the f32 master weights, or the parameters [`fetch`] downloads), the gradient
/// as the step reads it, and the moments. Nothing goes up: what came down goes back to the
/// staging pool when `read` returns (LAMB's first pass, before its norms are complete).
pub(super) fn host_read<R>(
    g: &mut Group,
    be: &dyn Backend,
    read: impl FnOnce(View<'_>, GradView<'_>, &mut Storage, &mut Storage) -> Result<R>,
) -> Result<R> {
    let Inbound { grads, params, .. } = fetch(g, be)?;
    let (mut grads, mut p_in) = (grads, params);
    let s = g.owned_state()?;
    let pv = match p_in.as_mut() {
        Some(c) => View::from(c.ready_ref()?),
        None => s.params.0.as_view(),
    };
    let gv = match grads.as_mut() {
        Some(c) => s.grad.read_like(View::from(c.ready_ref()?)),
        None => s.grad.range(s.owned.clone())?,
    };
    read(pv, gv, s.m, s.v)
}

/// Device views the step uploads into, with the staging copies that go up.
type Outbound<'a> = Vec<(HostCopy, ViewMut<'a>)>;

/// The update of a group whose optimizer state is in host memory, `tile` elements at a time,
/// from what [`fetch`] queued (or the views themselves where they are host memory); the
/// updated device values go up on the host-to-device stream and come back as a [`Landing`].
pub(super) fn host_step(
    rule: &UpdateRule,
    sv: &StepValues,
    tile: usize,
    g: &mut Group,
    (inbound, window): (Inbound, &UploadWindow),
    be: &dyn Backend,
) -> Result<Landing> {
    // The host beside the device runs the step (the CPU backend; a size-only device's host
    // is size-only).
    let host = be.host_backend();
    let update = |mut pv: ViewMut<'_>, gv: GradView<'_>, h: HostState<'_>| {
        let HostState { m, v, mut lp } = h;
        for t in chunks(pv.len(), tile) {
            // SGD and Lion keep no second moment: an empty view stands in.
            let vn = v.len();
            host.optimizer_update(
                rule,
                sv.step,
                sv.grad_scale,
                pv.reborrow().range(t.clone())?,
                gv.range(t.clone())?,
                m.range_mut(t.clone())?,
                v.range_mut(t.start.min(vn)..t.end.min(vn))?,
                lp.as_mut().map(|x| x.reborrow().range(t)).transpose()?,
            )?;
        }
        Ok(())
    };
    host_step_with(g, (inbound, window), be, update)
}

/// What a host step writes besides the parameters: the group's moments, and the stored
/// low-precision copy (in staging memory when it lives on the device), over the owned range.
pub(super) struct HostState<'a> {
    /// First moment (or momentum).
    pub m: &'a mut Storage,
    /// Second moment (empty for one-state optimizers).
    pub v: &'a mut Storage,
    /// The stored copy to write, when the step writes one.
    pub lp: Option<ViewMut<'a>>,
}

/// A host step of an offloaded group whose arithmetic is `update`, handed host views of the
/// owned range: the updated values (the f32 master weights, or the parameters downloaded by
/// [`fetch`]), the gradient as the step reads it, and [`HostState`]. The device values it
/// writes go up on the host-to-device stream and come back as a [`Landing`].
pub(super) fn host_step_with(
    g: &mut Group,
    (inbound, window): (Inbound, &UploadWindow),
    be: &dyn Backend,
    update: impl FnOnce(ViewMut<'_>, GradView<'_>, HostState<'_>) -> Result<()>,
) -> Result<Landing> {
    let inbound = match inbound.fetched {
        true => inbound,
        false => fetch(g, be)?,
    };
    let Group {
        params,
        master,
        grad,
        grad_read,
        grad_offset,
        m,
        v,
        owned,
        ..
    } = g;
    let n = owned.len();
    let Inbound {
        mut grads,
        params: mut p_in,
        ..
    } = inbound;
    let (p, lp) = owned_params(params, master, owned)?;
    let mut up: Outbound<'_> = Vec::new();
    let p = match p_in.take() {
        Some(c) => {
            up.push((c, p));
            None
        }
        None => Some(p),
    };
    let lp = match lp {
        Some((b, off)) => {
            let view = b.range_mut(off..off + n)?;
            match view.staging_copy() {
                Some(c) => {
                    up.push((c, view));
                    None
                }
                None => Some(view),
            }
        }
        None => None,
    };
    {
        let gv = match grads.as_mut() {
            Some(c) => View::from(c.ready_ref()?),
            None => grad.range(owned.start - *grad_offset..owned.end - *grad_offset)?,
        };
        // A moved gradient is read as its accumulator's dtype here too.
        let gv = super::group::read_as(gv, *grad_read);
        // The staged copies, in the order pushed: the parameters first when they went down.
        let mut staged = up.iter_mut().map(|(c, _)| c);
        let pv = match p {
            Some(p) => p,
            None => ViewMut::from(staged.next().expect("pushed above").ready()?),
        };
        let lpv = match lp {
            Some(v) => Some(v),
            None => staged
                .next()
                .map(|c| c.ready().map(ViewMut::from))
                .transpose()?,
        };
        update(pv, gv, HostState { m, v, lp: lpv })?;
    }
    let landing = Landing::default();
    {
        let mut copies = lock(&landing.copies)?;
        for (mut c, dst) in up {
            c.upload_async(dst, Stream::HostToDevice)?;
            copies.push(c);
        }
    }
    window.admit(&landing)?;
    Ok(landing)
}
