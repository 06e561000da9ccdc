//! ZeRO++ hpZ (`zero_hpz_partition_size = G`, stage 3), with DeepSpeed's meaning: the primary
//! partition (parameters, gradients, optimizer state) stays over all ranks; each rank also
//! keeps a *secondary* copy of its group's `1 / G` of every unit's parameters, cut from
//! forward's all-gather over the world, so backward's all-gathers run inside the group of `G`
//! consecutive ranks (one node). The secondary copy is stale after each optimizer step and is
//! cut afresh by the next forward; checkpoints hold only the primary partition. The loss head
//! under `train_batch` runs its backward inside forward (`fused.rs`): backward never gathers
//! its parameters, so no secondary copy of them is cut (`rules::hpz_cuts_secondary`).

use ferrozero_config::resolved::ResolvedConfig;

use super::core::Engine;
use super::group::ParamStore;
use super::ledger::{Category, Location};
use super::stage::{gather_shards, Extent};
use crate::comm::Communicator;
use crate::tensor::Storage;
use crate::Result;

/// The hpZ state of one rank.
pub(super) struct Hpz {
    /// The `G` ranks of this rank's group.
    group: Box<dyn Communicator>,
    /// Each parameter group's secondary partition (allocated at its first forward gather).
    secondary: Vec<Option<Storage>>,
    /// Whether `secondary[g]` holds the current parameters (false after every step).
    fresh: Vec<bool>,
    /// Whether the engine is in backward (gathers come from the secondary partition).
    pub(super) backward: bool,
    /// Parameter bytes forward's gathers brought from ranks outside the group, not yet reported.
    crossed: u64,
}

/// Opens the group communicator when hpZ applies: stage 3 (parameters sharded) and a group
/// size that splits the world into several groups (collective).
pub(super) fn open(
    cfg: &ResolvedConfig,
    comm: &dyn Communicator,
    params: Extent,
    groups: usize,
) -> Result<Option<Hpz>> {
    let g = cfg.zero.hpz_partition_size;
    let world = comm.world_size();
    if g <= 1 || params != Extent::Shard {
        return Ok(None);
    }
    crate::comm::hybrid::check_group_size("zero_hpz_partition_size", g, world)?;
    if super::rules::hpz_size(cfg, world, params) == 0 {
        return Ok(None);
    }
    let r = comm.rank();
    Ok(Some(Hpz {
        group: comm.split(r / g, r)?,
        secondary: (0..groups).map(|_| None).collect(),
        fresh: vec![false; groups],
        backward: false,
        crossed: 0,
    }))
}

impl Engine {
    /// After forward gathered group `g` over the world: counts the bytes that came from
    /// other groups and, once per step when backward will read it (`cut`), cuts this rank's
    /// secondary slice from the gathered buffer.
    pub(super) fn hpz_after_forward_gather(&mut self, g: usize, cut: bool) -> Result<()> {
        let Some(h) = &mut self.params.hpz else {
            return Ok(());
        };
        let ParamStore::Partitioned {
            gathered: Some(full),
            ..
        } = &self.groups[g].params
        else {
            return Ok(());
        };
        let (world, size) = (self.comm.world.world_size(), h.group.world_size());
        h.crossed += full.bytes() * (world - size) as u64 / world as u64;
        if h.fresh[g] || !cut {
            return Ok(());
        }
        let len = full.len() / size;
        if h.secondary[g].is_none() {
            let s = full.uninit_like(full.dtype(), len)?;
            self.ledger
                .alloc(Location::Device, Category::Parameters, s.bytes());
            h.secondary[g] = Some(s);
        }
        if let Some(s) = &mut h.secondary[g] {
            full.copy_to(h.group.rank() * len, s, 0, len)?;
        }
        h.fresh[g] = true;
        Ok(())
    }

    /// Backward's gather of group `g` from the secondary partition, inside the group; false
    /// (nothing done) when hpZ is off, outside backward, or the secondary copy is stale.
    pub(super) fn hpz_gather(&mut self, g: usize, bucket: usize) -> Result<bool> {
        let Some(h) = &self.params.hpz else {
            return Ok(false);
        };
        let Some(sec) = h.secondary[g].as_ref().filter(|_| h.backward && h.fresh[g]) else {
            return Ok(false);
        };
        let group = &mut self.groups[g];
        if let ParamStore::Partitioned {
            gathered: gathered @ None,
            ..
        } = &mut group.params
        {
            let size = h.group.world_size();
            let full = sec.uninit_like(sec.dtype(), sec.len() * size)?;
            let full = gather_shards(sec, full, size, sec.len(), &*h.group, bucket, &*self.be)?;
            self.ledger
                .alloc(Location::Device, Category::Prefetch, full.bytes());
            *gathered = Some(full);
        }
        group.ensure_work(&*self.be, &mut self.ledger)?;
        Ok(true)
    }

    /// The optimizer step changed the parameters: every secondary copy is stale.
    pub(super) fn hpz_stale(&mut self) {
        if let Some(h) = &mut self.params.hpz {
            h.fresh.iter_mut().for_each(|f| *f = false);
        }
    }

    /// Enters or leaves backward (whose gathers use the secondary partition).
    pub(super) fn hpz_backward(&mut self, on: bool) {
        if let Some(h) = &mut self.params.hpz {
            h.backward = on;
        }
    }

    /// Whether backward gathers from the secondary partition now (the comm worker's
    /// prefetch, which gathers over the world, stays off then).
    pub(super) fn hpz_in_backward(&self) -> bool {
        self.params.hpz.as_ref().is_some_and(|h| h.backward)
    }

    /// hpZ's cross-group bytes since the last call (forward's gathers only).
    pub(super) fn take_hpz_crossed(&mut self) -> u64 {
        self.params
            .hpz
            .as_mut()
            .map_or(0, |h| std::mem::take(&mut h.crossed))
    }
}
