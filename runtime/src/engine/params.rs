//! Reading and writing the model's parameters by name, whatever the stage: the fp32 values
//! (master weights in mixed precision) are all-gathered shard by shard, so the result is the
//! same on every rank and in every stage.

use std::collections::HashMap;

use super::core::Engine;
use super::group::{not_resident, Group, ParamStore};
use super::nvme::NvmeOffload;
use super::param_swap::ParamSwap;
use super::swap::{edit_shard, nvme_shard_copy};
use crate::comm::{BufMut, BufRef};
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

impl Engine {
    /// Every parameter's fp32 value (collective: every rank must call it).
    pub fn parameters(&self) -> Result<Vec<NamedTensor>> {
        // Parameters are read or written here: the optimizer's uploads land first.
        self.await_landings()?;
        let shards = self.comm.shards();
        let (rank, world) = (shards.rank(), shards.world_size());
        let mut out = Vec::new();
        for g in &self.groups {
            let shard = shard_values(g, rank, self.opt.nvme.as_deref(), self.params.swap.store())?;
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

    /// Sets parameters by name from full fp32 values (every rank passes the same values).
    /// Names not in the model are an error; parameters not named keep their values.
    pub fn set_parameters(&mut self, values: &[NamedTensor]) -> Result<()> {
        // Parameters are written here: the optimizer's uploads land first, and uploads
        // started ahead from the shards are dropped.
        self.await_landings()?;
        self.params.uploads.drop_all(&*self.be, &mut self.ledger)?;
        let mut index = HashMap::new();
        for (gi, g) in self.groups.iter().enumerate() {
            for (si, s) in g.layout.slots.iter().enumerate() {
                index.insert(s.name.as_str(), (gi, si));
            }
        }
        let mut plan = Vec::new();
        for v in values {
            let &(gi, si) = index.get(v.name.as_str()).ok_or_else(|| {
                Error::Invalid(format!("model has no parameter named {}", v.name))
            })?;
            let slot = &self.groups[gi].layout.slots[si];
            if slot.shape != v.shape || v.data.len() != slot.numel {
                return Err(Error::Shape {
                    op: "set_parameters",
                    expected: format!("{} {:?}", v.name, slot.shape),
                    got: format!("{:?}", v.shape),
                });
            }
            plan.push((gi, slot.offset, v));
        }
        if self.groups.iter().any(|g| g.nvme_adam.is_some()) {
            return Err(Error::Invalid(
                "set_parameters with optimizer state on NVMe: load weights before enabling NVMe offload, \
                 or resume from a checkpoint"
                    .into(),
            ));
        }
        let rank = self.shard_rank();
        self.params
            .swap
            .settle(&mut self.groups, &mut self.ledger)?;
        for gi in 0..self.groups.len() {
            let values: Vec<(usize, &[f32])> = plan
                .iter()
                .filter(|p| p.0 == gi)
                .map(|&(_, offset, v)| (offset, v.data.as_slice()))
                .collect();
            if !values.is_empty() {
                write_values(
                    &mut self.groups[gi],
                    self.params.swap.store_mut(),
                    rank,
                    &values,
                )?;
            }
        }
        Ok(())
    }
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

impl Engine {
    /// This rank's shard of every group's accumulated gradient, groups in unit order then the
    /// shared group. Read it between `backward` and `step`.
    pub fn gradient_shards(&self) -> Result<Vec<GradShard>> {
        let rank = self.shard_rank();
        self.groups
            .iter()
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
}
