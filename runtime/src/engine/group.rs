//! A parameter group: one flat buffer's parameters, gradient accumulator and optimizer state
//! on one rank. A model has one group per unit plus one for its shared (tied) parameters.
//!
//! Which parts are full and which are this rank's shard is the stage's decision
//! ([`super::stage::Extent`]); this type only holds the buffers and counts them in the ledger.

use std::ops::Range;

use super::ledger::{Category, Ledger, Location};
use super::param_swap::SwapSlot;
use super::partition::GroupLayout;
use crate::tensor::DType;
use crate::tensor::FlatBuf;

/// Parameter storage: replicated on every rank, or partitioned with a transient full copy.
#[derive(Debug)]
pub enum ParamStore {
    /// Every rank holds the full padded buffer (stages 0-2).
    Replicated(FlatBuf),
    /// Each rank holds its shard; `gathered` holds the full buffer while a unit runs (stage 3).
    Partitioned {
        /// This rank's shard, in memory or on NVMe.
        shard: Shard,
        /// The all-gathered full buffer, present between gather and release.
        gathered: Option<FlatBuf>,
    },
}

/// Where a stage-3 parameter shard lives between uses.
#[derive(Debug)]
pub enum Shard {
    /// In memory (the device, or pinned host memory with `offload_param.device = "cpu"`).
    Memory(FlatBuf),
    /// In the rank's swap directory, brought in around gathers and the optimizer step.
    Nvme(SwapSlot),
}

impl Shard {
    /// The shard's values when they are in memory.
    pub fn resident(&self) -> Option<&FlatBuf> {
        match self {
            Shard::Memory(b) => Some(b),
            Shard::Nvme(s) => s.resident(),
        }
    }

    /// Mutable values when they are in memory.
    pub fn resident_mut(&mut self) -> Option<&mut FlatBuf> {
        match self {
            Shard::Memory(b) => Some(b),
            Shard::Nvme(s) => s.resident_mut(),
        }
    }

    /// The storage dtype.
    pub fn dtype(&self) -> DType {
        match self {
            Shard::Memory(b) => b.dtype(),
            Shard::Nvme(s) => s.dtype,
        }
    }

    /// Bytes of the shard wherever it lives.
    pub fn bytes(&self) -> u64 {
        match self {
            Shard::Memory(b) => b.bytes(),
            Shard::Nvme(s) => s.bytes(),
        }
    }
}

/// The error for a swapped-out shard used as if it were in memory (an engine bug, reported
/// rather than read as garbage).
pub fn not_resident(what: &str) -> crate::Error {
    crate::Error::Invalid(format!(
        "{what}: the parameter shard is on NVMe and was not swapped in"
    ))
}

/// One group's state on one rank.
#[derive(Debug)]
pub struct Group {
    /// Layout and shard arithmetic.
    pub layout: GroupLayout,
    /// Parameters in the storage dtype.
    pub params: ParamStore,
    /// f32 copy of the full parameters for compute, when the storage dtype is not f32.
    pub work: Option<Vec<f32>>,
    /// Gradient accumulator in the storage dtype (full or shard, by stage).
    pub grad: FlatBuf,
    /// Offset of `grad[0]` in the padded buffer (0 for full, the shard start for shards).
    pub grad_offset: usize,
    /// This micro-step's local gradient (padded, f32), alive from first to last use in backward.
    pub micro: Option<Vec<f32>>,
    /// fp32 master weights over the owned range (mixed precision only).
    pub master: Option<Vec<f32>>,
    /// First optimizer moment (Adam, Lion) or momentum (SGD), over the owned range.
    pub m: Vec<f32>,
    /// Second moment (Adam), over the owned range; empty otherwise.
    pub v: Vec<f32>,
    /// The padded range this rank's optimizer updates.
    pub owned: Range<usize>,
    /// Master weights and moments on NVMe (`offload_optimizer.device = "nvme"`); then
    /// `master`, `m` and `v` are empty.
    pub nvme_adam: Option<ferrozero_offload::tiled::NvmeAdam>,
}

impl Group {
    /// Full parameters in the storage dtype, if present (replicated, or gathered).
    pub fn full_params(&self) -> Option<&FlatBuf> {
        match &self.params {
            ParamStore::Replicated(b) => Some(b),
            ParamStore::Partitioned { gathered, .. } => gathered.as_ref(),
        }
    }

    /// The f32 view compute reads: the f32 full buffer itself, or the converted copy.
    pub fn compute_params(&self) -> Option<&[f32]> {
        compute_view(&self.params, &self.work)
    }

    /// Makes `compute_params` available (converting bf16/f16 to f32); `full_params` must exist.
    pub fn ensure_work(&mut self, ledger: &mut Ledger) {
        let Some(full) = self.full_params() else {
            return;
        };
        if full.dtype() == DType::F32 || self.work.is_some() {
            return;
        }
        let mut w = crate::tensor::spare::take_f32(full.len());
        full.load_f32(0, &mut w);
        ledger.alloc(Location::Device, Category::Prefetch, (w.len() * 4) as u64);
        self.work = Some(w);
    }

    /// Drops the f32 compute copy.
    pub fn drop_work(&mut self, ledger: &mut Ledger) {
        if let Some(w) = self.work.take() {
            ledger.free(Location::Device, Category::Prefetch, (w.len() * 4) as u64);
            crate::tensor::spare::give_f32(w);
        }
    }

    /// Starts this micro-step's local gradient if it is not alive yet.
    pub fn ensure_micro(&mut self, ledger: &mut Ledger) {
        if self.micro.is_none() {
            let n = self.layout.padded();
            ledger.alloc(Location::Device, Category::CommBuffers, (n * 4) as u64);
            self.micro = Some(crate::tensor::spare::zeros_f32(n));
        }
    }

    /// Takes the local gradient for reduction, releasing its ledger entry.
    pub fn take_micro(&mut self, ledger: &mut Ledger) -> Option<Vec<f32>> {
        let m = self.micro.take()?;
        ledger.free(
            Location::Device,
            Category::CommBuffers,
            (m.len() * 4) as u64,
        );
        Some(m)
    }
}

/// The f32 values the optimizer updates over the owned range (the master weights in mixed
/// precision, the parameters themselves in f32), and the low-precision buffer with the offset
/// of the owned range in it when a rounded copy must be written in the same pass.
pub fn owned_params<'a>(
    params: &'a mut ParamStore,
    master: &'a mut Option<Vec<f32>>,
    owned: &Range<usize>,
) -> crate::Result<OwnedParams<'a>> {
    let (lp, lp_offset) = owned_lp(params, owned)?;
    Ok(match (master, lp) {
        (Some(master), lp) => (master.as_mut_slice(), Some((lp, lp_offset))),
        (None, FlatBuf::F32(v)) => (&mut v[lp_offset..lp_offset + owned.len()], None),
        // Construction gives every non-f32 group master weights.
        (None, _) => unreachable!("low-precision parameters without master weights"),
    })
}

/// What [`owned_params`] hands the optimizer: the f32 values it updates, and the
/// low-precision copy with the owned range's offset in it, when one must be written too.
pub type OwnedParams<'a> = (&'a mut [f32], Option<(&'a mut FlatBuf, usize)>);

/// The stored parameters the optimizer writes, with the offset of the owned range in them.
pub fn owned_lp<'a>(
    params: &'a mut ParamStore,
    owned: &Range<usize>,
) -> crate::Result<(&'a mut FlatBuf, usize)> {
    match params {
        ParamStore::Replicated(b) => Ok((b, owned.start)),
        ParamStore::Partitioned { shard, .. } => shard
            .resident_mut()
            .map(|b| (b, 0))
            .ok_or_else(|| not_resident("optimizer step")),
    }
}

/// The f32 view compute reads, from a group's fields (so callers can borrow other fields).
pub fn compute_view<'a>(params: &'a ParamStore, work: &'a Option<Vec<f32>>) -> Option<&'a [f32]> {
    let full = match params {
        ParamStore::Replicated(b) => b,
        ParamStore::Partitioned { gathered, .. } => gathered.as_ref()?,
    };
    match full {
        FlatBuf::F32(v) => Some(v),
        _ => work.as_deref(),
    }
}
