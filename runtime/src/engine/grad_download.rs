//! Gradients leaving the device as backward produces them, when the optimizer state lives off
//! the device (`offload_optimizer`): the accumulator is then in host memory, so the device
//! never holds a whole gradient, only a few reduced buckets on their way down.
//!
//! Each group's micro-step gradient, once reduced (the rank's shard of the reduce-scatter at
//! stages 2-3, the owned slice of the all-reduced sum at stage 1) and cast to the storage
//! dtype on the device exactly as before, is downloaded on the device-to-host stream into
//! page-locked staging behind an event of the compute stream; the issuing thread goes on with
//! backward. At most [`rules::GRAD_DOWNLOADS_IN_FLIGHT`] such buffers live on the device:
//! the oldest is landed (a host wait on its download alone, the host addition into the
//! accumulator, the device buffer reused) before another is queued. The host addition is the
//! device's (f32 sum rounded once to the storage dtype), in the same per-group order of
//! micro-steps, so the accumulated bits equal the on-device accumulator's. On the CPU the
//! reduced buffer is host memory already: nothing is copied and the addition runs in place.

use std::collections::VecDeque;
use std::ops::Range;

use super::core::Engine;
use super::ledger::{Category, Location};
use super::rules;
use crate::backend::Stream;
use crate::tensor::in_flight::HostCopy;
use crate::tensor::{Storage, View};
use crate::Result;

/// The gradients on their way down, and whether gradients leave the device at all.
#[derive(Debug, Default)]
pub(super) struct GradDownloads {
    /// Whether the accumulators are in host memory (the optimizer state is off the device).
    leave: bool,
    /// Whether reduced gradients move into place instead of being added into accumulators
    /// ([`rules::gradient_by_move`]).
    moves: bool,
    /// Downloads in issue order.
    queue: VecDeque<Down>,
    /// Widening scratch of the host additions.
    scratch: Vec<f32>,
}

/// One reduced micro-step gradient on its way into a host accumulator.
#[derive(Debug)]
struct Down {
    /// The copy in flight (first, so a drop waits for it before `sum` is freed); `None` when
    /// `sum` is host memory.
    copy: Option<HostCopy>,
    /// The group.
    g: usize,
    /// The range that leaves, in the accumulator's (and `sum`'s) coordinates.
    range: Range<usize>,
    /// The reduced gradient in the storage dtype, kept until its download completed.
    sum: Storage,
}

impl GradDownloads {
    /// Downloads for `cfg`: gradients leave when [`rules::grad_location`] is host memory.
    pub(super) fn new(cfg: &ferrozero_config::resolved::ResolvedConfig) -> Self {
        Self {
            leave: rules::grad_location(cfg) == Location::Host,
            moves: rules::gradient_by_move(cfg),
            ..Self::default()
        }
    }
}

impl Engine {
    /// Keeps zeroed accumulators and adds every micro-step's gradient into them even at one
    /// micro-step per step, as before gradients moved into place: the reference the moved
    /// path is compared with, bit for bit. Takes effect from the next micro-step; a gradient
    /// already held becomes an accumulator holding the same values.
    pub fn accumulate_gradients(&mut self) -> Result<()> {
        self.grads.downloads.moves = false;
        if self.grads.downloads.leave {
            return Ok(());
        }
        for g in &mut self.groups {
            g.materialize_accumulator(&*self.be, &mut self.ledger)?;
        }
        Ok(())
    }

    /// Whether group `g`'s reduced gradient, with values in `sum`, becomes the step's gradient
    /// by move: gradients move, its values can stand for the accumulator, and none is held yet
    /// (a second micro-step before the step is added, `accumulate_reduced`).
    pub(super) fn moves_gradient(&self, g: usize, sum: crate::tensor::DType) -> bool {
        let grp = &self.groups[g];
        self.grads.downloads.moves && grp.grad_absent() && rules::moves_into(sum, grp.grad_dtype())
    }

    /// Makes `sum` group `g`'s gradient for the step ([`Engine::moves_gradient`]); the group
    /// may step at an armed boundary.
    pub(super) fn hold_reduced(&mut self, g: usize, sum: Storage) -> Result<()> {
        self.groups[g].hold_gradient(sum, &mut self.ledger)?;
        self.lend_for_step(g)
    }

    /// Adds group `g`'s reduced micro-step gradient (storage dtype, the accumulator's
    /// coordinates) into its accumulator: on the device in place, or queued on its way down.
    /// Once the addition is done, at an armed boundary the group may step.
    pub(super) fn accumulate_reduced(&mut self, g: usize, sum: Storage) -> Result<()> {
        if !self.grads.downloads.leave {
            // A moved gradient (a second micro-step before the step), or none at all
            // (accumulation turned back on), becomes an accumulator first.
            self.groups[g].materialize_accumulator(&*self.be, &mut self.ledger)?;
            let n = sum.len();
            let scratch = &mut self.grads.downloads.scratch;
            let r = self.groups[g].grad.accumulate(0, &sum, n, scratch);
            self.be.recycle(sum);
            r?;
            return self.lend_for_step(g);
        }
        let grp = &self.groups[g];
        // Only the owned range is read by the step, the norm and `gradient_shards`.
        let range = grp.owned.start - grp.grad_offset..grp.owned.end - grp.grad_offset;
        let ready = self.be.record(Stream::Compute)?;
        self.be.wait_event(Stream::DeviceToHost, &ready)?;
        let copy = sum
            .range(range.clone())?
            .download_async(Stream::DeviceToHost)?;
        self.ledger
            .alloc(Location::Device, Category::CommBuffers, sum.bytes());
        let down = Down {
            copy,
            g,
            range,
            sum,
        };
        self.grads.downloads.queue.push_back(down);
        while self.grads.downloads.queue.len() > rules::GRAD_DOWNLOADS_IN_FLIGHT {
            self.land_oldest_download()?;
        }
        Ok(())
    }

    /// Lands every gradient still on its way down (the end of a backward).
    pub(super) fn land_downloads(&mut self) -> Result<()> {
        while self.land_oldest_download()? {}
        Ok(())
    }

    /// Waits for the oldest download alone, adds it into its host accumulator and reuses its
    /// device buffer; false when none is queued.
    fn land_oldest_download(&mut self) -> Result<bool> {
        let Some(mut down) = self.grads.downloads.queue.pop_front() else {
            return Ok(false);
        };
        let g = down.g;
        let added = {
            let src = match down.copy.as_mut() {
                Some(c) => c.ready_ref().map(View::from),
                None => down.sum.range(down.range.clone()),
            };
            let scratch = &mut self.grads.downloads.scratch;
            src.and_then(|s| {
                self.groups[g]
                    .grad
                    .accumulate_view(down.range.start, s, scratch)
            })
        };
        // The copy completed (or failed and was waited for): the device buffer is free.
        drop(down.copy.take());
        self.ledger
            .free(Location::Device, Category::CommBuffers, down.sum.bytes());
        self.be.recycle(down.sum);
        added?;
        if !self.grads.downloads.queue.iter().any(|d| d.g == g) {
            self.lend_for_step(g)?;
        }
        Ok(true)
    }
}
