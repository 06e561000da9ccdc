//! Gradient reduction and stage-3 parameter gathering beside compute (`overlap_comm`): the
//! [`CommOverlap`] part, off or a [`CommWorker`] over a duplicate communicator with what is in
//! flight on it. The same pure functions
//! ([`reduce_gradient`](super::stage::reduce_gradient), [`gather_shards`]) run on the engine's
//! thread (`passes.rs`' reductions, `core.rs`' prefetch) or on the worker, so overlap changes
//! when bytes move, never the arithmetic.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use ferrozero_config::resolved::ResolvedConfig;

use super::group::{Group, ParamStore, Shard};
use super::ledger::{Category, Ledger, Location};
use super::stage::{gather_buffer, gather_shards, wire_staging_bytes, ParamWire, Reduced};
use crate::backend::Backend;
use crate::comm::worker::{CommWorker, Pending};
use crate::comm::Communicator;
use crate::tensor::Storage;
use crate::Result;

/// Communication beside compute (`overlap_comm`): off (every collective runs inline on the
/// engine's thread), or the worker and what is in flight on it.
pub(super) enum CommOverlap {
    /// Collectives run inline (`overlap_comm` off, or one rank).
    Off,
    /// The worker.
    On(Worker),
}

/// The communication worker and what is in flight on it.
pub(super) struct Worker {
    worker: CommWorker,
    /// Reductions in submission order: (group, bytes counted in the ledger, result).
    reductions: VecDeque<(usize, u64, Pending<Reduced>)>,
    /// Stage-3 gathers started ahead of use, by group.
    prefetched: HashMap<usize, Pending<Storage>>,
}

impl Worker {
    /// Queues the reduction `job` of group `g`'s gradient (`bytes` counted in the ledger
    /// until its result is accumulated).
    pub(super) fn reduce(
        &mut self,
        (g, bytes): (usize, u64),
        job: impl FnOnce(&dyn Communicator) -> Result<Reduced> + Send + 'static,
    ) {
        let p = self.worker.submit("reduce_gradient", job);
        self.reductions.push_back((g, bytes, p));
    }
}

impl CommOverlap {
    /// A worker over a duplicate of `shards` (a collective call) when `overlap_comm` is on and
    /// the `world` has several ranks.
    pub(super) fn open(
        cfg: &ResolvedConfig,
        world: &dyn Communicator,
        shards: &dyn Communicator,
    ) -> Result<Self> {
        if !(cfg.zero.overlap_comm && world.world_size() > 1) {
            return Ok(CommOverlap::Off);
        }
        Ok(CommOverlap::On(Worker {
            worker: CommWorker::duplicate_of(shards)?,
            reductions: VecDeque::new(),
            prefetched: HashMap::new(),
        }))
    }

    /// The oldest queued reduction: its group, the bytes the ledger counts for it, its result.
    pub(super) fn pop_reduction(&mut self) -> Option<(usize, u64, Pending<Reduced>)> {
        match self {
            CommOverlap::On(o) => o.reductions.pop_front(),
            CommOverlap::Off => None,
        }
    }

    /// Whether the queued reductions exceed DeepSpeed's double buffer (two
    /// `reduce_bucket_size` buckets of elements, and always the newest one).
    pub(super) fn over_bound(&self, cfg: &ResolvedConfig, groups: &[Group]) -> bool {
        let CommOverlap::On(o) = self else {
            return false;
        };
        let queued: usize = o
            .reductions
            .iter()
            .map(|r| groups[r.0].layout.padded())
            .sum();
        super::rules::reductions_over_bound(cfg, o.reductions.len(), queued)
    }

    /// Starts gathering `grp` (index `g`) on the worker, if it is partitioned in memory, not
    /// gathered or in flight yet; nothing when overlap is off.
    pub(super) fn start_gather(
        &mut self,
        (g, grp): (usize, &Group),
        (bucket, wire): (usize, ParamWire),
        be: &Arc<dyn Backend>,
        ledger: &mut Ledger,
    ) {
        let CommOverlap::On(o) = self else {
            return;
        };
        let ParamStore::Partitioned {
            shard: Shard::Memory(shard),
            gathered: None,
        } = &grp.params
        else {
            return;
        };
        if o.prefetched.contains_key(&g) {
            return;
        }
        // The worker gathers from a copy, so the shard stays usable here meanwhile.
        let Ok(shard) = shard.try_clone() else {
            return;
        };
        let (world, s) = (grp.layout.world_size, grp.layout.shard_len);
        let Ok(full) = gather_buffer(&shard, world, s) else {
            return;
        };
        let n = grp.layout.padded();
        ledger.alloc(
            Location::Device,
            Category::Prefetch,
            (n * shard.dtype().size()) as u64,
        );
        // The worker holds the packed buffers while its gather runs: counted at its start.
        let staging = wire_staging_bytes(wire, world, s);
        ledger.alloc(Location::Device, Category::CommBuffers, staging);
        ledger.free(Location::Device, Category::CommBuffers, staging);
        let be = be.clone();
        let p = o.worker.submit("prefetch_gather", move |c| {
            gather_shards(&shard, full, s, c, (bucket, wire), &*be)
        });
        o.prefetched.insert(g, p);
    }

    /// Installs the prefetched gather of `grp` (index `g`), if one is in flight.
    pub(super) fn take_gathered(&mut self, (g, grp): (usize, &mut Group)) -> Result<()> {
        let CommOverlap::On(o) = self else {
            return Ok(());
        };
        let Some(p) = o.prefetched.remove(&g) else {
            return Ok(());
        };
        let full = p.wait()?;
        if let ParamStore::Partitioned { gathered, .. } = &mut grp.params {
            *gathered = Some(full);
        }
        Ok(())
    }
}
