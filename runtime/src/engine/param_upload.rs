//! Stage 3 with a shard group of one rank (world size 1, or MiCS with `mics_shard_size = 1` at
//! any world size): the rank's shard is the whole parameter, so a unit's "gather" is a copy
//! to the compute device, not a collective. A shard in host memory (`offload_param.device =
//! "cpu"`, page-locked once when the engine is built: `Group::pin`) goes up straight from the
//! store on the host-to-device stream, started for unit i+1 while unit i computes (in forward
//! and in backward, with or without `overlap_comm`); the compute stream waits for that copy's
//! event where the unit starts, and the host never waits for it. A shard on the device is
//! copied on the compute stream. Either way the bits are the shard's, as the all-gather of one
//! rank gives them.
//!
//! Why the store may be read by a copy in flight: the host writes a shard only in the
//! optimizer step (and in `set_parameters` and loads, which first drop the uploads started
//! ahead, waiting for them). An upload of group g is either awaited by the compute stream
//! before unit g's kernels, and the step of g writes only after the host waited for g's
//! gradient download, which the copy stream starts after an event recorded behind those
//! kernels (`offload_copies.rs`); or it is dropped unused, after a host wait.

use std::collections::hash_map::Entry;
use std::collections::HashMap;

use ferrozero_config::resolved::ResolvedConfig;

use super::group::{Group, ParamStore};
use super::ledger::{Category, Ledger, Location};
use super::rules;
use crate::backend::{Backend, Stream, StreamEvent};
use crate::tensor::Storage;
use crate::Result;

/// An upload started ahead of its unit: the device buffer, the event after the copy into it,
/// and the optimizer step it belongs to (a later step changed the shard).
type Ahead = (Storage, Option<StreamEvent>, u64);

/// The parameter uploads of a one-rank stage-3 engine.
#[derive(Debug, Default)]
pub struct ParamUploads {
    ahead: HashMap<usize, Ahead>,
}

impl ParamUploads {
    /// Waits for every upload started ahead and drops it (before the shards they read are
    /// freed: the engine's drop).
    pub(super) fn wait_all(&mut self) {
        for (g, (_, done, _)) in self.ahead.drain() {
            if let Some(Err(e)) = done.map(|e| e.synchronize()) {
                tracing::error!("an upload of group {g} ahead of its use failed: {e}");
            }
        }
    }
}

impl Drop for ParamUploads {
    fn drop(&mut self) {
        // A copy may still read its shard: wait for it.
        self.wait_all();
    }
}

/// Whether `grp` is a stage-3 shard of a one-rank shard group (its layout's world is the
/// shard group), in memory and not gathered.
fn uploads_directly(grp: &Group) -> bool {
    let ParamStore::Partitioned {
        shard,
        gathered: None,
    } = &grp.params
    else {
        return false;
    };
    grp.layout.world_size == 1 && shard.resident().is_some()
}

/// Starts the copy of group `g`'s shard to the device, counted as prefetched parameters.
fn start_upload(
    (g, grp): (usize, &Group),
    be: &dyn Backend,
    ledger: &mut Ledger,
) -> Result<(Storage, Option<StreamEvent>)> {
    let ParamStore::Partitioned { shard, .. } = &grp.params else {
        return Err(crate::Error::Invalid(format!(
            "group {g} is not partitioned"
        )));
    };
    let shard = shard
        .resident()
        .ok_or_else(|| super::group::not_resident("upload"))?;
    let mut full = be.buffer_uninit(shard.dtype(), shard.len())?;
    // SAFETY: the shard is not written before the copy completes (the module's comment).
    let done = unsafe {
        full.view_mut()
            .upload_async_from(shard.view(), Stream::HostToDevice)?
    };
    ledger.alloc(Location::Device, Category::Prefetch, full.bytes());
    Ok((full, done))
}

/// Frees an unused upload's device buffer once its copy has completed.
fn drop_ahead((full, done, _): Ahead, be: &dyn Backend, ledger: &mut Ledger) -> Result<()> {
    if let Some(e) = done {
        e.synchronize()?;
    }
    ledger.free(Location::Device, Category::Prefetch, full.bytes());
    be.recycle(full);
    Ok(())
}

impl ParamUploads {
    /// Starts uploading group `g` ahead of its unit for optimizer step `step`; false when `g`
    /// is not uploaded directly or its shard is on the device (a copy on the compute stream
    /// gains nothing by starting early and would hold a unit's memory sooner).
    pub(super) fn prefetch(
        &mut self,
        (g, grp): (usize, &Group),
        (cfg, step): (&ResolvedConfig, u64),
        be: &dyn Backend,
        ledger: &mut Ledger,
    ) -> Result<bool> {
        if !uploads_directly(grp) || !rules::uploads_ahead(cfg, grp.layout.world_size) {
            return Ok(false);
        }
        if let Entry::Vacant(e) = self.ahead.entry(g) {
            let (full, done) = start_upload((g, grp), be, ledger)?;
            e.insert((full, done, step));
        }
        Ok(true)
    }

    /// Installs group `g`'s parameters without a collective when it is uploaded directly:
    /// the upload started ahead for `step`, else one started now; the compute stream waits
    /// for it.
    pub(super) fn gather(
        &mut self,
        (g, grp): (usize, &mut Group),
        step: u64,
        be: &dyn Backend,
        ledger: &mut Ledger,
    ) -> Result<()> {
        if !uploads_directly(grp) {
            return Ok(());
        }
        let (full, done) = match self.ahead.remove(&g) {
            Some((full, done, s)) if s == step => (full, done),
            stale => {
                if let Some(old) = stale {
                    drop_ahead(old, be, ledger)?;
                }
                start_upload((g, grp), be, ledger)?
            }
        };
        if let Some(e) = &done {
            be.wait_event(Stream::Compute, e)?;
        }
        if let ParamStore::Partitioned { gathered, .. } = &mut grp.params {
            *gathered = Some(full);
        }
        Ok(())
    }

    /// Drops every upload started ahead and not used (before the host writes shards outside
    /// the optimizer step).
    pub(in crate::engine) fn drop_all(
        &mut self,
        be: &dyn Backend,
        ledger: &mut Ledger,
    ) -> Result<()> {
        let ahead: Vec<Ahead> = self.ahead.drain().map(|(_, a)| a).collect();
        ahead
            .into_iter()
            .try_for_each(|a| drop_ahead(a, be, ledger))
    }
}
