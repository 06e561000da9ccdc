//! Whether the host can hold a speculative overlap's snapshots. They copy every group's
//! optimizer values (about 14 bytes per parameter in bf16, divided among the ranks), which on
//! a large model with the optimizer offloaded can be as much as the offloaded state itself: a
//! 7B Llama at stage 3 on one 128 GiB host holds ~81 GB of state and would need ~94 GB more.
//! There the overlap falls back to off, as it was with clipping before speculation existed,
//! rather than turning a run that fits into one the pre-flight refuses or the host swaps.

use ferrozero_config::resolved::ResolvedConfig;
use ferrozero_offload::sys::human;

use super::OptimizerOverlap;
use crate::engine::estimate::Estimate;

/// What the host must hold for this machine's ranks, as the pre-flight check counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostNeed {
    /// Host bytes the pre-flight requires with the snapshots.
    pub with_snapshots: u64,
    /// Of which the snapshots.
    pub snapshots: u64,
}

impl HostNeed {
    /// The pre-flight's host requirement for `here` ranks sharing this machine, from `e` (an
    /// estimate with the snapshots counted), the device working set included when the
    /// device's memory is the host's.
    pub fn of(e: &Estimate, here: u64, device_in_ram: bool) -> Self {
        let device = if device_in_ram {
            e.device.peak_bytes
        } else {
            0
        };
        HostNeed {
            with_snapshots: (device + e.host_total_bytes()).saturating_mul(here),
            snapshots: e.snapshot_host_bytes.saturating_mul(here),
        }
    }
}

impl OptimizerOverlap {
    /// The decision for a config on a host with `available` bytes (the pre-flight's figure,
    /// `MemAvailable`, against which it allows no further margin): a speculative overlap
    /// whose snapshots do not fit beside everything else falls back to off, with a reason
    /// that gives the numbers. Any other decision is the config's.
    pub fn decide_for_host(cfg: &ResolvedConfig, need: HostNeed, available: u64) -> Self {
        let decided = Self::decide(cfg);
        let OptimizerOverlap::Speculative(global) = &decided else {
            return decided;
        };
        if need.with_snapshots <= available {
            return decided;
        }
        let without = need.with_snapshots.saturating_sub(need.snapshots);
        let b = |n: u64| format!("{} ({n} bytes)", human(n));
        OptimizerOverlap::Off(format!(
            "{global}, and the speculative overlap's optimizer snapshots need {} of host \
             memory: with them this run needs {}, without them {}, and {} is available \
             (MemAvailable); the step runs after backward instead",
            b(need.snapshots),
            b(need.with_snapshots),
            b(without),
            b(available)
        ))
    }
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

    #[test]
    fn llama_7b_stage3_offload_on_a_128_gib_host_falls_back_to_off_with_the_numbers() {
        let cfg = offload_config();
        assert!(matches!(
            OptimizerOverlap::decide(&cfg),
            OptimizerOverlap::Speculative(_)
        ));
        let model = preset("llama-7b").unwrap().model;
        let e = estimate(&model, &cfg, 1, 2048);
        // ~14 bytes per parameter: f32 master weights and two f32 moments, a bf16 copy.
        let n = e.num_params;
        assert!(e.snapshot_host_bytes >= 14 * n && e.snapshot_host_bytes < 15 * n);
        let need = HostNeed::of(&e, 1, false);
        assert!(
            need.with_snapshots - need.snapshots < HOST_128G,
            "fits without them"
        );
        assert!(need.with_snapshots > HOST_128G);
        let OptimizerOverlap::Off(why) = OptimizerOverlap::decide_for_host(&cfg, need, HOST_128G)
        else {
            panic!("a 7B speculation on 128 GiB must fall back to off");
        };
        for figure in [
            need.snapshots,
            need.with_snapshots,
            need.with_snapshots - need.snapshots,
            HOST_128G,
        ] {
            assert!(
                why.contains(&format!("({figure} bytes)")),
                "{figure}: {why}"
            );
        }
        assert!(why.contains("gradient_clipping=1.0"), "{why}");
        assert!(why.contains("128.0 GiB"), "{why}");
    }

    #[test]
    fn a_small_model_stays_speculative() {
        let cfg = offload_config();
        let model = preset("tiny-gpt2").unwrap().model;
        let e = estimate(&model, &cfg, 1, 64);
        assert!(e.snapshot_host_bytes > 0);
        let need = HostNeed::of(&e, 1, true);
        let got = OptimizerOverlap::decide_for_host(&cfg, need, HOST_128G);
        assert!(matches!(got, OptimizerOverlap::Speculative(_)), "{got:?}");
        // Exactly at the limit still fits; one byte short does not.
        let at = OptimizerOverlap::decide_for_host(&cfg, need, need.with_snapshots);
        assert!(matches!(at, OptimizerOverlap::Speculative(_)), "{at:?}");
        let short = OptimizerOverlap::decide_for_host(&cfg, need, need.with_snapshots - 1);
        assert!(matches!(short, OptimizerOverlap::Off(_)), "{short:?}");
    }

    #[test]
    fn an_exact_overlap_ignores_the_host() {
        let mut cfg = offload_config();
        cfg.gradient_clipping = 0.0;
        let need = HostNeed {
            with_snapshots: u64::MAX,
            snapshots: 0,
        };
        assert_eq!(
            OptimizerOverlap::decide_for_host(&cfg, need, 0),
            OptimizerOverlap::On
        );
        // And an estimate for an overlap that is off counts no snapshot.
        let model = preset("tiny-gpt2").unwrap().model;
        let off = OptimizerOverlap::Off("test".into());
        let cfg = offload_config();
        let e = crate::engine::estimate::estimate_with_overlap(&model, &cfg, 1, 64, &off);
        let spec = estimate(&model, &cfg, 1, 64);
        assert_eq!(e.snapshot_host_bytes, 0);
        assert_eq!(
            spec.host.peak_bytes - e.host.peak_bytes,
            spec.snapshot_host_bytes
        );
    }
}
