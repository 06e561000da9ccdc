//! The engine's side of stage-3 parameter swapping: when shards come in from NVMe (before a
//! gather, ahead of use, before the optimizer step), when they leave, and the ledger entries
//! for the host buffers they occupy meanwhile.
//!
//! Every transition goes through [`Swap::with_slot`], which counts a buffer in the ledger
//! when a shard starts to occupy one and frees it when the shard is swapped out again, so the
//! ledger cannot drift from the slots' real states.

use std::collections::VecDeque;

use super::group::{not_resident, Group, ParamStore, Shard};
use super::ledger::{Category, Ledger, Location};
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
            slot.write_sync(swap, crate::tensor::Storage::Host(b))
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

/// Stage-3 parameter shards on NVMe (`offload_param.device = "nvme"`): off, or the store the
/// shards swap through.
pub(super) enum Swap {
    /// Shards live in memory.
    Off,
    /// The rank's swap store.
    Nvme(ParamSwap),
}

impl Swap {
    /// The store, when shards live on NVMe.
    pub(super) fn store(&self) -> Option<&ParamSwap> {
        match self {
            Swap::Nvme(s) => Some(s),
            Swap::Off => None,
        }
    }

    /// The store, mutably, when shards live on NVMe.
    pub(super) fn store_mut(&mut self) -> Option<&mut ParamSwap> {
        match self {
            Swap::Nvme(s) => Some(s),
            Swap::Off => None,
        }
    }

    /// Runs `f` on `grp`'s swap slot (if its shard lives on NVMe) and keeps the ledger's
    /// host swap-buffer bytes in step with the slot's state.
    fn with_slot<R>(
        &mut self,
        grp: &mut Group,
        ledger: &mut Ledger,
        f: impl FnOnce(&mut SwapSlot, &mut ParamSwap) -> R,
    ) -> Option<R> {
        let (
            Swap::Nvme(swap),
            ParamStore::Partitioned {
                shard: Shard::Nvme(slot),
                ..
            },
        ) = (self, &mut grp.params)
        else {
            return None;
        };
        let before = slot.holds_buffer();
        let r = f(slot, swap);
        match (before, slot.holds_buffer()) {
            (false, true) => ledger.alloc(Location::Host, Category::Prefetch, slot.bytes()),
            (true, false) => ledger.free(Location::Host, Category::Prefetch, slot.bytes()),
            _ => {}
        }
        Some(r)
    }

    /// Whether `grp`'s shard is on NVMe and the group is not gathered.
    fn needs_swap_in(grp: &Group) -> bool {
        matches!(
            &grp.params,
            ParamStore::Partitioned {
                shard: Shard::Nvme(_),
                gathered: None
            }
        )
    }

    /// Brings `grp`'s shard in for its gather (no-op unless it is on NVMe and needed).
    pub(super) fn in_for_gather(&mut self, grp: &mut Group, ledger: &mut Ledger) -> Result<()> {
        if !Self::needs_swap_in(grp) {
            return Ok(());
        }
        self.with_slot(grp, ledger, |s, w| s.swap_in(w).map(|_| ()))
            .unwrap_or(Ok(()))
    }

    /// Drops `grp`'s in-memory shard after its gather; the file holds the same bytes.
    pub(super) fn out_after_gather(&mut self, grp: &mut Group, ledger: &mut Ledger) {
        self.with_slot(grp, ledger, |s, w| s.release(w));
    }

    /// Starts reading group `g`'s shard ahead of its gather, when it is on NVMe, needed, and
    /// fewer than `buffer_count` shards and `max_in_cpu` elements occupy buffers with it.
    pub(super) fn prefetch(&mut self, (g, groups): (usize, &mut [Group]), ledger: &mut Ledger) {
        let Some((limit, max_elems)) = self.store().map(|s| (s.buffer_count, s.max_in_cpu)) else {
            return;
        };
        let (count, elems) = shards_in_buffers(groups);
        let grp = &mut groups[g];
        let len = grp.layout.shard_len;
        if !Self::needs_swap_in(grp) || count >= limit || elems + len > max_elems {
            return;
        }
        self.with_slot(grp, ledger, |s, w| s.start_read(w));
    }

    /// Makes `grp`'s shard writable for the optimizer: a recycled buffer when the update
    /// overwrites every element (master weights exist), else the stored values.
    pub(super) fn in_for_step(&mut self, grp: &mut Group, ledger: &mut Ledger) -> Result<()> {
        let overwrite = grp.master.is_some() || grp.nvme_adam.is_some();
        self.with_slot(grp, ledger, |s, w| {
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
    pub(super) fn out_after_step(
        &mut self,
        (g, groups): (usize, &mut [Group]),
        writing: &mut VecDeque<usize>,
        ledger: &mut Ledger,
    ) -> Result<()> {
        match self.with_slot(&mut groups[g], ledger, |s, w| s.start_write(w)) {
            None => return Ok(()),
            Some(r) => r?,
        }
        writing.push_back(g);
        let limit = self.store().map_or(1, |s| s.buffer_count);
        while writing.len() >= limit {
            self.finish_write(groups, writing, ledger)?;
        }
        Ok(())
    }

    /// Swaps every NVMe shard out, finishing reads and writes in flight, before the files
    /// are rewritten (checkpoint load, `set_parameters`).
    pub(super) fn settle(&mut self, groups: &mut [Group], ledger: &mut Ledger) -> Result<()> {
        for grp in groups {
            self.with_slot(grp, ledger, |s, w| s.settle(w))
                .unwrap_or(Ok(()))?;
        }
        Ok(())
    }

    /// Waits for the oldest write in flight.
    pub(super) fn finish_write(
        &mut self,
        groups: &mut [Group],
        writing: &mut VecDeque<usize>,
        ledger: &mut Ledger,
    ) -> Result<()> {
        match writing.pop_front() {
            Some(g) => self
                .with_slot(&mut groups[g], ledger, |s, w| s.finish_write(w))
                .unwrap_or(Ok(())),
            None => Ok(()),
        }
    }
}

/// Shards occupying host buffers, and their elements.
fn shards_in_buffers(groups: &[Group]) -> (usize, usize) {
    groups
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
