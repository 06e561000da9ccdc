//! ZeRO++ hpZ (`zero_hpz_partition_size = G`, stage 3), with DeepSpeed's meaning: the primary
//! partition (parameters, gradients, optimizer state) stays over all ranks; each rank also
//! keeps a *secondary* copy of its group's `1 / G` of every unit's parameters, cut from
//! forward's all-gather over the world, so backward's all-gathers run inside the group of `G`
//! consecutive ranks (one node). The secondary copy is stale after each optimizer step and is
//! cut afresh by the next forward; checkpoints hold only the primary partition. The loss head
//! under `train_batch` runs its backward inside forward (`passes.rs`): backward never gathers
//! its parameters, so no secondary copy of them is cut (`rules::hpz_cuts_secondary`).

use ferrozero_config::resolved::ResolvedConfig;

use super::group::{Group, ParamStore};
use super::ledger::{Category, Ledger, Location};
use super::stage::{gather_shards, Extent, ParamWire};
use crate::backend::Backend;
use crate::comm::Communicator;
use crate::tensor::Storage;
use crate::Result;

/// hpZ on one rank: off (every gather goes over the shard group), or its group and copies.
pub(super) enum Hpz {
    /// Not configured, or the stage does not shard parameters.
    Off,
    /// The secondary partition.
    On(Secondary),
}

/// The hpZ state of one rank.
pub(super) struct Secondary {
    /// The `G` ranks of this rank's group.
    group: Box<dyn Communicator>,
    /// Each parameter group's secondary partition (allocated at its first forward gather).
    copies: Vec<Option<Storage>>,
    /// Whether `copies[g]` holds the current parameters (false after every step).
    fresh: Vec<bool>,
    /// Whether the engine is in backward (gathers come from the secondary partition).
    backward: bool,
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
) -> Result<Hpz> {
    let g = cfg.zero.hpz_partition_size;
    let world = comm.world_size();
    if g <= 1 || params != Extent::Shard {
        return Ok(Hpz::Off);
    }
    crate::comm::hybrid::check_group_size("zero_hpz_partition_size", g, world)?;
    if super::rules::hpz_size(cfg, world, params) == 0 {
        return Ok(Hpz::Off);
    }
    Ok(Hpz::On(Secondary {
        group: comm.split_blocks(g)?,
        copies: (0..groups).map(|_| None).collect(),
        fresh: vec![false; groups],
        backward: false,
        crossed: 0,
    }))
}

impl Hpz {
    /// After forward gathered `group` (index `g`) over the `world`: counts the bytes that
    /// came from other groups and, once per step when backward will read it (`cut`), cuts
    /// this rank's secondary slice from the gathered buffer.
    pub(super) fn after_forward_gather(
        &mut self,
        (g, group): (usize, &Group),
        world: usize,
        cut: bool,
        ledger: &mut Ledger,
    ) -> Result<()> {
        let Hpz::On(h) = self else {
            return Ok(());
        };
        let ParamStore::Partitioned {
            gathered: Some(full),
            ..
        } = &group.params
        else {
            return Ok(());
        };
        let size = h.group.world_size();
        h.crossed += full.bytes() * (world - size) as u64 / world as u64;
        if h.fresh[g] || !cut {
            return Ok(());
        }
        let len = full.len() / size;
        if h.copies[g].is_none() {
            let s = full.uninit_like(full.dtype(), len)?;
            ledger.alloc(Location::Device, Category::Parameters, s.bytes());
            h.copies[g] = Some(s);
        }
        if let Some(s) = &mut h.copies[g] {
            full.copy_to(h.group.rank() * len, s, 0, len)?;
        }
        h.fresh[g] = true;
        Ok(())
    }

    /// Backward's gather of `group` (index `g`) from the secondary partition, inside the
    /// group; false (nothing done) when hpZ is off, outside backward, or the copy is stale.
    pub(super) fn gather(
        &self,
        (g, group): (usize, &mut Group),
        be: &dyn Backend,
        bucket: usize,
        ledger: &mut Ledger,
    ) -> Result<bool> {
        let Hpz::On(h) = self else {
            return Ok(false);
        };
        let Some(sec) = h.copies[g].as_ref().filter(|_| h.backward && h.fresh[g]) else {
            return Ok(false);
        };
        if let ParamStore::Partitioned {
            gathered: gathered @ None,
            ..
        } = &mut group.params
        {
            let size = h.group.world_size();
            let full = sec.uninit_like(sec.dtype(), sec.len() * size)?;
            // The copy holds the values forward computed with (dequantized under qwZ): moved
            // as they are, backward sees forward's bits.
            let wire = (bucket, ParamWire::Exact);
            let full = gather_shards(sec, full, sec.len(), &*h.group, wire, be)?;
            ledger.alloc(Location::Device, Category::Prefetch, full.bytes());
            *gathered = Some(full);
        }
        group.ensure_work(be, ledger)?;
        Ok(true)
    }

    /// The optimizer step changed the parameters: every secondary copy is stale.
    pub(super) fn stale(&mut self) {
        if let Hpz::On(h) = self {
            h.fresh.iter_mut().for_each(|f| *f = false);
        }
    }

    /// Enters or leaves backward (whose gathers use the secondary partition).
    pub(super) fn set_backward(&mut self, on: bool) {
        if let Hpz::On(h) = self {
            h.backward = on;
        }
    }

    /// Whether backward gathers from the secondary partition now (the comm worker's
    /// prefetch, which gathers over the world, stays off then).
    pub(super) fn in_backward(&self) -> bool {
        matches!(self, Hpz::On(h) if h.backward)
    }

    /// hpZ's cross-group bytes since the last call (forward's gathers only).
    pub(super) fn take_crossed(&mut self) -> u64 {
        match self {
            Hpz::On(h) => std::mem::take(&mut h.crossed),
            Hpz::Off => 0,
        }
    }
}
