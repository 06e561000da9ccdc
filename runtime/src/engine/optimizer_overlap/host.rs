//! How much of a speculative overlap's snapshots the host can hold. They copy each lent
//! group's optimizer values (about 14 bytes per parameter in bf16, divided among the ranks),
//! which on a large model with the optimizer offloaded can be as much as the offloaded state
//! itself: a 7B Llama at stage 3 on one 128 GiB host holds ~81 GB of state and would need
//! ~94 GB more. There the snapshots are bounded by what the host has left: the groups
//! backward finishes first are snapshotted and speculate, the others are stepped after
//! backward ([`super::snapshot_plan`]); only when not one group fits is the overlap off.

use ferrozero_config::resolved::ResolvedConfig;
use ferrozero_offload::sys::human;

use super::{snapshot_plan, OptimizerOverlap};
use crate::engine::estimate::{estimate_with_overlap, Estimate};
use crate::engine::host_limits::HostRamNeed;

/// The share of the host's available memory the snapshots never take (1/16): the process's
/// own allocations beyond what the estimate counts (code, allocator slack, data loading).
pub const HOST_MARGIN_DIVISOR: u64 = 16;

/// What the host must hold for this machine's ranks, as the pre-flight check counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostNeed {
    /// Host bytes the pre-flight requires with the snapshots.
    pub with_snapshots: u64,
    /// Of which the snapshots.
    pub snapshots: u64,
    /// The ranks on this machine the figures count.
    pub ranks: u64,
}

impl HostNeed {
    /// The pre-flight's host requirement for `here` ranks sharing this machine, from `e` (an
    /// estimate with the snapshots counted): the device working set included when the
    /// device's memory is the host's, else the device's page-locked staging beside the host
    /// state (each buffer once, as the host-RAM check counts it).
    pub fn of(e: &Estimate, here: u64, device_in_ram: bool) -> Self {
        let with_snapshots = match device_in_ram {
            true => (e.device.peak_bytes + e.host_total_bytes()).saturating_mul(here),
            false => HostRamNeed::of(e, here).total(),
        };
        HostNeed {
            with_snapshots,
            snapshots: e.snapshot_host_bytes.saturating_mul(here),
            ranks: here.max(1),
        }
    }
}

impl OptimizerOverlap {
    /// The decision for a config on a host with `available` bytes (the pre-flight's figure,
    /// `MemAvailable`), given each group's snapshot bytes and the shared group's index
    /// (`Estimate::snapshot_group_bytes`): a speculative overlap whose snapshots do not fit
    /// beside everything else, less [`HOST_MARGIN_DIVISOR`]'s share, is bounded to the
    /// groups that do, and is off (the reason giving the numbers) when none does. Any other
    /// decision is the config's.
    pub fn decide_for_host(
        cfg: &ResolvedConfig,
        need: HostNeed,
        (groups, shared): (&[u64], Option<usize>),
        available: u64,
    ) -> Self {
        let decided = Self::decide(cfg);
        let OptimizerOverlap::Speculative(global, _) = &decided else {
            return decided;
        };
        let room = available - available / HOST_MARGIN_DIVISOR;
        if need.with_snapshots <= room {
            return decided;
        }
        let without = need.with_snapshots.saturating_sub(need.snapshots);
        let per_rank = room.saturating_sub(without) / need.ranks.max(1);
        let plan = snapshot_plan(groups, shared, Some(per_rank));
        let kept: u64 = groups
            .iter()
            .zip(&plan)
            .filter(|&(_, &p)| p)
            .map(|(b, _)| b)
            .sum();
        let all: u64 = groups.iter().sum();
        let b = |n: u64| format!("{} ({n} bytes)", human(n));
        let host = format!(
            "every group's snapshots need {} of host memory: with them this run needs {}, \
             without them {}, and {} is available, of which 1/{HOST_MARGIN_DIVISOR} \
             is left to the process",
            b(need.snapshots),
            b(need.with_snapshots),
            b(without),
            b(available)
        );
        if kept == 0 {
            return OptimizerOverlap::Off(format!(
                "{global}, and {host}: not one group's snapshot fits, so the step runs after \
                 backward"
            ));
        }
        let pct = 100.0 * kept as f64 / all.max(1) as f64;
        OptimizerOverlap::Speculative(
            format!(
                "{global}; {host}: snapshots of {} per rank ({pct:.0}% of the optimizer \
                 state: the groups backward finishes first) speculate, the others step after \
                 backward",
                b(kept)
            ),
            Some(kept),
        )
    }
}

/// The optimizer overlap `model` gets under `cfg` on a host of `available` bytes shared by
/// `ranks` ranks (the device's working set counted as RAM when `device_in_ram`), and the
/// estimate for it at micro-batches of `micro` rows of `seq` tokens: what `initialize` and
/// `ferrozero estimate` both decide with.
pub fn overlap_on_host(
    model: &crate::nn::Model,
    cfg: &ResolvedConfig,
    (micro, seq): (usize, usize),
    (ranks, device_in_ram): (u64, bool),
    available: u64,
) -> crate::Result<(OptimizerOverlap, Estimate)> {
    let configured = OptimizerOverlap::decide(cfg);
    let e = estimate_with_overlap(model, cfg, micro, seq, &configured)?;
    let need = HostNeed::of(&e, ranks, device_in_ram);
    let groups = (&e.snapshot_group_bytes[..], super::shared_group(model));
    let decided = OptimizerOverlap::decide_for_host(cfg, need, groups, available);
    if decided == configured {
        return Ok((decided, e));
    }
    let e = estimate_with_overlap(model, cfg, micro, seq, &decided)?;
    Ok((decided, e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::estimate::{estimate, shape::preset};

    /// The run users come for: stage 3, AdamW offloaded to the CPU, bf16, clipping 1.0.
    fn offload_config() -> ResolvedConfig {
        let src = "device = \"cuda\"\ntrain_micro_batch_size_per_gpu = 1\n\
                   gradient_clipping = 1.0\n[bf16]\nenabled = true\n\
                   [optimizer]\ntype = \"AdamW\"\nparams.lr = 1e-4\n\
                   [zero_optimization]\nstage = 3\noverlap_comm = true\n\
                   [zero_optimization.offload_optimizer]\ndevice = \"cpu\"\n";
        crate::engine::test_config(src, None)
    }

    const HOST_128G: u64 = 128 << 30;

    /// With every group's snapshots the need, at a host of `available`: the decision and
    /// the estimate for it.
    fn decided(
        model: &crate::nn::Model,
        seq: usize,
        available: u64,
    ) -> (OptimizerOverlap, HostNeed, Estimate) {
        let cfg = offload_config();
        let e = estimate(model, &cfg, 1, seq).unwrap();
        let need = HostNeed::of(&e, 1, false);
        let groups = (
            &e.snapshot_group_bytes[..],
            super::super::shared_group(model),
        );
        (
            OptimizerOverlap::decide_for_host(&cfg, need, groups, available),
            need,
            e,
        )
    }

    /// The 7B preset on a 128 GiB host keeps a speculative overlap, bounded to the groups
    /// backward finishes first, whose total need is within the host less its margin; the
    /// reason gives every figure.
    #[test]
    fn llama_7b_stage3_offload_on_a_128_gib_host_keeps_a_bounded_speculation() {
        let cfg = offload_config();
        assert!(matches!(
            OptimizerOverlap::decide(&cfg),
            OptimizerOverlap::Speculative(_, None)
        ));
        let model = preset("llama-7b").unwrap().model;
        let (got, need, e) = decided(&model, 2048, HOST_128G);
        // ~14 bytes per parameter: f32 master weights and two f32 moments, a bf16 copy.
        let n = e.num_params;
        assert!(e.snapshot_host_bytes >= 14 * n && e.snapshot_host_bytes < 15 * n);
        assert_eq!(
            e.snapshot_group_bytes.iter().sum::<u64>(),
            e.snapshot_host_bytes
        );
        assert!(need.with_snapshots > HOST_128G);
        let OptimizerOverlap::Speculative(why, Some(kept)) = got else {
            panic!("a 7B speculation on 128 GiB keeps a bounded overlap: {got:?}");
        };
        let room = HOST_128G - HOST_128G / HOST_MARGIN_DIVISOR;
        let without = need.with_snapshots - need.snapshots;
        assert!(
            kept > 0 && without + kept <= room,
            "{kept} + {without} within {room}"
        );
        // The next group in backward's order would not have fitted.
        let groups = &e.snapshot_group_bytes;
        let last_unit = groups.len() - 1;
        assert!(groups[..last_unit]
            .iter()
            .rev()
            .any(|&b| without + kept + b > room));
        for figure in [
            need.snapshots,
            need.with_snapshots,
            without,
            HOST_128G,
            kept,
        ] {
            assert!(
                why.contains(&format!("({figure} bytes)")),
                "{figure}: {why}"
            );
        }
        assert!(why.contains("gradient_clipping=1.0"), "{why}");
        assert!(why.contains("128.0 GiB"), "{why}");
        // The estimate for the bounded overlap counts those snapshots alone.
        let bounded = crate::engine::estimate::estimate_with_overlap(
            &model,
            &cfg,
            1,
            2048,
            &OptimizerOverlap::Speculative(why, Some(kept)),
        )
        .unwrap();
        assert_eq!(bounded.snapshot_host_bytes, kept);
        assert!(bounded.host_total_bytes() <= room);
        // Of the 14 bytes a parameter's snapshot holds, its bf16 copy (2) is a device value,
        // held in page-locked staging; the host's need counts those bytes once.
        let locked = &bounded.page_locked;
        assert_eq!(locked.snapshots, kept / 7);
        let ram = HostRamNeed::of(&bounded, 1);
        let once = bounded.host_total_bytes() + locked.total() - locked.parameters - kept / 7;
        assert_eq!(ram.total(), once);
    }

    /// A host that cannot hold one group's snapshot beside the run turns the overlap off.
    #[test]
    fn no_room_for_one_snapshot_turns_the_overlap_off() {
        let model = preset("llama-7b").unwrap().model;
        let (_, need, _) = decided(&model, 2048, HOST_128G);
        let without = need.with_snapshots - need.snapshots;
        let tight = without + without / (HOST_MARGIN_DIVISOR - 1) + 1;
        let (got, ..) = decided(&model, 2048, tight);
        let OptimizerOverlap::Off(why) = got else {
            panic!("no group fits: {got:?}");
        };
        assert!(why.contains("not one group"), "{why}");
    }

    #[test]
    fn a_small_model_stays_speculative() {
        let model = preset("tiny-gpt2").unwrap().model;
        let (got, need, e) = decided(&model, 32, HOST_128G);
        assert!(e.snapshot_host_bytes > 0);
        assert_eq!(got, OptimizerOverlap::decide(&offload_config()), "{got:?}");
        // Within the room left beside the margin every snapshot is kept; short of it, fewer.
        let at = need.with_snapshots * HOST_MARGIN_DIVISOR / (HOST_MARGIN_DIVISOR - 1) + 1;
        let (full, ..) = decided(&model, 32, at);
        assert!(
            matches!(full, OptimizerOverlap::Speculative(_, None)),
            "{full:?}"
        );
        let (short, ..) = decided(&model, 32, need.with_snapshots);
        assert!(
            matches!(
                short,
                OptimizerOverlap::Speculative(_, Some(_)) | OptimizerOverlap::Off(_)
            ),
            "{short:?}"
        );
    }

    #[test]
    fn an_exact_overlap_ignores_the_host() {
        let mut cfg = offload_config();
        cfg.gradient_clipping = 0.0;
        let need = HostNeed {
            with_snapshots: u64::MAX,
            snapshots: 0,
            ranks: 1,
        };
        assert_eq!(
            OptimizerOverlap::decide_for_host(&cfg, need, (&[], None), 0),
            OptimizerOverlap::On
        );
        // And an estimate for an overlap that is off counts no snapshot.
        let model = preset("tiny-gpt2").unwrap().model;
        let off = OptimizerOverlap::Off("test".into());
        let cfg = offload_config();
        let e = crate::engine::estimate::estimate_with_overlap(&model, &cfg, 1, 32, &off).unwrap();
        let spec = estimate(&model, &cfg, 1, 32).unwrap();
        assert_eq!(e.snapshot_host_bytes, 0);
        assert_eq!(
            spec.host.peak_bytes - e.host.peak_bytes,
            spec.snapshot_host_bytes
        );
    }

    /// The plan takes the groups in backward's order (the last unit first, the shared group
    /// last) while they fit, and none after the first that does not.
    #[test]
    fn the_plan_follows_backward() {
        let plan = |b: Option<u64>| snapshot_plan(&[5, 4, 3, 2, 9], Some(4), b);
        assert_eq!(plan(None), vec![true; 5]);
        assert_eq!(plan(Some(0)), vec![false; 5]);
        assert_eq!(plan(Some(5)), vec![false, false, true, true, false]);
        assert_eq!(plan(Some(9)), vec![false, true, true, true, false]);
        assert_eq!(plan(Some(14)), vec![true, true, true, true, false]);
        assert_eq!(plan(Some(23)), vec![true; 5]);
        // Stops at the first that does not fit, though a later one would.
        assert_eq!(
            snapshot_plan(&[1, 9, 2], None, Some(3)),
            vec![false, false, true]
        );
    }
}
