//! Stage 3 at one rank: the rank's shard is the whole parameter, so a unit's "gather" is a copy
//! to the compute device, not a collective. A shard in host memory (`offload_param.device =
//! "cpu"`) goes up through page-locked staging on the host-to-device stream, started for unit
//! i+1 while unit i computes (in forward and in backward, with or without `overlap_comm`); the
//! compute stream waits for that copy's event where the unit starts, and the host never waits
//! for it. A shard on the device is copied on the compute stream. Either way the bits are the
//! shard's, as the all-gather of one rank gives them.

use std::collections::{HashMap, VecDeque};

use super::build::param_location;
use super::core::Engine;
use super::group::ParamStore;
use super::ledger::{Category, Location};
use crate::backend::Stream;
use crate::tensor::in_flight::HostCopy;
use crate::tensor::Storage;
use crate::Result;

/// Staging copies kept until their uploads complete before the oldest is waited for.
const RETIRING: usize = 4;

/// An upload started ahead of its unit: the device buffer, the copy in flight into it, and
/// the optimizer step it belongs to (a later step changed the shard).
type Ahead = (Storage, Option<HostCopy>, u64);

/// The parameter uploads of a one-rank stage-3 engine.
#[derive(Debug, Default)]
pub struct ParamUploads {
    ahead: HashMap<usize, Ahead>,
    /// Staging copies the compute stream already waits for, until they are complete.
    retiring: VecDeque<HostCopy>,
}

impl Engine {
    /// Whether group `g` is a stage-3 shard of one rank, in memory and not gathered.
    fn uploads_directly(&self, g: usize) -> bool {
        let grp = &self.groups[g];
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
    fn start_upload(&mut self, g: usize) -> Result<(Storage, Option<HostCopy>)> {
        let ParamStore::Partitioned { shard, .. } = &self.groups[g].params else {
            return Err(crate::Error::Invalid(format!(
                "group {g} is not partitioned"
            )));
        };
        let shard = shard
            .resident()
            .ok_or_else(|| super::group::not_resident("upload"))?;
        let mut full = self.be.buffer_uninit(shard.dtype(), shard.len())?;
        let copy = full
            .view_mut()
            .copy_from_async(shard.view(), Stream::HostToDevice)?;
        self.ledger
            .alloc(Location::Device, Category::Prefetch, full.bytes());
        Ok((full, copy))
    }

    /// Starts uploading group `g` ahead of its unit; false when `g` is not uploaded directly
    /// or its shard is on the device (a copy on the compute stream gains nothing by starting
    /// early and would hold a unit's memory sooner).
    pub(super) fn prefetch_upload(&mut self, g: usize) -> Result<bool> {
        if !self.uploads_directly(g) || param_location(&self.cfg) != Location::Host {
            return Ok(false);
        }
        if !self.param_uploads.ahead.contains_key(&g) {
            let (full, copy) = self.start_upload(g)?;
            let step = self.steps;
            self.param_uploads.ahead.insert(g, (full, copy, step));
        }
        Ok(true)
    }

    /// Installs group `g`'s parameters without a collective when it is uploaded directly:
    /// the upload started ahead, else one started now; the compute stream waits for it.
    pub(super) fn gather_direct(&mut self, g: usize) -> Result<()> {
        if !self.uploads_directly(g) {
            return Ok(());
        }
        let (full, copy) = match self.param_uploads.ahead.remove(&g) {
            Some((full, copy, step)) if step == self.steps => (full, copy),
            stale => {
                if let Some((old, copy, _)) = stale {
                    self.ledger
                        .free(Location::Device, Category::Prefetch, old.bytes());
                    drop(copy);
                    self.be.recycle(old);
                }
                self.start_upload(g)?
            }
        };
        if let Some(c) = copy {
            if let Some(e) = c.event() {
                self.be.wait_event(Stream::Compute, e)?;
            }
            self.retire(c)?;
        }
        if let ParamStore::Partitioned { gathered, .. } = &mut self.groups[g].params {
            *gathered = Some(full);
        }
        Ok(())
    }

    /// Keeps a staging copy until its upload has completed, without waiting for it unless
    /// too many are held.
    fn retire(&mut self, c: HostCopy) -> Result<()> {
        let r = &mut self.param_uploads.retiring;
        r.push_back(c);
        loop {
            let held = r.len();
            let done = match r.front_mut() {
                Some(front) => held > RETIRING || front.poll()?,
                None => false,
            };
            if !done {
                break;
            }
            r.pop_front();
        }
        Ok(())
    }
}
