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

use super::group::Group;
use super::ledger::{Category, Ledger, Location};
use super::rules;
use crate::backend::{Backend, Stream};
use crate::tensor::in_flight::HostCopy;
use crate::tensor::{DType, Storage, View};
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

impl GradDownloads {
    /// Keeps zeroed accumulators in `groups` and adds every micro-step's gradient into them
    /// even at one micro-step per step (`Engine::accumulate_gradients`).
    pub(super) fn accumulate_always(
        &mut self,
        groups: &mut [Group],
        be: &dyn Backend,
        ledger: &mut Ledger,
    ) -> Result<()> {
        self.moves = false;
        if self.leave {
            return Ok(());
        }
        for g in groups {
            g.materialize_accumulator(be, ledger)?;
        }
        Ok(())
    }

    /// Whether `grp`'s reduced gradient, with values in `sum`, becomes the step's gradient
    /// by move: gradients move, its values can stand for the accumulator, and none is held yet
    /// (a second micro-step before the step is added, [`GradDownloads::add`]).
    pub(super) fn moves(&self, grp: &Group, sum: DType) -> bool {
        self.moves && grp.grad_absent() && rules::moves_into(sum, grp.grad_dtype())
    }

    /// Adds group `g`'s reduced micro-step gradient (storage dtype, the accumulator's
    /// coordinates) into its accumulator: on the device in place (true: the gradient is
    /// final for this micro-step), or queued on its way down (false: it is final once
    /// [`GradDownloads::land_oldest`] lands its last download).
    pub(super) fn add(
        &mut self,
        (g, grp): (usize, &mut Group),
        sum: Storage,
        be: &dyn Backend,
        ledger: &mut Ledger,
    ) -> Result<bool> {
        if !self.leave {
            // A moved gradient (a second micro-step before the step), or none at all
            // (accumulation turned back on), becomes an accumulator first.
            grp.materialize_accumulator(be, ledger)?;
            let n = sum.len();
            let r = grp.grad.accumulate(0, &sum, n, &mut self.scratch);
            be.recycle(sum);
            r?;
            return Ok(true);
        }
        // Only the owned range is read by the step, the norm and `gradient_shards`.
        let range = grp.owned.start - grp.grad_offset..grp.owned.end - grp.grad_offset;
        let ready = be.record(Stream::Compute)?;
        be.wait_event(Stream::DeviceToHost, &ready)?;
        let copy = sum
            .range(range.clone())?
            .download_async(Stream::DeviceToHost)?;
        ledger.alloc(Location::Device, Category::CommBuffers, sum.bytes());
        let down = Down {
            copy,
            g,
            range,
            sum,
        };
        self.queue.push_back(down);
        Ok(false)
    }

    /// Whether more than [`rules::GRAD_DOWNLOADS_IN_FLIGHT`] downloads are queued.
    pub(super) fn over_bound(&self) -> bool {
        self.queue.len() > rules::GRAD_DOWNLOADS_IN_FLIGHT
    }

    /// Waits for the oldest download alone, adds it into its host accumulator and reuses its
    /// device buffer: `None` when none is queued, else the group whose gradient is final now
    /// (its last download landed), if any.
    pub(super) fn land_oldest(
        &mut self,
        groups: &mut [Group],
        be: &dyn Backend,
        ledger: &mut Ledger,
    ) -> Result<Option<Option<usize>>> {
        let Some(mut down) = self.queue.pop_front() else {
            return Ok(None);
        };
        let g = down.g;
        let added = {
            let src = match down.copy.as_mut() {
                Some(c) => c.ready_ref().map(View::from),
                None => down.sum.range(down.range.clone()),
            };
            let scratch = &mut self.scratch;
            src.and_then(|s| groups[g].grad.accumulate_view(down.range.start, s, scratch))
        };
        // The copy completed (or failed and was waited for): the device buffer is free.
        drop(down.copy.take());
        ledger.free(Location::Device, Category::CommBuffers, down.sum.bytes());
        be.recycle(down.sum);
        added?;
        Ok(Some((!self.queue.iter().any(|d| d.g == g)).then_some(g)))
    }
}
