//! Gradient reduction and stage-3 parameter gathering, inline or overlapped with compute
//! (`overlap_comm`): the same pure functions ([`reduce_gradient`], [`gather_shards`]) run on
//! this thread or on a [`CommWorker`] over a duplicate communicator, so overlap changes when
//! bytes move, never the arithmetic.

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use std::sync::Arc;

use ferrozero_config::resolved::ResolvedConfig;

use super::core::Engine;
use super::group::{Group, ParamStore, Shard};
use super::ledger::{Category, Ledger, Location};
use super::optimizer_overlap::LendCtx;
use super::stage::{
    gather_buffer, gather_shards, reduce_gradient, reduce_output, to_storage, Extent, Reduced,
};
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
    fn pop_reduction(&mut self) -> Option<(usize, u64, Pending<Reduced>)> {
        match self {
            CommOverlap::On(o) => o.reductions.pop_front(),
            CommOverlap::Off => None,
        }
    }

    /// Whether the queued reductions exceed DeepSpeed's double buffer (two
    /// `reduce_bucket_size` buckets of elements, and always the newest one).
    fn over_bound(&self, cfg: &ResolvedConfig, groups: &[Group]) -> bool {
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
    fn start_gather(
        &mut self,
        (g, grp): (usize, &Group),
        bucket: usize,
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
        let be = be.clone();
        let p = o.worker.submit("prefetch_gather", move |c| {
            gather_shards(&shard, full, world, s, c, bucket, &*be)
        });
        o.prefetched.insert(g, p);
    }

    /// Installs the prefetched gather of `grp` (index `g`), if one is in flight.
    fn take_gathered(&mut self, (g, grp): (usize, &mut Group)) -> Result<()> {
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

impl Engine {
    /// Reduces group `g`'s micro-step gradient across ranks and accumulates it (overlapped:
    /// queued on the worker, accumulated in [`Engine::finish_reductions`]).
    pub(super) fn reduce_group(&mut self, g: usize) -> Result<()> {
        let t = Instant::now();
        let Some(micro) = self.groups[g].take_micro(&mut self.ledger) else {
            return Ok(());
        };
        // The payload is rounded to the wire dtype once here; `accumulate` widens the sum back.
        let wire = super::build::reduce_dtype(&self.cfg);
        // One rank reduces nothing: the f32 gradient itself is the step's, read rounded to
        // the accumulator's dtype, unless the wire's rounding would differ from that one.
        if self.comm.world.world_size() == 1 && self.grads.downloads.moves(&self.groups[g], wire) {
            self.hold_reduced(g, micro)?;
            self.obs.timings.reduce += t.elapsed().as_secs_f64();
            return Ok(());
        }
        let buf = to_storage(micro, wire, &*self.be)?;
        let bytes = buf.bytes();
        if self.comm.world.world_size() > 1 {
            self.grads.reduced_bytes += bytes;
        }
        self.ledger
            .alloc(Location::Device, Category::CommBuffers, bytes);
        let (mut extent, mut world, s) = (
            self.params.stage.grads(),
            self.groups[g].layout.world_size,
            self.groups[g].layout.shard_len,
        );
        if world == 1 && self.comm.replicas() > 1 {
            // Shard groups of one rank (`mics_shard_size = 1`): the shard is the whole
            // gradient, summed in place across the replicas like a full one.
            (extent, world) = (Extent::Full, self.world_size());
        }
        let bucket = self.cfg.zero.reduce_bucket_size;
        let out = reduce_output(extent, &buf, world, s)?;
        match &mut self.grads.overlap {
            CommOverlap::On(o) => {
                let p = o.worker.submit("reduce_gradient", move |c| {
                    reduce_gradient(extent, buf, out, world, s, c, bucket)
                });
                o.reductions.push_back((g, bytes, p));
                self.bound_reductions()?;
            }
            CommOverlap::Off => {
                let shards = self.comm.shards();
                let red = reduce_gradient(extent, buf, out, world, s, shards, bucket);
                self.ledger
                    .free(Location::Device, Category::CommBuffers, bytes);
                self.accumulate(g, red?)?;
            }
        }
        self.obs.timings.reduce += t.elapsed().as_secs_f64();
        Ok(())
    }

    fn accumulate(&mut self, g: usize, reduced: Reduced) -> Result<()> {
        let Reduced { sum, spent } = reduced;
        if let Some(spent) = spent {
            self.be.recycle(spent);
        }
        if self.grads.downloads.moves(&self.groups[g], sum.dtype()) {
            return self.hold_reduced(g, sum);
        }
        // The cast runs where the reduction did (on the device), wherever the sum is added.
        let sum = to_storage(sum, self.groups[g].grad_dtype(), &*self.be)?;
        self.accumulate_reduced(g, sum)
    }

    /// Waits for every queued reduction and accumulates the results in submission order.
    pub(super) fn finish_reductions(&mut self) -> Result<()> {
        let t = Instant::now();
        while self.finish_oldest_reduction()? {}
        self.obs.timings.reduce += t.elapsed().as_secs_f64();
        Ok(())
    }

    /// Waits for the oldest queued reduction and accumulates it; false when none is queued.
    fn finish_oldest_reduction(&mut self) -> Result<bool> {
        let Some((g, bytes, p)) = self.grads.overlap.pop_reduction() else {
            return Ok(false);
        };
        let red = p.wait();
        self.ledger
            .free(Location::Device, Category::CommBuffers, bytes);
        self.accumulate(g, red?)?;
        Ok(true)
    }

    /// Keeps queued reductions within DeepSpeed's double buffer (two `reduce_bucket_size`
    /// buckets of elements, and always the newest one), so overlap never holds a second copy
    /// of every gradient; results are still accumulated in submission order.
    fn bound_reductions(&mut self) -> Result<()> {
        while self.grads.overlap.over_bound(&self.cfg, &self.groups) {
            self.finish_oldest_reduction()?;
        }
        Ok(())
    }

    /// Starts gathering group `g` on the worker (stage 3, overlap on), if it is partitioned
    /// in memory, not gathered or in flight yet, and fits `stage3_prefetch_bucket_size` and
    /// `stage3_max_live_parameters` next to what is live now. At one rank the shard is
    /// uploaded instead (`param_upload.rs`), with or without overlap; a shard on NVMe is read
    /// ahead, with or without overlap.
    pub(super) fn prefetch(&mut self, g: usize) {
        // hpZ: backward gathers from the secondary partition inside the group, on this thread.
        if self.params.hpz.in_backward() {
            return;
        }
        let live: usize = self
            .groups
            .iter()
            .filter(|x| x.full_params().is_some())
            .map(|x| x.layout.padded())
            .sum();
        let bucket = self.cfg.zero.allgather_bucket_size;
        // Shards on NVMe are read ahead instead; their gather runs when they arrive.
        (self.params.swap).prefetch((g, &mut self.groups), &mut self.ledger);
        if !super::rules::prefetch_fits(&self.cfg, self.groups[g].layout.padded(), live) {
            return;
        }
        // The copy taken here is the shard's first use since the optimizer's upload; a failed
        // wait or upload leaves the gather to `gather_unit`, which reports it.
        if self.await_landing(g).is_err() {
            return;
        }
        // One rank: the shard goes up on the copy stream, with or without the worker, and the
        // tied parameters with it when the unit uses them and they are not gathered.
        let shared = self
            .shared_index()
            .filter(|_| !self.model.units[g].uses_shared.is_empty());
        let upload = |e: &mut Self, g: usize| {
            let at = (&e.cfg, e.opt.steps);
            e.params
                .uploads
                .prefetch((g, &e.groups[g]), at, &*e.be, &mut e.ledger)
        };
        let started = upload(self, g).and_then(|up| match shared {
            Some(s) if up => self.await_landing(s).and_then(|()| upload(self, s)),
            _ => Ok(up),
        });
        match started {
            Ok(false) => {}
            Ok(true) => return,
            Err(e) => {
                tracing::debug!("parameter upload of group {g} not started ahead: {e}");
                return;
            }
        }
        let grp = (g, &self.groups[g]);
        (self.grads.overlap).start_gather(grp, bucket, &self.be, &mut self.ledger);
    }

    /// Installs a prefetched gather of group `g`, if one is in flight.
    pub(super) fn take_prefetched(&mut self, g: usize) -> Result<()> {
        self.grads.overlap.take_gathered((g, &mut self.groups[g]))
    }
    /// Makes `sum` group `g`'s gradient for the step (`GradDownloads::moves`); the group
    /// may step at an armed boundary.
    fn hold_reduced(&mut self, g: usize, sum: Storage) -> Result<()> {
        self.groups[g].hold_gradient(sum, &mut self.ledger)?;
        self.lend_for_step(g)
    }

    /// Adds group `g`'s reduced micro-step gradient into its accumulator
    /// (`GradDownloads::add`); once the addition is done, at an armed boundary the group
    /// may step.
    fn accumulate_reduced(&mut self, g: usize, sum: Storage) -> Result<()> {
        let grp = (g, &mut self.groups[g]);
        if (self.grads.downloads).add(grp, sum, &*self.be, &mut self.ledger)? {
            return self.lend_for_step(g);
        }
        while self.grads.downloads.over_bound() {
            self.land_oldest_download()?;
        }
        Ok(())
    }

    /// Lands every gradient still on its way down (the end of a backward).
    pub(super) fn land_downloads(&mut self) -> Result<()> {
        while self.land_oldest_download()? {}
        Ok(())
    }

    /// Lands the oldest download (`GradDownloads::land_oldest`) and lends its group when
    /// its gradient is final; false when none is queued.
    fn land_oldest_download(&mut self) -> Result<bool> {
        let downloads = &mut self.grads.downloads;
        match downloads.land_oldest(&mut self.groups, &*self.be, &mut self.ledger)? {
            None => Ok(false),
            Some(done) => done
                .map_or(Ok(()), |g| self.lend_for_step(g))
                .map(|()| true),
        }
    }

    /// Called when group `g`'s gradient is final: lends the group to the optimizer lane when
    /// the write-behind is armed.
    fn lend_for_step(&mut self, g: usize) -> Result<()> {
        let ctx = LendCtx {
            rank: self.shard_rank(),
            opt: &self.opt.optimizer,
            be: &self.be,
            trace: &self.obs.trace,
            tile: self.cfg.zero.sub_group_size.max(1),
            nvme: self.opt.nvme.as_ref(),
        };
        self.opt.lane.lend((g, &mut self.groups), ctx)
    }
}
