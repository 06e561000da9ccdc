//! Building an engine's parameter groups: layout, deterministic initialisation, and the
//! placement of each buffer (full or shard, device or host) that the stage and the offload
//! settings decide.

use ferrozero_config::resolved::{CommDataType, OffloadTarget, Precision, ResolvedConfig};

use super::group::{Group, ParamStore, Shard};
use super::ledger::{Category, Ledger, Location};
use super::param_swap::{ParamSwap, SwapSlot};
use super::partition::GroupLayout;
use super::stage::{Extent, Stage};
use crate::backend::Backend;
use crate::nn::{init, ParamSpec};
use crate::tensor::in_flight::HostPin;
use crate::tensor::{DType, Storage};
use ferrozero_offload::tiled::NvmeAdam;

/// The storage dtype of parameters and gradients for a precision.
pub fn storage_dtype(p: &Precision) -> DType {
    match p {
        Precision::F32 => DType::F32,
        Precision::Bf16 => DType::Bf16,
        Precision::Fp16(_) => DType::F16,
    }
}

/// The dtype micro-step gradients accumulate in between steps: f32 with
/// `data_types.grad_accum_dtype = "fp32"`, else the training precision's.
pub fn accum_dtype(cfg: &ResolvedConfig) -> DType {
    match cfg.grad_accum_f32 {
        true => DType::F32,
        false => storage_dtype(&cfg.precision),
    }
}

/// The dtype gradient reductions carry: `communication_data_type`, else the gradients' own
/// (the training precision).
pub fn reduce_dtype(cfg: &ResolvedConfig) -> DType {
    match cfg.comms.data_type {
        Some(CommDataType::Fp32) => DType::F32,
        Some(CommDataType::Fp16) => DType::F16,
        Some(CommDataType::Bf16) => DType::Bf16,
        None => storage_dtype(&cfg.precision),
    }
}

/// The dtype of the optimizer's moments: bf16 with `bf16.bf16_optimizer_states`, else f32.
pub fn state_dtype(cfg: &ResolvedConfig) -> DType {
    match cfg.bf16_state.optimizer_states {
        true => DType::Bf16,
        false => DType::F32,
    }
}

/// `sub_group_size = 0` is DeepSpeed's "one sub-group per parameter"; the engine's tiles are
/// cut from each unit's owned range, so 0 becomes tiles as large as the model's largest
/// parameter (the working set DeepSpeed's per-parameter sub-groups bound). Every other value
/// is returned unchanged. Tiling never changes results: the optimizer computes each element
/// alike wherever it falls.
pub fn effective_sub_group_size(cfg: &ResolvedConfig, model: &crate::nn::Model) -> usize {
    if cfg.zero.sub_group_size != 0 {
        return cfg.zero.sub_group_size;
    }
    model
        .units
        .iter()
        .flat_map(|u| u.module.param_specs())
        .chain(model.shared.iter().cloned())
        .map(|p| p.numel())
        .max()
        .unwrap_or(1)
        .max(1)
}

/// Where the optimizer state lives.
pub fn optimizer_location(cfg: &ResolvedConfig) -> Location {
    match cfg.zero.offload_optimizer.target {
        OffloadTarget::None => Location::Device,
        OffloadTarget::Cpu => Location::Host,
        OffloadTarget::Nvme(_) => Location::Nvme,
    }
}

/// Where sharded parameters live between uses (stage 3 parameter offload).
pub fn param_location(cfg: &ResolvedConfig) -> Location {
    match cfg.zero.offload_param.target {
        OffloadTarget::None => Location::Device,
        OffloadTarget::Cpu => Location::Host,
        OffloadTarget::Nvme(_) => Location::Nvme,
    }
}

/// What every group of one engine shares.
pub struct GroupPlan<'a> {
    /// The stage.
    pub stage: &'a dyn Stage,
    /// The resolved config.
    pub cfg: &'a ResolvedConfig,
    /// Ranks.
    pub world: usize,
    /// This rank.
    pub rank: usize,
    /// Optimizer moments per element.
    pub moments: usize,
    /// The NVMe store when optimizer state lives there.
    pub nvme: Option<&'a super::nvme::NvmeOffload>,
    /// The compute device: buffers placed on the device are allocated through it.
    pub be: &'a dyn Backend,
}

/// A zero-filled buffer where `loc` says: the compute device's memory, or host memory for
/// offloaded state (on the CPU backend both are host memory).
fn place(be: &dyn Backend, loc: Location, dtype: DType, len: usize) -> crate::Result<Storage> {
    match loc {
        Location::Device => be.buffer(dtype, len),
        Location::Host | Location::Nvme => be.host_zeros(dtype, len),
    }
}

/// A group's initial values, generated per range: each parameter's deterministic
/// initialisation where the range covers it, zeros in the padding. A rank asks only for what
/// it places (its shard, its owned range), so no rank builds a whole group's values.
struct Initial<'a> {
    specs: &'a [ParamSpec],
    layout: &'a GroupLayout,
    seed: u64,
}

impl Initial<'_> {
    fn values(&self, r: std::ops::Range<usize>) -> Vec<f32> {
        let mut out = vec![0.0f32; r.len()];
        for (slot, spec) in self.layout.slots.iter().zip(self.specs) {
            let s = slot.range();
            let (a, b) = (s.start.max(r.start), s.end.min(r.end));
            if a < b {
                let seed = init::param_seed(self.seed, &spec.name);
                let dst = &mut out[a - r.start..b - r.start];
                init::fill_from(&spec.init, seed, a - s.start, dst);
            }
        }
        out
    }
}

impl GroupPlan<'_> {
    /// Parameter extent of a group: stage 3 keeps groups under the persistence threshold whole.
    fn param_extent(&self, numel: usize) -> Extent {
        super::rules::param_extent(self.cfg, self.stage.params(), numel)
    }

    /// Places a group's initial values: replicated on the device, or this rank's shard where
    /// `offload_param` says (NVMe through `swap`); counted in the ledger. A host shard is
    /// page-locked once, so its uploads run at the bus's speed from it.
    fn place_params(
        &self,
        index: usize,
        (layout, initial): (&GroupLayout, &Initial<'_>),
        swap: Option<&mut ParamSwap>,
        ledger: &mut Ledger,
    ) -> crate::Result<(ParamStore, Option<HostPin>)> {
        let dtype = storage_dtype(&self.cfg.precision);
        let store = |loc: Location, r: std::ops::Range<usize>| -> crate::Result<Storage> {
            let mut b = place(self.be, loc, dtype, r.len())?;
            b.write_f32_with(0, r.len(), || initial.values(r))?;
            Ok(b)
        };
        let mut params = match self.param_extent(layout.numel) {
            Extent::Full => ParamStore::Replicated(store(Location::Device, 0..layout.padded())?),
            Extent::Shard => {
                let r = layout.shard_range(self.rank);
                let shard = match swap {
                    Some(swap) => {
                        swap.check_fits(index, r.len())?;
                        let mut b = swap.buffer(dtype, r.len())?;
                        b.write_f32_with(0, r.len(), || initial.values(r))?;
                        Shard::Nvme(SwapSlot::create(swap, format!("p{index}"), b)?)
                    }
                    None => Shard::Memory(store(param_location(self.cfg), r)?),
                };
                ParamStore::Partitioned {
                    shard,
                    gathered: None,
                }
            }
        };
        let param_bytes = match &params {
            ParamStore::Replicated(b) => b.bytes(),
            ParamStore::Partitioned { shard, .. } => shard.bytes(),
        };
        let param_loc = if matches!(params, ParamStore::Partitioned { .. }) {
            param_location(self.cfg)
        } else {
            Location::Device
        };
        ledger.alloc(param_loc, Category::Parameters, param_bytes);
        let pin = match &mut params {
            ParamStore::Partitioned {
                shard: Shard::Memory(b),
                ..
            } if param_loc == Location::Host => b.pin_host(self.be),
            _ => None,
        };
        Ok((params, pin))
    }

    /// Lays out, initialises and places one group (`index` names its swap files); a
    /// `frozen` group holds its parameters only.
    pub fn build(
        &self,
        index: usize,
        (specs, frozen): (&[ParamSpec], bool),
        swap: Option<&mut ParamSwap>,
        ledger: &mut Ledger,
    ) -> crate::Result<Group> {
        let dtype = storage_dtype(&self.cfg.precision);
        let layout = GroupLayout::new(specs, self.world);
        let initial = Initial {
            specs,
            layout: &layout,
            seed: self.cfg.seed,
        };
        let (params, pin) = self.place_params(index, (&layout, &initial), swap, ledger)?;
        if frozen {
            return Ok(frozen_group(layout, params, pin, dtype));
        }

        let owned = self.stage.optimizer().range(&layout, self.rank);
        let opt_loc = optimizer_location(self.cfg);
        let (master, nvme_adam) = match self.nvme {
            Some(n) => {
                // Values are made a tile at a time, when the store asks (a size-only
                // store never does).
                let fill = |r: std::ops::Range<usize>, out: &mut [f32]| {
                    let start = owned.start;
                    out.copy_from_slice(&initial.values(start + r.start..start + r.end));
                    Ok(())
                };
                let key = format!("g{index}");
                let a = NvmeAdam::create_with(&n.store, &n.pool, &key, owned.len(), n.tile, fill)?;
                (None, Some(a))
            }
            // `bf16_master_weights_and_grads`: the bf16 parameters are the master weights.
            None if dtype != DType::F32 && !self.cfg.bf16_state.master_weights_and_grads => {
                let mut m = place(self.be, opt_loc, DType::F32, owned.len())?;
                m.write_f32_with(0, owned.len(), || initial.values(owned.clone()))?;
                (Some(m), None)
            }
            None => (None, None),
        };
        let grad_range = self.stage.grads().range(&layout, self.rank);
        // Beside offloaded optimizer state the accumulator is host memory: gradients leave
        // the device bucket by bucket in backward (`grad_download.rs`).
        let grad_loc = super::rules::grad_location(self.cfg);
        // When gradients move into place no accumulator lives between steps: an empty
        // stand-in keeps its dtype.
        let acc = accum_dtype(self.cfg);
        let grad = match super::rules::gradient_by_move(self.cfg) {
            true => super::group::empty_storage(acc),
            false => place(self.be, grad_loc, acc, grad_range.len())?,
        };
        ledger.alloc(grad_loc, Category::Gradients, grad.bytes());
        // With the state on NVMe the moments live there too; empty buffers stand in.
        let state_len = if nvme_adam.is_some() { 0 } else { owned.len() };
        let state = state_dtype(self.cfg);
        let m = place(self.be, opt_loc, state, state_len)?;
        let v = place(
            self.be,
            opt_loc,
            state,
            if self.moments > 1 { state_len } else { 0 },
        )?;
        // The ledger counts the moments where they live (NVMe included) at their full size,
        // and the f32 master weights wherever they are: NVMe tiles hold them beside m and v.
        let master_bytes = match &nvme_adam {
            Some(a) => (a.len() * DType::F32.size()) as u64,
            None => master.as_ref().map_or(0, Storage::bytes),
        };
        let opt_bytes = master_bytes + (owned.len() * self.moments * state.size()) as u64;
        ledger.alloc(opt_loc, Category::OptimizerState, opt_bytes);
        Ok(Group {
            landing: Default::default(),
            pin,
            layout,
            params,
            work: None,
            grad,
            grad_read: None,
            grad_len: grad_range.len(),
            grad_offset: grad_range.start,
            micro: None,
            master,
            m,
            v,
            owned,
            nvme_adam,
            frozen: false,
        })
    }
}

/// A group of frozen parameters: placed like any other, with no gradient, master copy or
/// optimizer state (empty stand-ins of their dtypes, an empty owned range).
fn frozen_group(
    layout: GroupLayout,
    params: ParamStore,
    pin: Option<HostPin>,
    dtype: DType,
) -> Group {
    let empty = super::group::empty_storage;
    Group {
        landing: Default::default(),
        pin,
        layout,
        frozen: true,
        params,
        work: None,
        grad: empty(dtype),
        grad_read: None,
        grad_len: 0,
        grad_offset: 0,
        micro: None,
        master: None,
        m: empty(DType::F32),
        v: empty(DType::F32),
        owned: 0..0,
        nvme_adam: None,
    }
}
