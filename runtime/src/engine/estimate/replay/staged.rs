//! Page-locked staging the engine takes beside the offloaded optimizer's copies: the host
//! checkpoints of `cpu_checkpointing` (`engine/ckpt_offload.rs`) and the device values of the
//! speculative overlap's snapshots (`engine/optimizer_overlap/snapshot.rs`). Neither holds
//! device memory the replay does not already count: a checkpoint's device buffer (brought up
//! [`rules::CHECKPOINTS_AHEAD`] unit ahead of its recompute) is priced by the backward replay,
//! and a snapshot copies a group's own parameters down and back into the same buffer.

use super::page_locked::Pool;
use super::Replay;
use crate::engine::build::param_location;
use crate::engine::ledger::Location;
use crate::engine::rules;
use crate::engine::stage::Extent;

impl Replay<'_> {
    /// The device's staging pool over the checkpoints of two micro-steps' forwards: each
    /// checkpoint takes a buffer for its download (`Checkpoints::leave`), keeps it through
    /// its upload ahead of the recompute, and gives it back only at the next checkpoint's
    /// download (the engine's `prune` runs after that download's `take`), so the second forward
    /// holds one more buffer than the first for a moment.
    pub(super) fn checkpoint_staging(&self) -> u64 {
        if self.mem.upload_ring == 0 {
            return 0;
        }
        let mut pool = Pool::default();
        let mut spent: Vec<u64> = Vec::new();
        for _ in 0..2 {
            let mut down = Vec::with_capacity(self.ckpt_down.len());
            for &b in &self.ckpt_down {
                down.push(pool.take(b));
                spent.drain(..).for_each(|s| pool.give(s));
            }
            spent = down;
        }
        pool.registered
    }

    /// The staging memory each group's snapshot keeps for its device values: the owned range
    /// of the parameters in their storage dtype (the rounded copy beside host master weights,
    /// or the values updated themselves), when the group's parameters live on the device.
    /// A save takes its new buffer before it gives the previous one back, which then serves
    /// the next save of that shape (the same spare the group's parameter uploads turn over), so
    /// a snapshot adds one buffer per snapshotted group; under the registration threshold,
    /// none.
    pub(super) fn snapshot_staging(&self) -> u64 {
        if self.mem.upload_ring == 0 {
            return 0;
        }
        let param_loc = param_location(self.cfg);
        self.groups
            .iter()
            .zip(&self.snapshotted)
            .filter(|&(_, &planned)| planned)
            .map(|(g, _)| g)
            .filter(|g| g.params == Extent::Full || param_loc == Location::Device)
            .map(|g| (self.stage.optimizer().range(&g.grads, 0).len() * self.dtype.size()) as u64)
            .filter(|&b| rules::staging_page_locked(b))
            .sum()
    }
}
