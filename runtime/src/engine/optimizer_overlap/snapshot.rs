//! What a speculative optimizer step needs to be undone exactly: a host copy of the values
//! the update overwrites (the f32 parameters or master weights, the moments and the rounded
//! parameter copy) taken just before the group is stepped, and written back bit for bit when
//! the step's real values turn out different (clipping binds) or the step is skipped (an fp16
//! overflow). The buffers are allocated once per group and reused every step.

use crate::engine::group::{owned_params, Group, ParamStore};
use crate::engine::ledger::{Category, Ledger, Location};
use crate::tensor::staging::{read_host, StagedMut};
use crate::tensor::{DType, FlatBuf, View, ViewMut};
use crate::{Error, Result};

/// One group's saved optimizer values, in host memory.
#[derive(Debug)]
pub(in crate::engine) struct Snapshot {
    /// The f32 values the optimizer updates (master weights, or f32 parameters).
    p: FlatBuf,
    /// First moment (or momentum).
    m: FlatBuf,
    /// Second moment (empty without one).
    v: FlatBuf,
    /// The stored low-precision copy over the owned range, when the update writes one.
    lp: Option<FlatBuf>,
}

impl Snapshot {
    /// Buffers shaped like `g`'s optimizer values, counted in the ledger as host optimizer
    /// state (the estimator's replay counts the same bytes: [`snapshot_bytes`]).
    pub(in crate::engine) fn for_group(g: &Group, ledger: &mut Ledger) -> Self {
        let n = g.owned.len();
        let lp_dtype = match &g.params {
            ParamStore::Replicated(b) => b.dtype(),
            ParamStore::Partitioned { shard, .. } => shard.dtype(),
        };
        // The values updated are the f32 master weights, or the parameters themselves.
        let p_dtype = g.master.as_ref().map_or(lp_dtype, |m| m.dtype());
        let s = Snapshot {
            p: FlatBuf::zeros(p_dtype, n),
            m: FlatBuf::zeros(g.m.dtype(), g.m.len()),
            v: FlatBuf::zeros(g.v.dtype(), g.v.len()),
            lp: g.master.as_ref().map(|_| FlatBuf::zeros(lp_dtype, n)),
        };
        ledger.alloc(Location::Host, Category::OptimizerState, s.bytes());
        s
    }

    /// Host bytes held.
    pub(in crate::engine) fn bytes(&self) -> u64 {
        let lp = self.lp.as_ref().map_or(0, FlatBuf::bytes);
        self.p.bytes() + self.m.bytes() + self.v.bytes() + lp
    }

    /// Copies `g`'s current optimizer values in.
    pub(in crate::engine) fn save(&mut self, g: &mut Group) -> Result<()> {
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
        save_view("parameters", p.as_view(), &mut self.p)?;
        save_view("first moment", m.view(), &mut self.m)?;
        save_view("second moment", v.view(), &mut self.v)?;
        if let (Some((b, off)), Some(dst)) = (lp, self.lp.as_mut()) {
            save_view("rounded parameters", b.range(off..off + n)?, dst)?;
        }
        Ok(())
    }

    /// Writes the saved values back into `g`, bit for bit.
    pub(in crate::engine) fn restore(&self, g: &mut Group) -> Result<()> {
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
        restore_view("parameters", p, &self.p)?;
        restore_view("first moment", m.view_mut(), &self.m)?;
        restore_view("second moment", v.view_mut(), &self.v)?;
        if let (Some((b, off)), Some(src)) = (lp, self.lp.as_ref()) {
            restore_view("rounded parameters", b.range_mut(off..off + n)?, src)?;
        }
        Ok(())
    }
}

/// The host bytes of one group's [`Snapshot`] from sizes alone: the group's optimizer state
/// (`opt_bytes`: master weights, if any, and moments) and the `owned` parameters in their
/// storage `dtype` (the rounded copy beside master weights, or the values updated themselves).
pub(in crate::engine) fn snapshot_bytes(owned: usize, opt_bytes: u64, dtype: DType) -> u64 {
    opt_bytes + (owned * dtype.size()) as u64
}

fn mismatch(what: &str, want: (DType, usize), got: (DType, usize)) -> Error {
    Error::Invalid(format!(
        "optimizer snapshot of the {what}: {:?}x{} saved, {:?}x{} in the group",
        want.0, want.1, got.0, got.1
    ))
}

fn save_view(what: &str, src: View<'_>, dst: &mut FlatBuf) -> Result<()> {
    if (src.dtype(), src.len()) != (dst.dtype(), dst.len()) {
        return Err(mismatch(
            what,
            (dst.dtype(), dst.len()),
            (src.dtype(), src.len()),
        ));
    }
    read_host(src, |h| {
        dst.as_mut().bytes_mut().copy_from_slice(h.bytes());
        Ok(())
    })
}

fn restore_view(what: &str, dst: ViewMut<'_>, src: &FlatBuf) -> Result<()> {
    if (dst.dtype(), dst.len()) != (src.dtype(), src.len()) {
        return Err(mismatch(
            what,
            (src.dtype(), src.len()),
            (dst.dtype(), dst.len()),
        ));
    }
    // Every element is overwritten: a device view is uploaded without a download first.
    let mut staged = StagedMut::overwrite(dst);
    staged
        .host_mut()
        .bytes_mut()
        .copy_from_slice(src.as_ref().bytes());
    staged.finish()
}
