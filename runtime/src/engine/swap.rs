//! The engine's side of stage-3 parameter swapping: when shards come in from NVMe (before a
//! gather, ahead of use, before the optimizer step), when they leave, and the ledger entries
//! for the host buffers they occupy meanwhile.
//!
//! Every transition goes through [`Engine::with_slot`], which counts a buffer in the ledger
//! when a shard starts to occupy one and frees it when the shard is swapped out again, so the
//! ledger cannot drift from the slots' real states.

use std::collections::VecDeque;

use super::core::Engine;
use super::group::{not_resident, Group, ParamStore, Shard};
use super::ledger::{Category, Location};
use super::param_swap::{ParamSwap, SwapSlot};
use crate::tensor::FlatBuf;
use crate::Result;

/// A copy of group `g`'s parameter shard when it lives on NVMe (for checkpoints and
/// `parameters()`); `None` when it is in memory.
pub(super) fn nvme_shard_copy(g: &Group, swap: Option<&ParamSwap>) -> Result<Option<FlatBuf>> {
    match (&g.params, swap) {
        (
            ParamStore::Partitioned {
                shard: Shard::Nvme(slot),
                ..
            },
            Some(swap),
        ) => slot.read_copy(&swap.store).map(Some),
        _ => Ok(None),
    }
}

/// Runs `edit` on group `g`'s stored parameter shard wherever it lives: in place in memory,
/// or read from NVMe, edited and written back.
pub(super) fn edit_shard(
    g: &mut Group,
    swap: Option<&mut ParamSwap>,
    edit: impl FnOnce(&mut FlatBuf) -> Result<()>,
) -> Result<()> {
    match (&mut g.params, swap) {
        (
            ParamStore::Partitioned {
                shard: Shard::Nvme(slot),
                ..
            },
            Some(swap),
        ) => {
            let mut b = slot.read_copy(&swap.store)?;
            edit(&mut b)?;
            slot.write_sync(swap, b)
        }
        (
            ParamStore::Partitioned {
                shard: Shard::Memory(b),
                ..
            }
            | ParamStore::Replicated(b),
            _,
        ) => b.with_host_mut(edit),
        (ParamStore::Partitioned { .. }, None) => Err(not_resident("edit_shard")),
    }
}

impl Engine {
    /// Bytes this rank has moved to and from NVMe since it was built (both stores).
    pub fn swap_traffic(&self) -> ferrozero_offload::store::Traffic {
        let opt = self.opt.nvme.as_ref().map(|n| n.store.bytes_moved());
        let par = self.params.swap.as_ref().map(|s| s.store.bytes_moved());
        opt.unwrap_or_default() + par.unwrap_or_default()
    }

    /// NVMe traffic since the last call (the last step).
    pub(super) fn step_traffic(&mut self) -> super::report::SwapTraffic {
        let now = self.swap_traffic();
        let d = now - std::mem::replace(&mut self.obs.traffic_mark, now);
        super::report::SwapTraffic {
            read_bytes: d.read,
            written_bytes: d.written,
        }
    }

    /// Runs `f` on group `g`'s swap slot (if its shard lives on NVMe) and keeps the ledger's
    /// host swap-buffer bytes in step with the slot's state.
    fn with_slot<R>(
        &mut self,
        g: usize,
        f: impl FnOnce(&mut SwapSlot, &mut ParamSwap) -> R,
    ) -> Option<R> {
        let (
            Some(swap),
            ParamStore::Partitioned {
                shard: Shard::Nvme(slot),
                ..
            },
        ) = (self.params.swap.as_mut(), &mut self.groups[g].params)
        else {
            return None;
        };
        let before = slot.holds_buffer();
        let r = f(slot, swap);
        match (before, slot.holds_buffer()) {
            (false, true) => self
                .ledger
                .alloc(Location::Host, Category::Prefetch, slot.bytes()),
            (true, false) => self
                .ledger
                .free(Location::Host, Category::Prefetch, slot.bytes()),
            _ => {}
        }
        Some(r)
    }

    /// Whether group `g`'s shard is on NVMe and the group is not gathered.
    fn needs_swap_in(&self, g: usize) -> bool {
        matches!(
            &self.groups[g].params,
            ParamStore::Partitioned {
                shard: Shard::Nvme(_),
                gathered: None
            }
        )
    }

    /// Brings group `g`'s shard in for its gather (no-op unless it is on NVMe and needed).
    pub(super) fn swap_in_for_gather(&mut self, g: usize) -> Result<()> {
        if !self.needs_swap_in(g) {
            return Ok(());
        }
        self.with_slot(g, |s, w| s.swap_in(w).map(|_| ()))
            .unwrap_or(Ok(()))
    }

    /// Drops group `g`'s in-memory shard after its gather; the file holds the same bytes.
    pub(super) fn swap_out_after_gather(&mut self, g: usize) {
        self.with_slot(g, |s, w| s.release(w));
    }

    /// Starts reading group `g`'s shard ahead of its gather, when it is on NVMe, needed, and
    /// fewer than `buffer_count` shards and `max_in_cpu` elements occupy buffers with it.
    pub(super) fn prefetch_swap(&mut self, g: usize) {
        let Some((limit, max_elems)) = self
            .params
            .swap
            .as_ref()
            .map(|s| (s.buffer_count, s.max_in_cpu))
        else {
            return;
        };
        let (count, elems) = self.shards_in_buffers();
        let len = self.groups[g].layout.shard_len;
        if !self.needs_swap_in(g) || count >= limit || elems + len > max_elems {
            return;
        }
        self.with_slot(g, |s, w| s.start_read(w));
    }

    /// Shards occupying host buffers, and their elements.
    fn shards_in_buffers(&self) -> (usize, usize) {
        self.groups
            .iter()
            .filter_map(|g| match &g.params {
                ParamStore::Partitioned {
                    shard: Shard::Nvme(s),
                    ..
                } if s.holds_buffer() => Some(s.len),
                _ => None,
            })
            .fold((0, 0), |(n, e), len| (n + 1, e + len))
    }

    /// Makes group `g`'s shard writable for the optimizer: a recycled buffer when the update
    /// overwrites every element (master weights exist), else the stored values.
    pub(super) fn swap_in_for_step(&mut self, g: usize) -> Result<()> {
        let overwrite = self.groups[g].master.is_some() || self.groups[g].nvme_adam.is_some();
        self.with_slot(g, |s, w| {
            if overwrite {
                s.overwrite(w).map(|_| ())
            } else {
                s.swap_in(w).map(|_| ())
            }
        })
        .unwrap_or(Ok(()))
    }

    /// Writes group `g`'s updated shard behind the next update; `writing` holds the groups
    /// with writes in flight, bounded so that at most `buffer_count` shards occupy buffers.
    pub(super) fn swap_out_after_step(
        &mut self,
        g: usize,
        writing: &mut VecDeque<usize>,
    ) -> Result<()> {
        match self.with_slot(g, |s, w| s.start_write(w)) {
            None => return Ok(()),
            Some(r) => r?,
        }
        writing.push_back(g);
        let limit = self.params.swap.as_ref().map_or(1, |s| s.buffer_count);
        while writing.len() >= limit {
            self.finish_swap_write(writing)?;
        }
        Ok(())
    }

    /// Swaps every NVMe shard out, finishing reads and writes in flight, before the files
    /// are rewritten (checkpoint load, `set_parameters`).
    pub(super) fn settle_swapped(&mut self) -> Result<()> {
        for g in 0..self.groups.len() {
            self.with_slot(g, |s, w| s.settle(w)).unwrap_or(Ok(()))?;
        }
        Ok(())
    }

    /// Waits for the oldest write in flight.
    pub(super) fn finish_swap_write(&mut self, writing: &mut VecDeque<usize>) -> Result<()> {
        match writing.pop_front() {
            Some(g) => self
                .with_slot(g, |s, w| s.finish_write(w))
                .unwrap_or(Ok(())),
            None => Ok(()),
        }
    }
}
