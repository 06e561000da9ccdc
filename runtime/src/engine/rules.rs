//! The engine's memory-shaping decisions as pure functions of the config and sizes.
//!
//! The engine (`core.rs`, `build.rs`, `overlap.rs`) and the estimate's report (the NVMe tile
//! pool and the locked bytes) call these same functions, never a copy. Each takes sizes
//! rather than engine state, so a caller needs only the layout arithmetic, no buffers.

use ferrozero_config::resolved::{OffloadTarget, ResolvedConfig};

use super::ledger::Location;
use super::partition::GroupLayout;
use super::stage::{Extent, Stage};
use crate::nn::Model;
use crate::tensor::DType;

/// Stage 3's `max_reuse_distance`: a unit whose parameters are used again (in its backward)
/// within that many gathered elements stays gathered after forward. `partitioned`: the
/// unit's parameters are sharded (only those are ever released); `later_padded`: the padded
/// elements of every unit after it, gathered before its backward comes round (and counted
/// twice: forward and backward both gather them).
pub fn reused_soon(cfg: &ResolvedConfig, partitioned: bool, later_padded: usize) -> bool {
    partitioned && 2 * later_padded <= cfg.zero.max_reuse_distance
}

/// Where a checkpointed unit's input waits for backward: host memory with
/// `cpu_checkpointing`, else the device.
pub fn ckpt_location(cfg: &ResolvedConfig) -> Location {
    match &cfg.activation_checkpointing {
        Some(a) if a.cpu_checkpointing => Location::Host,
        _ => Location::Device,
    }
}

/// How many units ahead of its recompute a checkpoint waiting in host memory is brought back
/// to the device: one, so its upload on the host-to-device stream overlaps the backward of the
/// unit above it (as parameters go up in `param_upload.rs`) while at most one such buffer
/// beyond the recomputing unit's is on the device.
pub const CHECKPOINTS_AHEAD: usize = 1;

/// The unit whose host checkpoint starts coming up to the device when unit `unit`'s backward
/// starts (`Checkpoints::ahead`): [`CHECKPOINTS_AHEAD`] units below;
/// `None` near the bottom or below `floor` ([`crate::nn::Model::backward_floor`]: no
/// backward there, so no checkpoint was left).
pub fn checkpoint_up_with(unit: usize, floor: usize) -> Option<usize> {
    unit.checked_sub(CHECKPOINTS_AHEAD).filter(|&u| u >= floor)
}

/// The unit backward gathers after unit `unit`, prefetched while `unit` computes: the one
/// below, unless `unit` is the last backward runs (`floor`, or the first unit).
pub fn backward_next(unit: usize, floor: usize) -> Option<usize> {
    (unit > floor).then(|| unit - 1)
}

/// Whether stage 3 uploads a unit's host shard ahead of its use on the host-to-device stream
/// instead of gathering it (`param_upload.rs`): the rank's shard group is one rank
/// (`shard_world`: the world size, or `mics_shard_size` under MiCS), so its shard is the whole
/// parameter and no collective is needed, and the shard lives in host memory
/// (`offload_param.device = "cpu"`).
pub fn uploads_ahead(cfg: &ResolvedConfig, shard_world: usize) -> bool {
    shard_world == 1 && cfg.zero.offload_param.target == OffloadTarget::Cpu
}

/// Whether a staging buffer of `bytes` is page-locked by a device's staging pool (smaller
/// ones stay pageable); the pool asks the same function.
pub use crate::tensor::in_flight::staging_page_locked;

/// A group's parameter extent: stage 3 keeps groups under `param_persistence_threshold`
/// whole (`stage_params` is the stage's own extent for parameters).
pub fn param_extent(cfg: &ResolvedConfig, stage_params: Extent, numel: usize) -> Extent {
    match stage_params {
        Extent::Shard if numel < cfg.zero.param_persistence_threshold => Extent::Full,
        e => e,
    }
}

/// Whether a stage-3 prefetch of a group of `padded` elements may start with `live` gathered
/// elements already on the device: it fits `stage3_prefetch_bucket_size` and, beside what is
/// live, `stage3_max_live_parameters`.
pub fn prefetch_fits(cfg: &ResolvedConfig, padded: usize, live: usize) -> bool {
    padded <= cfg.zero.prefetch_bucket_size && live + padded <= cfg.zero.max_live_parameters
}

/// Whether the comm worker's queued reductions (`count` of them, `queued` padded elements in
/// all) must drain their oldest first: the double buffer of `reduce_bucket_size` is full,
/// and the newest is always kept.
pub fn reductions_over_bound(cfg: &ResolvedConfig, count: usize, queued: usize) -> bool {
    count > 1 && queued > 2 * cfg.zero.reduce_bucket_size
}

/// ZeRO++ hpZ's secondary group size when it applies: stage-3 sharded parameters and a
/// `zero_hpz_partition_size` that splits `world` into several groups; else 0 (off). A size
/// that does not divide the world is the engine's error to report (`hpz::open`).
pub fn hpz_size(cfg: &ResolvedConfig, world: usize, params: Extent) -> usize {
    let g = cfg.zero.hpz_partition_size;
    let on = params == Extent::Shard && g > 1 && g < world && world.is_multiple_of(g);
    if on {
        g
    } else {
        0
    }
}

/// Whether forward's gather of a group for a unit cuts hpZ's secondary copy of it: not when
/// the unit runs its backward inside forward (`fused`: `train_batch`'s loss head,
/// `engine/passes.rs`) and the group is its own (`own`), which backward never gathers again;
/// a group shared with other units is cut for their backward.
pub fn hpz_cuts_secondary(own: bool, fused: bool) -> bool {
    !(fused && own)
}

/// How a group's stage-3 parameter gathers travel: quantized under qwZ, and for frozen groups
/// under `zero_quantized_nontrainable_weights` (both false below stage 3).
pub fn param_wire(cfg: &ResolvedConfig, frozen: bool) -> super::stage::ParamWire {
    let z = &cfg.zero;
    if z.quantized_weights || (frozen && z.quantized_nontrainable_weights) {
        super::stage::ParamWire::Quantized
    } else {
        super::stage::ParamWire::Exact
    }
}

/// How stage-3 gradient reductions travel: quantized under qgZ (false below stage 3).
pub fn grad_wire(cfg: &ResolvedConfig) -> super::stage::GradWire {
    if cfg.zero.quantized_gradients {
        super::stage::GradWire::Quantized
    } else {
        super::stage::GradWire::Exact
    }
}

/// Where the gradient accumulators live: in host memory beside optimizer state that is off
/// the device (`offload_optimizer`, CPU or NVMe), so gradients leave the device bucket by
/// bucket during backward (`grad_download.rs`); else on the device.
pub fn grad_location(cfg: &ResolvedConfig) -> Location {
    match super::build::optimizer_location(cfg) {
        Location::Device => Location::Device,
        Location::Host | Location::Nvme => Location::Host,
    }
}

/// The longest range any group's optimizer owns on `rank` of a shard group of `world`
/// (the shared group counted even when empty, as the engine lays it out): the NVMe
/// optimizer's tile never exceeds it.
pub fn largest_owned(model: &Model, stage: &dyn Stage, world: usize, rank: usize) -> usize {
    model
        .units
        .iter()
        .map(|u| u.module.param_specs())
        .chain(std::iter::once(model.shared.clone()))
        .map(|s| {
            stage
                .optimizer()
                .range(&GroupLayout::new(&s, world), rank)
                .len()
        })
        .max()
        .unwrap_or(1)
}

/// The NVMe optimizer's host buffers (`nvme.rs`): `(count, bytes each, tile)`. At least two
/// buffers (one read ahead while one is stepped), each one tile of f32 master weights and two
/// moments (12 bytes per parameter), the tile `sub_group_size` capped by `largest_owned`,
/// rounded up to the pool's page alignment for direct I/O.
pub fn nvme_pool(cfg: &ResolvedConfig, largest_owned: usize) -> (usize, usize, usize) {
    let off = &cfg.zero.offload_optimizer;
    let tile = cfg.zero.sub_group_size.min(largest_owned.max(1)).max(1);
    let bytes = (tile * 12).next_multiple_of(ferrozero_offload::pool::ALIGN);
    (off.buffer_count.max(2), bytes, tile)
}

/// Host bytes the engine locks with `mlock`, which the kernel charges against
/// `RLIMIT_MEMLOCK`: the NVMe optimizer's buffer pool under `offload_optimizer.pin_memory`
/// (`ferrozero_offload::pool`), and nothing else. The offloaded state `pin_memory` names is
/// ordinary host memory; a device page-locks it with its driver instead (`cuMemHostRegister`,
/// whose pages NVIDIA's kernel module pins with `get_user_pages` without charging
/// `locked_vm`), which counts against host RAM, not against this limit. No buffer is both.
pub fn mlocked_bytes(cfg: &ResolvedConfig, largest_owned: usize) -> u64 {
    let off = &cfg.zero.offload_optimizer;
    if !(off.pin_memory && matches!(off.target, OffloadTarget::Nvme(_))) {
        return 0;
    }
    let (count, bytes, _) = nvme_pool(cfg, largest_owned);
    (count as u64).saturating_mul(bytes as u64)
}

/// Whether the step's gradient is the reduced micro-step gradient itself, moved into place,
/// instead of its cast added into a zeroed accumulator: one micro-step per step
/// (`gradient_accumulation_steps = 1`) with the accumulator on the device (beside offloaded
/// optimizer state gradients leave in buckets, `grad_download.rs`). The step then reads it
/// rounded to the accumulator's dtype (`GradView::rounded`): the same bits, without the
/// zero-fill, the cast and the addition, and no accumulator between steps. The reduction's
/// dtype (`communication_data_type`) must be f32 or the storage dtype, so that one rounding
/// stands for the cast (else the accumulator is kept as before).
pub fn gradient_by_move(cfg: &ResolvedConfig) -> bool {
    use super::build::{accum_dtype, reduce_dtype};
    cfg.gradient_accumulation_steps == 1
        && grad_location(cfg) == Location::Device
        && moves_into(reduce_dtype(cfg), accum_dtype(cfg))
}

/// Whether a reduced micro-step gradient in `sum` may move into an accumulator of `acc`: its
/// values are f32 (rounded on reading) or already the accumulator's dtype.
pub fn moves_into(sum: DType, acc: DType) -> bool {
    sum == DType::F32 || sum == acc
}

/// Reduced micro-step gradients on their way down to host accumulators at once: the device
/// holds at most this many bucket-sized buffers (one downloading while backward fills the
/// next); the oldest is landed before another is queued.
pub const GRAD_DOWNLOADS_IN_FLIGHT: usize = 2;

/// Offloaded groups' parameter uploads whose page-locked staging is held at once: the
/// oldest beyond this is waited for (long complete) and its staging reused by the next.
pub const UPLOADS_IN_FLIGHT: usize = 2;

#[cfg(test)]
mod tests {
    use super::*;
    use ferrozero_config::resolved::ActivationCheckpointing;

    fn cfg() -> ResolvedConfig {
        let src = "train_micro_batch_size_per_gpu = 1\n[optimizer]\ntype = \"AdamW\"\n\
                   params.lr = 1e-4\n[zero_optimization]\nstage = 3\n";
        crate::engine::test_config(src, None)
    }

    #[test]
    fn reuse_needs_a_sharded_unit_within_the_distance() {
        let mut c = cfg();
        c.zero.max_reuse_distance = 100;
        assert!(reused_soon(&c, true, 50));
        assert!(!reused_soon(&c, true, 51));
        assert!(!reused_soon(&c, false, 0));
    }

    #[test]
    fn checkpoints_go_where_cpu_checkpointing_says() {
        let mut c = cfg();
        c.activation_checkpointing = Some(ActivationCheckpointing {
            cpu_checkpointing: true,
        });
        assert_eq!(ckpt_location(&c), Location::Host);
        c.activation_checkpointing = Some(ActivationCheckpointing {
            cpu_checkpointing: false,
        });
        assert_eq!(ckpt_location(&c), Location::Device);
    }

    #[test]
    fn a_checkpoint_comes_up_one_unit_ahead() {
        assert_eq!(checkpoint_up_with(3, 0), Some(2));
        assert_eq!(checkpoint_up_with(1, 0), Some(0));
        assert_eq!(
            checkpoint_up_with(0, 0),
            None,
            "nothing below the first unit"
        );
        assert_eq!(checkpoint_up_with(3, 2), Some(2));
        assert_eq!(
            checkpoint_up_with(2, 2),
            None,
            "no checkpoint below the floor"
        );
        assert_eq!(backward_next(3, 0), Some(2));
        assert_eq!(backward_next(2, 2), None);
        assert_eq!(backward_next(0, 0), None);
    }

    #[test]
    fn a_host_shard_goes_up_ahead_when_its_shard_group_is_one_rank() {
        let mut c = cfg();
        assert!(
            !uploads_ahead(&c, 1),
            "a device shard is copied where it is used"
        );
        c.zero.offload_param.target = OffloadTarget::Cpu;
        assert!(uploads_ahead(&c, 1));
        assert!(!uploads_ahead(&c, 2), "a shard group of two gathers");
    }

    #[test]
    fn small_groups_persist_and_bounds_bind() {
        let mut c = cfg();
        c.zero.param_persistence_threshold = 10;
        assert_eq!(param_extent(&c, Extent::Shard, 9), Extent::Full);
        assert_eq!(param_extent(&c, Extent::Shard, 10), Extent::Shard);
        assert_eq!(param_extent(&c, Extent::Full, 1), Extent::Full);
        c.zero.prefetch_bucket_size = 10;
        c.zero.max_live_parameters = 15;
        assert!(prefetch_fits(&c, 10, 5));
        assert!(!prefetch_fits(&c, 10, 6));
        assert!(!prefetch_fits(&c, 11, 0));
        c.zero.reduce_bucket_size = 5;
        assert!(!reductions_over_bound(&c, 1, 100));
        assert!(!reductions_over_bound(&c, 2, 10));
        assert!(reductions_over_bound(&c, 2, 11));
    }
}
