//! A parameter group: one flat buffer's parameters, gradient accumulator and optimizer state
//! on one rank. A model has one group per unit plus one for its shared (tied) parameters.
//!
//! Which parts are full and which are this rank's shard is the stage's decision
//! ([`super::stage::Extent`]); this type only holds the buffers and counts them in the ledger.

use std::ops::Range;

use super::ledger::{Category, Ledger, Location};
use super::offload_copies::Landing;
use super::param_swap::SwapSlot;
use super::partition::GroupLayout;
use crate::backend::{Backend, GradView};
use crate::tensor::in_flight::HostPin;
use crate::tensor::{DType, Storage, View, ViewMut};
use crate::Result;

/// Parameter storage: replicated on every rank, or partitioned with a transient full copy.
#[derive(Debug)]
pub enum ParamStore {
    /// Every rank holds the full padded buffer (stages 0-2).
    Replicated(Storage),
    /// Each rank holds its shard; `gathered` holds the full buffer while a unit runs (stage 3).
    Partitioned {
        /// This rank's shard, in memory or on NVMe.
        shard: Shard,
        /// The all-gathered full buffer, present between gather and release.
        gathered: Option<Storage>,
    },
}

/// Where a stage-3 parameter shard lives between uses.
#[derive(Debug)]
pub enum Shard {
    /// In memory (the device, or pinned host memory with `offload_param.device = "cpu"`).
    Memory(Storage),
    /// In the rank's swap directory, brought in around gathers and the optimizer step.
    Nvme(SwapSlot),
}

impl Shard {
    /// The shard's values when they are in memory.
    pub fn resident(&self) -> Option<&Storage> {
        match self {
            Shard::Memory(b) => Some(b),
            Shard::Nvme(s) => s.resident(),
        }
    }

    /// Mutable values when they are in memory.
    pub fn resident_mut(&mut self) -> Option<&mut Storage> {
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

/// One group's state on one rank. Buffers live where the engine placed them: on the
/// compute device, or in host memory when the config offloads them.
#[derive(Debug)]
pub struct Group {
    /// The optimizer's uploads of this group's parameters still owed to the compute stream
    /// (first, so it is dropped, waiting for them, before the buffers they write).
    pub landing: Landing,
    /// The page-locking of a stage-3 shard in host memory (before `params`, so it is released
    /// before the shard is freed).
    pub pin: Option<HostPin>,
    /// Layout and shard arithmetic.
    pub layout: GroupLayout,
    /// Frozen parameters: no gradient, master copy or optimizer state (`grad`, `m` and `v`
    /// empty, `owned` empty); the parameters are still sharded, gathered and offloaded.
    pub frozen: bool,
    /// Parameters in the storage dtype.
    pub params: ParamStore,
    /// The full parameters in the dtype layers read (`param_dtype`), when that is not the
    /// storage dtype (the CPU computes in f32 from bf16/f16 storage).
    pub work: Option<Storage>,
    /// Gradient accumulator in the storage dtype (full or shard, by stage); or, when
    /// `grad_read` is set, the step's gradient as backward (and the reduction) produced it; or,
    /// between steps when gradients move ([`super::rules::gradient_by_move`]), an empty
    /// stand-in of the accumulator's dtype.
    pub grad: Storage,
    /// The accumulator dtype `grad`'s values stand for when they are the moved micro-step
    /// gradient (read through [`GradView::rounded`]); `None`: `grad` is the accumulator.
    pub grad_read: Option<DType>,
    /// Elements of the accumulator (full or shard): what a moved gradient must have.
    pub grad_len: usize,
    /// Offset of `grad[0]` in the padded buffer (0 for full, the shard start for shards).
    pub grad_offset: usize,
    /// This micro-step's local gradient (padded, f32), alive from first to last use in backward.
    pub micro: Option<Storage>,
    /// f32 master weights over the owned range (mixed precision only).
    pub master: Option<Storage>,
    /// First optimizer moment (Adam, Lion) or momentum (SGD), f32 over the owned range.
    pub m: Storage,
    /// Second moment (Adam), f32 over the owned range; empty otherwise.
    pub v: Storage,
    /// The padded range this rank's optimizer updates.
    pub owned: Range<usize>,
    /// Master weights and moments on NVMe (`offload_optimizer.device = "nvme"`); then
    /// `master`, `m` and `v` are empty.
    pub nvme_adam: Option<ferrozero_offload::tiled::NvmeAdam>,
}

impl Group {
    /// Full parameters in the storage dtype, if present (replicated, or gathered).
    pub fn full_params(&self) -> Option<&Storage> {
        match &self.params {
            ParamStore::Replicated(b) => Some(b),
            ParamStore::Partitioned { gathered, .. } => gathered.as_ref(),
        }
    }

    /// The full parameters as layers read them: the stored buffer itself, or the converted
    /// copy.
    pub fn compute_params(&self) -> Option<View<'_>> {
        compute_view(&self.params, &self.work)
    }

    /// Makes `compute_params` available, converting to the backend's parameter dtype when it
    /// differs from the storage dtype; `full_params` must exist.
    pub fn ensure_work(&mut self, be: &dyn Backend, ledger: &mut Ledger) -> Result<()> {
        let Some(full) = self.full_params() else {
            return Ok(());
        };
        let want = be.param_dtype(full.dtype());
        if full.dtype() == want || self.work.is_some() {
            return Ok(());
        }
        let mut w = be.buffer_uninit(want, full.len())?;
        full.cast_into(&mut w)?;
        ledger.alloc(Location::Device, Category::Prefetch, w.bytes());
        self.work = Some(w);
        Ok(())
    }

    /// Drops the converted compute copy.
    pub fn drop_work(&mut self, be: &dyn Backend, ledger: &mut Ledger) {
        if let Some(w) = self.work.take() {
            ledger.free(Location::Device, Category::Prefetch, w.bytes());
            be.recycle(w);
        }
    }

    /// Starts this micro-step's local gradient if it is not alive yet.
    pub fn ensure_micro(&mut self, be: &dyn Backend, ledger: &mut Ledger) -> Result<()> {
        if self.micro.is_none() && !self.frozen {
            let m = be.buffer(DType::F32, self.layout.padded())?;
            ledger.alloc(Location::Device, Category::CommBuffers, m.bytes());
            self.micro = Some(m);
        }
        Ok(())
    }

    /// What holds this group's place while the group itself is lent to the optimizer lane:
    /// the same layout, owned range and placement (replicated or partitioned, so prefetch
    /// and memory accounting that scan every group decide as before) and no elements. Any
    /// buffer operation on it fails on the length, so a misuse is an error, not a silent read.
    pub fn stand_in(&self) -> Group {
        let empty = empty_storage;
        let params = match &self.params {
            ParamStore::Replicated(b) => ParamStore::Replicated(empty(b.dtype())),
            ParamStore::Partitioned { shard, .. } => ParamStore::Partitioned {
                shard: Shard::Memory(empty(shard.dtype())),
                gathered: None,
            },
        };
        Group {
            landing: Landing::default(),
            pin: None,
            layout: self.layout.clone(),
            frozen: self.frozen,
            params,
            work: None,
            grad: empty(self.grad.dtype()),
            grad_read: self.grad_read,
            grad_len: self.grad_len,
            grad_offset: self.grad_offset,
            micro: None,
            master: None,
            m: empty(DType::F32),
            v: empty(DType::F32),
            owned: self.owned.clone(),
            nvme_adam: None,
        }
    }

    /// The accumulator's dtype, whether or not it is allocated.
    pub fn grad_dtype(&self) -> DType {
        self.grad_read.unwrap_or(self.grad.dtype())
    }

    /// Elements `range` of the gradient (the accumulator's coordinates) as the step reads
    /// them: the accumulator as stored, or a moved gradient rounded to its dtype.
    pub fn grad_view(&self, range: Range<usize>) -> Result<GradView<'_>> {
        Ok(read_as(self.grad.range(range)?, self.grad_read))
    }

    /// Whether `grad` is the empty stand-in of an accumulator that moved gradients left
    /// unallocated.
    pub fn grad_absent(&self) -> bool {
        self.grad_read.is_none() && self.grad.len() != self.grad_len
    }

    /// Makes `buf` (the reduced micro-step gradient: f32 or the accumulator's dtype, the
    /// accumulator's length) the step's gradient, counted in the ledger; `grad` must be the
    /// empty stand-in.
    pub fn hold_gradient(&mut self, buf: Storage, ledger: &mut Ledger) -> Result<()> {
        if !self.grad_absent() || buf.len() != self.grad_len {
            return Err(crate::Error::Invalid(format!(
                "group of {}: a moved gradient of {} elements for an accumulator of {} that is \
                 {}",
                self.layout.padded(),
                buf.len(),
                self.grad_len,
                if self.grad_absent() {
                    "absent"
                } else {
                    "present"
                }
            )));
        }
        ledger.alloc(Location::Device, Category::Gradients, buf.bytes());
        let stand_in = std::mem::replace(&mut self.grad, buf);
        self.grad_read = Some(stand_in.dtype());
        Ok(())
    }

    /// After the step: a moved gradient is released (the empty stand-in takes its place), an
    /// accumulator is zeroed.
    pub fn clear_grad(&mut self, be: &dyn Backend, ledger: &mut Ledger) -> Result<()> {
        let Some(d) = self.grad_read.take() else {
            return self.grad.fill_zero();
        };
        let held = std::mem::replace(&mut self.grad, empty_storage(d));
        ledger.free(Location::Device, Category::Gradients, held.bytes());
        be.recycle(held);
        Ok(())
    }

    /// Turns a moved gradient, or the absent stand-in, into a zeroed-and-added accumulator
    /// holding the same values (the cast of the moved values, added into zeros): what a
    /// second micro-step before the step, or accumulation turned back on, adds into.
    pub fn materialize_accumulator(&mut self, be: &dyn Backend, ledger: &mut Ledger) -> Result<()> {
        if !self.grad_absent() && self.grad_read.is_none() {
            return Ok(());
        }
        let d = self.grad_dtype();
        let mut acc = be.buffer(d, self.grad_len)?;
        if self.grad_read.take().is_some() {
            let held = std::mem::replace(&mut self.grad, empty_storage(d));
            ledger.free(Location::Device, Category::Gradients, held.bytes());
            let held = super::stage::to_storage(held, d, be)?;
            let r = acc.accumulate(0, &held, self.grad_len, &mut Vec::new());
            be.recycle(held);
            r?;
        }
        ledger.alloc(Location::Device, Category::Gradients, acc.bytes());
        self.grad = acc;
        Ok(())
    }

    /// Takes the local gradient for reduction, releasing its ledger entry.
    pub fn take_micro(&mut self, ledger: &mut Ledger) -> Option<Storage> {
        let m = self.micro.take()?;
        ledger.free(Location::Device, Category::CommBuffers, m.bytes());
        Some(m)
    }
}

/// The values the optimizer updates over the owned range (the f32 master weights in mixed
/// precision, the parameters themselves in f32 or with bf16 master weights), and the stored buffer with the offset of the
/// owned range in it when a rounded copy must be written in the same pass.
pub fn owned_params<'a>(
    params: &'a mut ParamStore,
    master: &'a mut Option<Storage>,
    owned: &Range<usize>,
) -> Result<OwnedParams<'a>> {
    let (lp, lp_offset) = owned_lp(params, owned)?;
    Ok(match master {
        Some(master) => (master.view_mut(), Some((lp, lp_offset))),
        // f32 parameters, or bf16 ones that are their own master weights
        // (`bf16_master_weights_and_grads`).
        None if lp.dtype() != DType::F16 => {
            (lp.range_mut(lp_offset..lp_offset + owned.len())?, None)
        }
        None => {
            return Err(crate::Error::Invalid(format!(
                "{:?} parameters without f32 master weights",
                lp.dtype()
            )))
        }
    })
}

/// A group's state over its owned range, borrowed field by field for an optimizer pass.
pub struct OwnedState<'a> {
    /// The values the update writes, and the stored copy beside them ([`owned_params`]).
    pub params: OwnedParams<'a>,
    /// The gradient as the step reads it.
    pub grad: GradRef<'a>,
    /// First moment (or momentum).
    pub m: &'a mut Storage,
    /// Second moment (empty for one-moment optimizers).
    pub v: &'a mut Storage,
    /// The padded range this rank updates.
    pub owned: &'a Range<usize>,
}

/// A group's gradient buffer, the accumulator dtype its values stand for, and the padded
/// position of its first element.
#[derive(Clone, Copy)]
pub struct GradRef<'a> {
    buf: &'a Storage,
    read: Option<DType>,
    offset: usize,
}

impl<'a> GradRef<'a> {
    /// Elements `r` (padded coordinates) as the step reads them.
    pub fn range(&self, r: Range<usize>) -> Result<GradView<'a>> {
        let v = self.buf.range(r.start - self.offset..r.end - self.offset)?;
        Ok(read_as(v, self.read))
    }

    /// `v` (a copy of some of these elements) read as this gradient is.
    pub fn read_like<'b>(&self, v: View<'b>) -> GradView<'b> {
        read_as(v, self.read)
    }
}

impl Group {
    /// The state an optimizer pass reads and writes over the owned range.
    pub fn owned_state(&mut self) -> Result<OwnedState<'_>> {
        let Group {
            params,
            master,
            grad,
            grad_read,
            grad_offset,
            m,
            v,
            owned,
            ..
        } = self;
        Ok(OwnedState {
            params: owned_params(params, master, owned)?,
            grad: GradRef {
                buf: grad,
                read: *grad_read,
                offset: *grad_offset,
            },
            m,
            v,
            owned,
        })
    }
}

/// What [`owned_params`] hands the optimizer: the f32 values it updates, and the stored
/// parameters with the owned range's offset in them, when one must be written too.
pub type OwnedParams<'a> = (ViewMut<'a>, Option<(&'a mut Storage, usize)>);

/// The stored parameters the optimizer writes, with the offset of the owned range in them.
pub fn owned_lp<'a>(
    params: &'a mut ParamStore,
    owned: &Range<usize>,
) -> Result<(&'a mut Storage, usize)> {
    match params {
        ParamStore::Replicated(b) => Ok((b, owned.start)),
        ParamStore::Partitioned { shard, .. } => shard
            .resident_mut()
            .map(|b| (b, 0))
            .ok_or_else(|| not_resident("optimizer step")),
    }
}

/// The view layers read, from a group's fields (so callers can borrow other fields).
pub fn compute_view<'a>(params: &'a ParamStore, work: &'a Option<Storage>) -> Option<View<'a>> {
    if let Some(w) = work {
        return Some(w.view());
    }
    let full = match params {
        ParamStore::Replicated(b) => b,
        ParamStore::Partitioned { gathered, .. } => gathered.as_ref()?,
    };
    Some(full.view())
}

/// A gradient range as the step reads it: as stored, or rounded to the accumulator's dtype
/// `round` ([`Group::grad_read`]); for callers that borrow a group's fields one by one.
pub fn read_as(v: View<'_>, round: Option<DType>) -> GradView<'_> {
    match round {
        Some(d) => GradView::rounded(v, d),
        None => GradView::exact(v),
    }
}

/// An empty buffer of `d`: a stand-in that holds no elements, so any operation on it fails on
/// the length, and where it lives does not matter.
pub fn empty_storage(d: DType) -> Storage {
    Storage::Host(crate::tensor::FlatBuf::zeros(d, 0))
}
