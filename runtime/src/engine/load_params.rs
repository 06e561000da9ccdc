//! Loading parameters from a [`ParamSource`] (a mapped model directory) tensor by tensor: each
//! rank asks only for the elements it keeps (its stage-3 shard and master range, or the whole
//! tensor when parameters are replicated) and writes them straight into its buffers, so a rank
//! holds what its stage keeps plus one tensor's part in flight, never the model in f32.

use std::ops::Range;

use super::group::{not_resident, Group, ParamStore, Shard};
use super::param_swap::ParamSwap;
use crate::nn::weights::ParamSource;
use crate::tensor::FlatBuf;
use crate::{Error, Result};

/// Checks that `src` holds exactly `groups`' parameters ([`ParamSource::check`]) and that no
/// optimizer state lives on NVMe (which loading cannot rewrite), before anything changes.
pub(super) fn check_source(
    groups: &[Group],
    src: &dyn ParamSource,
    pick: &dyn Fn(&str) -> bool,
) -> Result<()> {
    let expected: Vec<(String, Vec<usize>)> = groups
        .iter()
        .flat_map(|g| &g.layout.slots)
        .filter(|s| pick(&s.name))
        .map(|s| (s.name.clone(), s.shape.clone()))
        .collect();
    let borrowed: Vec<(&str, &[usize])> = expected
        .iter()
        .map(|(n, s)| (n.as_str(), s.as_slice()))
        .collect();
    src.check(&borrowed)?;
    if groups.iter().any(|g| g.nvme_adam.is_some()) {
        return Err(Error::Invalid(
            "load_parameters with optimizer state on NVMe: load weights before enabling \
             NVMe offload, or resume from a checkpoint"
                .into(),
        ));
    }
    Ok(())
}

/// A source and which parameters to read from it.
type Picked<'a> = (&'a dyn ParamSource, &'a dyn Fn(&str) -> bool);

/// Loads every group's elements that shard `rank` keeps from `src`, for the parameters
/// `pick` names.
pub(super) fn load_groups(
    groups: &mut [Group],
    mut swap: Option<&mut ParamSwap>,
    rank: usize,
    src: Picked<'_>,
) -> Result<()> {
    groups
        .iter_mut()
        .try_for_each(|g| load_group(g, swap.as_deref_mut(), rank, src))
}

/// `a ∩ b`, empty (at `a.start`) when they do not meet.
fn clip(a: &Range<usize>, b: Range<usize>) -> Range<usize> {
    let r = a.start.max(b.start)..a.end.min(b.end);
    if r.is_empty() {
        a.start..a.start
    } else {
        r
    }
}

/// The smallest range covering the non-empty ones of `a` and `b`.
fn hull(a: &Range<usize>, b: &Range<usize>) -> Range<usize> {
    match (a.is_empty(), b.is_empty()) {
        (true, _) => b.clone(),
        (_, true) => a.clone(),
        _ => a.start.min(b.start)..a.end.max(b.end),
    }
}

/// Streams one group's parameters into its stored parameters (replicated buffer or shard,
/// one read and write when the shard is on NVMe) and its master range.
fn load_group(
    g: &mut Group,
    swap: Option<&mut ParamSwap>,
    rank: usize,
    (src, pick): Picked<'_>,
) -> Result<()> {
    if !g.layout.slots.iter().any(|s| pick(&s.name)) {
        return Ok(());
    }
    let Group {
        params,
        master,
        layout,
        owned,
        ..
    } = g;
    let replicated = matches!(params, ParamStore::Replicated(_));
    let shard = layout.shard_range(rank);
    let mut write = |b: &mut FlatBuf| -> Result<()> {
        for s in layout.slots.iter().filter(|s| pick(&s.name)) {
            let keep = match replicated {
                true => s.range(),
                false => clip(&shard, s.range()),
            };
            let m = match master {
                Some(_) => clip(owned, s.range()),
                None => 0..0,
            };
            let need = hull(&keep, &m);
            if need.is_empty() {
                continue;
            }
            let vals = src.read(&s.name, need.start - s.offset..need.end - s.offset)?;
            let part = |r: &Range<usize>| &vals[r.start - need.start..r.end - need.start];
            if !keep.is_empty() {
                let at = if replicated {
                    keep.start
                } else {
                    keep.start - shard.start
                };
                b.store_f32(at, part(&keep));
            }
            if let (Some(mst), false) = (master.as_mut(), m.is_empty()) {
                mst.write_f32(m.start - owned.start, part(&m))?;
            }
        }
        Ok(())
    };
    match (params, swap) {
        (
            ParamStore::Partitioned {
                shard: Shard::Nvme(slot),
                ..
            },
            Some(swap),
        ) => {
            let mut b = slot.read_copy(&swap.store)?;
            write(&mut b)?;
            slot.write_sync(swap, crate::tensor::Storage::Host(b))
        }
        (
            ParamStore::Partitioned {
                shard: Shard::Memory(b),
                ..
            }
            | ParamStore::Replicated(b),
            _,
        ) => b.with_host_mut(write),
        (ParamStore::Partitioned { .. }, None) => Err(not_resident("load_parameters")),
    }
}
