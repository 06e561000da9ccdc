//! Gradient reductions in the replay: the f32 micro-step gradient from a unit's first
//! backward use, its wire-dtype copy, and the comm worker's bounded queue (`overlap.rs`).

use super::Replay;
use crate::engine::ledger::{Category, Location};
use crate::engine::rules;
use crate::engine::stage::{self, Extent};

impl Replay<'_> {
    /// Bytes one micro-step's gradient reductions take as input: every group's padded
    /// gradient in the wire dtype (`Engine::reduce_group`).
    pub(in crate::engine::estimate) fn reduced_bytes_per_micro(&self) -> u64 {
        let wire = crate::engine::build::reduce_dtype(self.cfg).size();
        let elems: usize = self.groups.iter().map(|g| g.grads.padded()).sum();
        (elems * wire) as u64
    }

    pub(super) fn ensure_micro(&mut self, g: usize) {
        // A group of frozen parameters only has no micro-step gradient.
        let frozen =
            self.groups[g].grads.slots.is_empty() && !self.groups[g].layout.slots.is_empty();
        if !self.micro_alive[g] && !frozen {
            self.micro_alive[g] = true;
            let b = (self.groups[g].grads.padded() * 4) as u64;
            self.ledger
                .alloc(Location::Device, Category::CommBuffers, b);
        }
    }

    /// `take_micro` then `Stage::reduce`: the storage-dtype copy and reduce-scatter staging.
    pub(super) fn reduce_group(&mut self, g: usize) {
        if !std::mem::take(&mut self.micro_alive[g]) {
            return;
        }
        let padded = self.groups[g].grads.padded();
        if self.cfg.world_size == 1 && self.moves() {
            // `Engine::reduce_group` at one rank: the f32 micro-step gradient is the step's.
            let micro = (padded * 4) as u64;
            self.ledger
                .free(Location::Device, Category::CommBuffers, micro);
            self.hold(micro);
            return;
        }
        // The reduction's input is in the wire dtype (`communication_data_type`).
        let wire = crate::engine::build::reduce_dtype(self.cfg).size();
        let buf = (padded * wire) as u64;
        let out = self.reduce_output_bytes(g);
        self.free_micro_for_wire(padded, buf);
        self.ledger
            .alloc(Location::Device, Category::CommBuffers, out);
        self.reduce_staging(g);
        if self.cfg.zero.overlap_comm && self.cfg.world_size > 1 {
            self.queued.push_back((buf, out, padded));
            // `Engine::bound_reductions`: the double buffer, always keeping the newest.
            while rules::reductions_over_bound(
                self.cfg,
                self.queued.len(),
                self.queued.iter().map(|q| q.2).sum(),
            ) {
                if let Some(q) = self.queued.pop_front() {
                    self.free_reduction(q);
                }
            }
        } else {
            self.free_reduction((buf, out, padded));
        }
    }

    /// `stage::grad_staging_bytes` of a shard reduction (qgZ's packed slots and f32 sums),
    /// held while it runs.
    fn reduce_staging(&mut self, g: usize) {
        let world = self.groups[g].grads.world_size;
        if self.stage.grads() != Extent::Shard || world <= 1 {
            return;
        }
        let dtype = crate::engine::build::reduce_dtype(self.cfg);
        let s = self.groups[g].grads.shard_len;
        let staging = stage::grad_staging_bytes(rules::grad_wire(self.cfg), world, s, dtype);
        self.ledger
            .alloc(Location::Device, Category::CommBuffers, staging);
        self.ledger
            .free(Location::Device, Category::CommBuffers, staging);
    }

    /// The reduction's buffers go; the reduced gradient is added into its accumulator
    /// (`Engine::accumulate`), on its way down to a host one first when gradients leave.
    pub(super) fn free_reduction(&mut self, (buf, out, padded): (u64, u64, usize)) {
        self.ledger
            .free(Location::Device, Category::CommBuffers, buf);
        self.ledger
            .free(Location::Device, Category::CommBuffers, out);
        if self.moves() {
            // `Engine::accumulate`: the reduced sum (the whole buffer, or the rank's shard)
            // moves into place in the wire dtype.
            let world = self.groups.first().map_or(1, |g| g.layout.world_size);
            let elems = match self.stage.grads() {
                Extent::Shard => padded / world.max(1),
                Extent::Full => padded,
            };
            let wire = crate::engine::build::reduce_dtype(self.cfg).size();
            self.hold((elems * wire) as u64);
            return;
        }
        if rules::grad_location(self.cfg) == Location::Host {
            // The reduced sum cast to the accumulator's dtype: the rank's shard, or the whole
            // buffer.
            let world = self.groups.first().map_or(1, |g| g.layout.world_size);
            let elems = match self.stage.grads() {
                Extent::Shard => padded / world.max(1),
                Extent::Full => padded,
            };
            let b = (elems * crate::engine::build::accum_dtype(self.cfg).size()) as u64;
            self.ledger
                .alloc(Location::Device, Category::CommBuffers, b);
            self.downloads.push_back(b);
            self.land_downloads(rules::GRAD_DOWNLOADS_IN_FLIGHT);
        }
    }

    /// Whether reduced gradients move into place (`GradDownloads::moves`): one micro-step
    /// per step, the accumulator on the device, the wire dtype f32 or the storage dtype
    /// (`rules::gradient_by_move`).
    fn moves(&self) -> bool {
        rules::gradient_by_move(self.cfg)
    }

    /// A moved gradient of `bytes`, held to the step's end.
    fn hold(&mut self, bytes: u64) {
        self.moved += bytes;
        self.ledger
            .alloc(Location::Device, Category::Gradients, bytes);
    }

    /// `Engine::land_oldest_download` until at most `keep` downloads are in flight.
    pub(super) fn land_downloads(&mut self, keep: usize) {
        while self.downloads.len() > keep {
            if let Some(b) = self.downloads.pop_front() {
                self.ledger.free(Location::Device, Category::CommBuffers, b);
            }
        }
    }
}
