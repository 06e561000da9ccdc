//! Host memory a device page-locks for a run: the stage-3 host parameter store (registered
//! once at build), the staging pool's buffers for the offloaded optimizer's copies, and the
//! small-upload ring; `staged.rs` adds the staging of host checkpoints and of the speculative
//! overlap's snapshots. A device that page-locks nothing (the CPU: `upload_ring == 0`) prices 0.

use ferrozero_config::resolved::OffloadTarget;
use serde::Serialize;

use super::Replay;
use crate::engine::ledger::{Category, Location};
use crate::engine::rules;
use crate::engine::stage::Extent;

/// Page-locked host bytes by what holds them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct PageLockedFigures {
    /// The stage-3 parameter shards in host memory (`offload_param.device = "cpu"`).
    pub parameters: u64,
    /// Staging buffers of the offloaded optimizer's copies (gradients down, parameters up),
    /// those of at least `tensor::in_flight::PAGE_LOCK_MIN_BYTES`.
    pub staging: u64,
    /// The small-upload ring.
    pub ring: u64,
    /// Staging buffers of `cpu_checkpointing`'s checkpoints on their way down and back up.
    pub checkpoints: u64,
    /// Staging buffers holding the device values of the speculative optimizer overlap's
    /// snapshots (the parameters a rollback writes back).
    pub snapshots: u64,
}

impl PageLockedFigures {
    /// All of them.
    pub fn total(&self) -> u64 {
        self.parameters + self.staging + self.ring + self.checkpoints + self.snapshots
    }

    /// Of [`PageLockedFigures::total`], the bytes the engine's ledger already counts as host
    /// memory: the parameter store, and the staging that holds the host checkpoints and the
    /// snapshots' device values (the ledger counts those as host activations and snapshot
    /// bytes). A host-memory total adds only the rest, so no buffer is counted twice.
    pub fn in_host_ledger(&self) -> u64 {
        self.parameters + self.checkpoints + self.snapshots
    }
}

impl Replay<'_> {
    /// What the run page-locks, after the replay of a step.
    pub(in crate::engine::estimate) fn page_locked(&self) -> PageLockedFigures {
        if self.mem.upload_ring == 0 {
            return PageLockedFigures::default();
        }
        let z = &self.cfg.zero;
        let parameters = match z.offload_param.target {
            OffloadTarget::Cpu => self.ledger().peak(Location::Host, Category::Parameters),
            _ => 0,
        };
        PageLockedFigures {
            parameters,
            staging: self.offload_staging(),
            ring: self.mem.upload_ring,
            checkpoints: self.checkpoint_staging(),
            snapshots: self.snapshot_staging(),
        }
    }

    /// The device's staging pool over two offloaded steps (`step.rs` `update_groups`,
    /// `offload_copies.rs`): group g+1's gradient is taken for its download before group g's
    /// host step; a step takes a buffer for its parameters when they live on the device and
    /// gives back its gradient's, and the upload window gives back the oldest upload's beyond
    /// [`rules::UPLOADS_IN_FLIGHT`]. Buffers are reused by shape, and those under the
    /// registration threshold never count.
    fn offload_staging(&self) -> u64 {
        if self.cfg.zero.offload_optimizer.target != OffloadTarget::Cpu {
            return 0;
        }
        let param_loc = crate::engine::build::param_location(self.cfg);
        let acc = crate::engine::build::accum_dtype(self.cfg).size();
        let sizes: Vec<(u64, u64, bool)> = self
            .groups
            .iter()
            .map(|g| {
                let owned = self.stage.optimizer().range(&g.grads, 0).len();
                let on_device = g.params == Extent::Full || param_loc == Location::Device;
                let (gb, pb) = (owned * acc, owned * self.dtype.size());
                (gb as u64, pb as u64, on_device)
            })
            .collect();
        let mut pool = Pool::default();
        let mut window = std::collections::VecDeque::new();
        for _ in 0..2 {
            let mut next = sizes.first().map(|&(gb, _, _)| pool.take(gb));
            for (g, &(_, b, on_device)) in sizes.iter().enumerate() {
                let grad = next.take();
                next = sizes.get(g + 1).map(|&(gb, _, _)| pool.take(gb));
                // Every offloaded step enters the window, an upload-free one empty.
                window.push_back(on_device.then(|| pool.take(b)));
                while window.len() > rules::UPLOADS_IN_FLIGHT {
                    if let Some(Some(old)) = window.pop_front() {
                        pool.give(old);
                    }
                }
                if let Some(b) = grad {
                    pool.give(b);
                }
            }
        }
        pool.registered
    }
}

/// The sizes a staging pool holds and has registered (`backend/cuda/pinned.rs`).
#[derive(Default)]
pub(super) struct Pool {
    held: Vec<u64>,
    pub(super) registered: u64,
}

impl Pool {
    pub(super) fn take(&mut self, b: u64) -> u64 {
        match self.held.iter().position(|&h| h == b) {
            Some(i) => {
                self.held.swap_remove(i);
            }
            None if rules::staging_page_locked(b) => self.registered += b,
            None => {}
        }
        b
    }

    pub(super) fn give(&mut self, b: u64) {
        if rules::staging_page_locked(b) {
            self.held.push(b);
        }
    }
}
