//! Offload changes where bytes live, not the math: optimizer state on the host or on NVMe and
//! parameters on the host give bitwise-identical parameters to the run without offload.

mod common;

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::{config, toy};
use ferrozero_config::resolved::{OffloadTarget, Precision, ResolvedConfig, ZeroStage};
use ferrozero_runtime::comm::local::run_ranks;
use ferrozero_runtime::engine::ledger::{Category, Location};
use ferrozero_runtime::engine::Engine;

fn swap_dir() -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    std::env::temp_dir().join(format!(
        "fz-offload-test-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ))
}

fn train(cfg: &ResolvedConfig, steps: usize) -> (Vec<Vec<u32>>, u64) {
    let world = cfg.world_size;
    let out = run_ranks(world, Duration::from_secs(60), |comm| {
        let rank = comm.rank();
        let mut e = Engine::new(toy::model(11, 6, 5, 2), cfg.clone(), comm)?;
        for s in 0..steps {
            e.train_batch(&[toy::batch(11, 5, (s * world + rank) * 2, 2)])?;
        }
        let bits: Vec<u32> = e
            .parameters()?
            .iter()
            .flat_map(|t| t.data.iter().map(|x| x.to_bits()))
            .collect();
        Ok((
            bits,
            e.ledger().peak(Location::Device, Category::OptimizerState),
        ))
    })
    .expect("training failed");
    let dev = out[0].1;
    (out.into_iter().map(|o| o.0).collect(), dev)
}

#[test]
fn every_offload_combination_is_bitwise_identical() {
    for world in [1, 2] {
        let base = config(ZeroStage::Stage3, world, 2, 1, Precision::Bf16);
        let (reference, dev_none) = train(&base, 20);
        for (opt, param) in [
            (OffloadTarget::Cpu, OffloadTarget::None),
            (OffloadTarget::None, OffloadTarget::Cpu),
            (OffloadTarget::Cpu, OffloadTarget::Cpu),
            (OffloadTarget::Nvme(swap_dir()), OffloadTarget::None),
            (OffloadTarget::Nvme(swap_dir()), OffloadTarget::Cpu),
        ] {
            let mut cfg = base.clone();
            cfg.zero.offload_optimizer.target = opt.clone();
            cfg.zero.offload_param.target = param.clone();
            let (got, dev) = train(&cfg, 20);
            assert!(got == reference, "world {world}: offload_optimizer {opt:?} offload_param {param:?} changed the result");
            if opt != OffloadTarget::None {
                assert_eq!(dev, 0, "optimizer state still counted on the device");
                assert!(dev_none > 0);
            }
        }
    }
}

#[test]
fn nvme_optimizer_offload_in_stage_1_and_2() {
    for stage in [ZeroStage::Stage1, ZeroStage::Stage2] {
        let base = config(stage, 2, 2, 1, Precision::Bf16);
        let mut nv = base.clone();
        nv.zero.offload_optimizer.target = OffloadTarget::Nvme(swap_dir());
        assert!(train(&base, 8).0 == train(&nv, 8).0, "{stage:?}");
    }
}

#[test]
fn unsupported_offload_is_refused_clearly() {
    let mut cfg = config(ZeroStage::Stage3, 1, 2, 1, Precision::F32);
    cfg.zero.offload_optimizer.target = OffloadTarget::Nvme(swap_dir());
    let err = run_ranks(1, Duration::from_secs(10), |comm| {
        Engine::new(toy::model(11, 6, 5, 1), cfg.clone(), comm).map(|_| ())
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("bf16 or fp16"), "{err}");
}
