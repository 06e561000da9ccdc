//! What a speculative optimizer step needs to be undone exactly: a host copy of the values
//! the update overwrites (the f32 parameters or master weights, the moments and the rounded
//! parameter copy) taken just before the group is stepped, and written back bit for bit when
//! the step's real values turn out different (clipping binds) or the step is skipped (an fp16
//! overflow).
//!
//! Values in host memory (offloaded optimizer state, or everything on the CPU) are copied in
//! place into buffers allocated once per group. Values in device memory (the parameters the
//! offloaded step uploads) travel on the copy streams, ordered by events, and the host never
//! waits for them: saved on the device-to-host stream behind an event of the compute stream
//! (the update, on the compute stream or uploaded on the host-to-device stream, waits for that
//! download's event before it overwrites them), restored on the host-to-device stream behind
//! an event of the compute stream, which then waits for the restore's event before it reads
//! them again. The staging memory a device value went to is the snapshot until the next save.

use crate::backend::{Backend, Stream};
use crate::engine::group::{owned_params, Group, ParamStore};
use crate::engine::ledger::{Category, Ledger, Location};
use crate::tensor::in_flight::{staging_page_locked, HostCopy};
use crate::tensor::Storage;
use crate::tensor::{DType, View, ViewMut};
use crate::{Error, Result};

/// One saved value.
#[derive(Debug)]
enum Slot {
    /// Not saved yet: its dtype and length.
    Empty(DType, usize),
    /// A host value's copy (size-only for a size-only value).
    Host(Storage),
    /// A device value's copy in page-locked staging memory, possibly still on its way down
    /// (or back up after a restore).
    Device(HostCopy),
}

impl Slot {
    fn shape(&self) -> (DType, usize) {
        match self {
            Slot::Empty(d, n) => (*d, *n),
            Slot::Host(b) => (b.dtype(), b.len()),
            Slot::Device(c) => (c.dtype(), c.len()),
        }
    }
}

/// One group's saved optimizer values.
#[derive(Debug)]
pub(in crate::engine) struct Snapshot {
    /// The f32 values the optimizer updates (master weights, or f32 parameters).
    p: Slot,
    /// First moment (or momentum).
    m: Slot,
    /// Second moment (empty without one).
    v: Slot,
    /// The stored low-precision copy over the owned range, when the update writes one.
    lp: Option<Slot>,
}

impl Snapshot {
    /// A snapshot shaped like `g`'s optimizer values, counted in the ledger as host optimizer
    /// state.
    pub(in crate::engine) fn for_group(g: &Group, ledger: &mut Ledger) -> Self {
        let n = g.owned.len();
        let (p_dtype, lp_dtype) = dtypes(g);
        let lp = g.master.as_ref().map(|_| Slot::Empty(lp_dtype, n));
        // Counted whichever memory holds them (buffers of its own, or staging memory).
        ledger.alloc(Location::Host, Category::OptimizerState, Self::bytes_of(g));
        Snapshot {
            p: Slot::Empty(p_dtype, n),
            m: Slot::Empty(g.m.dtype(), g.m.len()),
            v: Slot::Empty(g.v.dtype(), g.v.len()),
            lp,
        }
    }

    /// The bytes a snapshot of `g` holds: the values updated, the moments and, beside
    /// master weights, the rounded copy.
    pub(in crate::engine) fn bytes_of(g: &Group) -> u64 {
        slots_of(g).iter().map(|&(_, b)| b).sum()
    }

    /// Of [`Snapshot::bytes_of`], the bytes the device's staging memory will hold page-locked:
    /// the slots of device values large enough for the staging pool to register. The ledger
    /// counts them as host optimizer state and the device as page-locked, so a host-memory
    /// total subtracts them once.
    pub(in crate::engine) fn locked_bytes_of(g: &Group) -> u64 {
        slots_of(g)
            .iter()
            .filter(|&&(on_device, b)| on_device && staging_page_locked(b))
            .map(|&(_, b)| b)
            .sum()
    }

    /// Saves `g`'s current optimizer values; the device ones are on their way down when this
    /// returns, and the compute and host-to-device streams wait for them before any update.
    pub(in crate::engine) fn save(&mut self, g: &mut Group, be: &dyn Backend) -> Result<()> {
        let Group {
            params,
            master,
            m,
            v,
            owned,
            ..
        } = g;
        let n = owned.len();
        let (p, lp) = owned_params(params, master, owned)?;
        let ready = be.record(Stream::Compute)?;
        be.wait_event(Stream::DeviceToHost, &ready)?;
        save_view("parameters", p.as_view(), &mut self.p)?;
        save_view("first moment", m.view(), &mut self.m)?;
        save_view("second moment", v.view(), &mut self.v)?;
        if let (Some((b, off)), Some(dst)) = (lp, self.lp.as_mut()) {
            save_view("rounded parameters", b.range(off..off + n)?, dst)?;
        }
        // The device-to-host stream runs in issue order: the last download's event covers all.
        if let Some(e) = self.last_event() {
            be.wait_event(Stream::Compute, e)?;
            be.wait_event(Stream::HostToDevice, e)?;
        }
        Ok(())
    }

    /// Writes the saved values back into `g`, bit for bit; the compute stream waits for the
    /// device ones before it reads them.
    pub(in crate::engine) fn restore(&mut self, g: &mut Group, be: &dyn Backend) -> Result<()> {
        let Group {
            params,
            master,
            m,
            v,
            owned,
            ..
        } = g;
        let n = owned.len();
        let (p, lp) = owned_params(params, master, owned)?;
        let ready = be.record(Stream::Compute)?;
        be.wait_event(Stream::HostToDevice, &ready)?;
        restore_view("parameters", p, &mut self.p)?;
        restore_view("first moment", m.view_mut(), &mut self.m)?;
        restore_view("second moment", v.view_mut(), &mut self.v)?;
        if let (Some((b, off)), Some(src)) = (lp, self.lp.as_mut()) {
            restore_view("rounded parameters", b.range_mut(off..off + n)?, src)?;
        }
        // The host-to-device stream runs in issue order: the last upload's event covers all.
        if let Some(e) = self.last_event() {
            be.wait_event(Stream::Compute, e)?;
        }
        Ok(())
    }

    /// The event of the last copy in flight on a device value, if any.
    fn last_event(&self) -> Option<&crate::backend::StreamEvent> {
        [
            Some(&self.p),
            Some(&self.m),
            Some(&self.v),
            self.lp.as_ref(),
        ]
        .into_iter()
        .flatten()
        .rev()
        .find_map(|s| match s {
            Slot::Device(c) => c.event(),
            _ => None,
        })
    }
}

/// Each slot of `g`'s snapshot: whether its value lives in device memory (its copy then goes
/// to the device's staging memory), and its bytes.
fn slots_of(g: &Group) -> [(bool, u64); 4] {
    let n = g.owned.len();
    let (p_dtype, lp_dtype) = dtypes(g);
    let stored = match &g.params {
        ParamStore::Replicated(b) => Some(b),
        ParamStore::Partitioned { shard, .. } => shard.resident(),
    };
    let on_device = |s: Option<&Storage>| s.is_some_and(|s| !s.is_host_side());
    let lp = g.master.as_ref().map_or(0, |_| lp_dtype.size() * n) as u64;
    [
        (
            on_device(g.master.as_ref().or(stored)),
            (p_dtype.size() * n) as u64,
        ),
        (on_device(Some(&g.m)), g.m.bytes()),
        (on_device(Some(&g.v)), g.v.bytes()),
        (on_device(stored), lp),
    ]
}

/// The dtypes of the values a step updates (the f32 master weights, or the parameters
/// themselves) and of the stored parameters.
fn dtypes(g: &Group) -> (DType, DType) {
    let lp = match &g.params {
        ParamStore::Replicated(b) => b.dtype(),
        ParamStore::Partitioned { shard, .. } => shard.dtype(),
    };
    (g.master.as_ref().map_or(lp, |m| m.dtype()), lp)
}

/// Which groups a speculative overlap snapshots, from each group's snapshot bytes, the shared
/// group's index (the tied parameters, final only after backward reaches their first user)
/// and the rank's budget (`None`: every group): in the order backward finishes them (the last
/// unit first, the shared group last), as many as fit, and no later one. The first have the
/// most of backward left to be stepped behind; the others are stepped after backward, when
/// the norm is known, and need no snapshot.
pub(in crate::engine) fn snapshot_plan(
    bytes: &[u64],
    shared: Option<usize>,
    budget: Option<u64>,
) -> Vec<bool> {
    let Some(mut left) = budget else {
        return vec![true; bytes.len()];
    };
    let mut plan = vec![false; bytes.len()];
    let units = (0..bytes.len()).rev().filter(|&g| Some(g) != shared);
    for g in units.chain(shared.filter(|&s| s < bytes.len())) {
        if bytes[g] > left {
            break;
        }
        left -= bytes[g];
        plan[g] = true;
    }
    plan
}

fn mismatch(what: &str, want: (DType, usize), got: (DType, usize)) -> Error {
    Error::Invalid(format!(
        "optimizer snapshot of the {what}: {:?}x{} saved, {:?}x{} in the group",
        want.0, want.1, got.0, got.1
    ))
}

/// Saves `src` into `dst`: a device view queued on the device-to-host stream (ordered by the
/// caller), a host view copied now.
fn save_view(what: &str, src: View<'_>, dst: &mut Slot) -> Result<()> {
    let want = dst.shape();
    if (src.dtype(), src.len()) != want {
        return Err(mismatch(what, want, (src.dtype(), src.len())));
    }
    if let Some(c) = src.download_async(Stream::DeviceToHost)? {
        *dst = Slot::Device(c);
        return Ok(());
    }
    if !matches!(dst, Slot::Host(_)) {
        *dst = Slot::Host(src.host_zeros_like()?);
    }
    let Slot::Host(buf) = dst else {
        unreachable!("a host slot was made above")
    };
    crate::tensor::copy_view(src, buf.view_mut())
}

/// Writes `src` back into `dst`: a device value queued on the host-to-device stream (ordered
/// by the caller), a host value copied now.
fn restore_view(what: &str, dst: ViewMut<'_>, src: &mut Slot) -> Result<()> {
    let want = src.shape();
    if (dst.dtype(), dst.len()) != want {
        return Err(mismatch(what, want, (dst.dtype(), dst.len())));
    }
    match src {
        Slot::Empty(..) => Err(Error::Invalid(format!(
            "optimizer snapshot of the {what}: restored before it was saved"
        ))),
        Slot::Device(c) => c.upload_async(dst, Stream::HostToDevice),
        // A host slot saved a value where it lives (host memory, or size-only), and is
        // restored into the same buffer: a copy on one device.
        Slot::Host(b) => crate::tensor::copy_view(b.view(), dst),
    }
}
