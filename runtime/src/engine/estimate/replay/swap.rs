//! Stage-3 parameter shards on NVMe in the replay: the host buffers a shard occupies while it
//! is read ahead, gathered from or written back (`Swap::with_slot` and `swap.rs`).

use std::collections::VecDeque;

use super::Replay;
use crate::engine::ledger::{Category, Location};
use crate::engine::stage::Extent;

impl Replay<'_> {
    /// Whether group `g`'s parameter shard lives on NVMe (`Shard::Nvme`).
    pub(super) fn on_nvme(&self, g: usize) -> bool {
        self.swap_limit.is_some() && self.groups[g].params == Extent::Shard
    }

    /// `Swap::with_slot`'s ledger entry: a shard starts or stops occupying a host buffer.
    pub(super) fn swap_buffer(&mut self, g: usize, held: bool) {
        self.swap_elems(g, held, self.groups[g].layout.shard_len);
    }

    /// [`Replay::swap_buffer`] for `elems` of the shard: the optimizer swaps in only the
    /// trainable part (a unit's frozen group is never stepped).
    fn swap_elems(&mut self, g: usize, held: bool, elems: usize) {
        match (held, self.swapped_in[g]) {
            (true, None) => {
                let b = self.lp(elems);
                self.swapped_in[g] = Some(b);
                self.ledger.alloc(Location::Host, Category::Prefetch, b);
            }
            (false, Some(b)) => {
                self.swapped_in[g] = None;
                self.ledger.free(Location::Host, Category::Prefetch, b);
            }
            _ => {}
        }
    }

    /// `Swap::prefetch`: read a needed NVMe shard ahead when a buffer is free and the
    /// held elements stay within `max_in_cpu`.
    pub(super) fn prefetch_swap(&mut self, g: usize) {
        let held = (0..self.groups.len()).filter(|&i| self.swapped_in[i].is_some());
        let (count, elems) = held.fold((0, 0), |(n, e), i| {
            (n + 1, e + self.groups[i].layout.shard_len)
        });
        let fits = self.swap_limit.is_some_and(|l| count < l)
            && elems + self.groups[g].layout.shard_len <= self.cfg.zero.offload_param.max_in_cpu;
        if self.on_nvme(g) && !self.gathered[g] && fits {
            self.swap_buffer(g, true);
        }
    }

    /// `Engine::apply_update` with NVMe shards: each shard takes a buffer for its update and
    /// keeps it until its write-back completes; writes in flight stay under `buffer_count`.
    pub(super) fn step_swapped(&mut self) {
        let Some(limit) = self.swap_limit else { return };
        let mut writing = VecDeque::new();
        for g in 0..self.groups.len() {
            let trainable = self.groups[g].grads.shard_len;
            if !self.on_nvme(g) || trainable == 0 {
                continue;
            }
            self.swap_elems(g, true, trainable);
            writing.push_back(g);
            while writing.len() >= limit {
                if let Some(done) = writing.pop_front() {
                    self.swap_buffer(done, false);
                }
            }
        }
        for g in writing {
            self.swap_buffer(g, false);
        }
    }
}
