//! Reading and writing the model's parameters by name, whatever the stage: the fp32 values
//! (master weights in mixed precision) are all-gathered shard by shard, so the result is the
//! same on every rank and in every stage.

use std::collections::HashMap;

use super::group::{not_resident, Group, ParamStore};
use super::nvme::NvmeOffload;
use super::param_swap::ParamSwap;
use super::swap::{edit_shard, nvme_shard_copy};
use crate::comm::{BufMut, BufRef, Communicator};
pub use crate::nn::weights::NamedTensor;
use crate::{Error, Result};

/// This rank's shard range of the fp32 values (master, or f32 parameters).
fn shard_values(
    g: &Group,
    rank: usize,
    nvme: Option<&NvmeOffload>,
    swap: Option<&ParamSwap>,
) -> Result<Vec<f32>> {
    let r = g.layout.shard_range(rank);
    if let (Some(state), Some(n)) = (&g.nvme_adam, nvme) {
        let mut owned = vec![0.0; g.owned.len()];
        state.read_params(&n.store, &n.pool, &mut owned)?;
        let off = r.start - g.owned.start;
        return Ok(owned[off..off + r.len()].to_vec());
    }
    let mut out = vec![0.0; r.len()];
    if let Some(m) = &g.master {
        m.read_f32(r.start - g.owned.start, &mut out)?;
        return Ok(out);
    }
    if let Some(b) = nvme_shard_copy(g, swap)? {
        b.load_f32(0, &mut out);
        return Ok(out);
    }
    match &g.params {
        ParamStore::Replicated(b) => b.read_f32(r.start, &mut out)?,
        ParamStore::Partitioned { shard, .. } => shard
            .resident()
            .ok_or_else(|| not_resident("parameters()"))?
            .read_f32(0, &mut out)?,
    }
    Ok(out)
}

/// This rank's part of the frozen groups' fingerprint: the f64 sum of its shard's values and
/// of their squares (padding adds zeros).
pub(super) fn frozen_partials(
    groups: &[Group],
    rank: usize,
    (nvme, swap): (Option<&NvmeOffload>, Option<&ParamSwap>),
) -> Result<(f64, f64)> {
    let (mut sum, mut squares) = (0.0f64, 0.0f64);
    for g in groups.iter().filter(|g| g.frozen) {
        for x in shard_values(g, rank, nvme, swap)? {
            sum += f64::from(x);
            squares += f64::from(x) * f64::from(x);
        }
    }
    Ok((sum, squares))
}

/// The frozen groups' fingerprint over `shards` (collective): every rank's
/// [`frozen_partials`], agreed first so that a rank's failure fails all, then added in rank
/// order.
pub(in crate::engine) fn frozen_fingerprint(
    groups: &[Group],
    shards: &dyn Communicator,
    stores: (Option<&NvmeOffload>, Option<&ParamSwap>),
) -> Result<(f64, f64)> {
    let local = frozen_partials(groups, shards.rank(), stores);
    let (sum, squares) = super::checkpoint::agree(shards, local)?;
    let texts = super::checkpoint::all_gather_text(shards, &format!("{sum:e} {squares:e}"))?;
    let mut total = (0.0f64, 0.0f64);
    for t in &texts {
        let mut parts = t.split(' ').map(str::parse::<f64>);
        match (parts.next(), parts.next()) {
            (Some(Ok(a)), Some(Ok(b))) => total = (total.0 + a, total.1 + b),
            _ => {
                return Err(Error::Invalid(format!(
                    "a rank's frozen fingerprint reads {t:?}"
                )))
            }
        }
    }
    Ok(total)
}

/// Every parameter's fp32 value from `groups` sharded over `shards` (collective), the NVMe
/// stores read where state lives there.
pub(super) fn gather_parameters(
    groups: &[Group],
    shards: &dyn Communicator,
    (nvme, swap): (Option<&NvmeOffload>, Option<&ParamSwap>),
    trainable_only: bool,
) -> Result<Vec<NamedTensor>> {
    let (rank, world) = (shards.rank(), shards.world_size());
    let mut out = Vec::new();
    for g in groups.iter().filter(|g| !(trainable_only && g.frozen)) {
        let shard = shard_values(g, rank, nvme, swap)?;
        let mut full = vec![0.0f32; g.layout.shard_len * world];
        shards.all_gather(BufRef::F32(&shard), BufMut::F32(&mut full))?;
        for s in &g.layout.slots {
            out.push(NamedTensor {
                name: s.name.clone(),
                shape: s.shape.clone(),
                data: full[s.range()].to_vec(),
            });
        }
    }
    Ok(out)
}

/// Where each of `values` goes: (group, offset in its flat buffer, value); an error for a
/// name not in `groups`, a wrong shape, or optimizer state on NVMe (which this path cannot
/// rewrite).
pub(super) fn plan_values<'v>(
    groups: &[Group],
    values: &'v [NamedTensor],
) -> Result<Vec<(usize, usize, &'v NamedTensor)>> {
    let mut index = HashMap::new();
    for (gi, g) in groups.iter().enumerate() {
        for (si, s) in g.layout.slots.iter().enumerate() {
            index.insert(s.name.as_str(), (gi, si));
        }
    }
    let mut plan = Vec::new();
    for v in values {
        let &(gi, si) = index
            .get(v.name.as_str())
            .ok_or_else(|| Error::Invalid(format!("model has no parameter named {}", v.name)))?;
        let slot = &groups[gi].layout.slots[si];
        if slot.shape != v.shape || v.data.len() != slot.numel {
            return Err(Error::Shape {
                op: "set_parameters",
                expected: format!("{} {:?}", v.name, slot.shape),
                got: format!("{:?}", v.shape),
            });
        }
        plan.push((gi, slot.offset, v));
    }
    if groups.iter().any(|g| g.nvme_adam.is_some()) {
        return Err(Error::Invalid(
            "set_parameters with optimizer state on NVMe: load weights before enabling NVMe offload, \
             or resume from a checkpoint"
                .into(),
        ));
    }
    Ok(plan)
}

/// Writes the planned values ([`plan_values`]) into what shard `rank` stores of `groups`.
pub(super) fn write_plan(
    groups: &mut [Group],
    mut swap: Option<&mut ParamSwap>,
    rank: usize,
    plan: &[(usize, usize, &NamedTensor)],
) -> Result<()> {
    for (gi, g) in groups.iter_mut().enumerate() {
        let values: Vec<(usize, &[f32])> = plan
            .iter()
            .filter(|p| p.0 == gi)
            .map(|&(_, offset, v)| (offset, v.data.as_slice()))
            .collect();
        if !values.is_empty() {
            write_values(g, swap.as_deref_mut(), rank, &values)?;
        }
    }
    Ok(())
}

/// Writes full-buffer values (each at its offset) into whatever this rank stores of one
/// group: the replicated parameters or its parameter shard (one read and write when the
/// shard is on NVMe), and its master range.
fn write_values(
    g: &mut Group,
    swap: Option<&mut ParamSwap>,
    rank: usize,
    values: &[(usize, &[f32])],
) -> Result<()> {
    let replicated = matches!(g.params, ParamStore::Replicated(_));
    let shard = g.layout.shard_range(rank);
    let clip = |r: &std::ops::Range<usize>, offset: usize, n: usize| {
        offset.max(r.start)..(offset + n).min(r.end)
    };
    edit_shard(g, swap, |b| {
        for &(offset, data) in values {
            if replicated {
                b.store_f32(offset, data);
                continue;
            }
            let r = clip(&shard, offset, data.len());
            if !r.is_empty() {
                b.store_f32(
                    r.start - shard.start,
                    &data[r.start - offset..r.end - offset],
                );
            }
        }
        Ok(())
    })?;
    if let Some(m) = &mut g.master {
        for &(offset, data) in values {
            let r = clip(&g.owned, offset, data.len());
            if !r.is_empty() {
                m.write_f32(
                    r.start - g.owned.start,
                    &data[r.start - offset..r.end - offset],
                )?;
            }
        }
    }
    Ok(())
}

/// This rank's shard of one group's accumulated gradient (the same range in every stage).
#[derive(Debug, Clone, PartialEq)]
pub struct GradShard {
    /// Names of the group's parameters, in layout order.
    pub params: Vec<String>,
    /// The shard's range in the group's padded flat buffer.
    pub range: std::ops::Range<usize>,
    /// Accumulated gradient values (still multiplied by the loss scale).
    pub data: Vec<f32>,
}

/// Shard `rank` of every group's accumulated gradient, groups in unit order then the shared
/// group (`Engine::gradient_shards`); frozen groups have none.
pub(super) fn gradient_shards(groups: &[Group], rank: usize) -> Result<Vec<GradShard>> {
    groups
        .iter()
        .filter(|g| !g.frozen)
        .map(|g| {
            let r = g.layout.shard_range(rank);
            let mut data = vec![0.0; r.len()];
            // No accumulator between steps when gradients move: the gradient is zero.
            if !g.grad_absent() {
                g.grad.read_f32(r.start - g.grad_offset, &mut data)?;
            }
            if let Some(d) = g.grad_read {
                crate::tensor::round_as_accumulated(&mut data, d);
            }
            Ok(GradShard {
                params: g.layout.slots.iter().map(|s| s.name.clone()).collect(),
                range: r,
                data,
            })
        })
        .collect()
}
