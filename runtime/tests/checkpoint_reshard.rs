//! Re-sharding: a checkpoint saved by 4 ranks at stage 3 loads at 1, 2 and 3 ranks (3 is not
//! a divisor, so every shard boundary moves) in stages 0-3; parameters, master weights and
//! moments equal the saved ones once padding is removed, and training continues.

mod common;

use std::path::Path;
use std::time::Duration;

use common::{config, toy};
use ferrozero_config::resolved::{Precision, ZeroStage};
use ferrozero_runtime::comm::local::run_ranks;
use ferrozero_runtime::engine::checkpoint::{CheckpointReader, Tag, TensorKind};
use ferrozero_runtime::engine::Engine;

const V: usize = 13;
const D: usize = 12;
const SEQ: usize = 4;

fn save_at_world_4(dir: &Path) {
    let cfg = config(ZeroStage::Stage3, 4, 1, 1, Precision::Bf16);
    run_ranks(4, Duration::from_secs(60), |comm| {
        let rank = comm.rank();
        let mut e = Engine::new(toy::model(V, D, SEQ, 2), cfg.clone(), comm)?;
        for s in 0..3 {
            e.train_batch(&[toy::batch(V, SEQ, s * 4 + rank, 1)])?;
        }
        e.save_checkpoint(dir, "w4", 3)?;
        Ok(())
    })
    .unwrap();
}

/// Every group's unpadded params (raw bits), master, m and v, as u32 bit patterns.
fn state(dir: &Path, tag: &str) -> Vec<Vec<u32>> {
    let r = CheckpointReader::open(dir, &Tag::Named(tag.into())).unwrap();
    r.verify_all().unwrap();
    let mut out = Vec::new();
    for (g, gm) in r.meta().groups.iter().enumerate() {
        let all = 0..gm.numel;
        let raw = r.read_raw(g, TensorKind::Params, all.clone()).unwrap();
        out.push(
            raw.chunks(2)
                .map(|c| u16::from_le_bytes([c[0], c[1]]) as u32)
                .collect(),
        );
        for kind in [TensorKind::Master, TensorKind::M, TensorKind::V] {
            let v = r.read_f32(g, kind, all.clone()).unwrap();
            out.push(v.iter().map(|x| x.to_bits()).collect());
        }
    }
    out
}

#[test]
fn world_4_stage_3_loads_at_worlds_1_2_3_in_every_stage() {
    let src = tempfile::tempdir().unwrap();
    save_at_world_4(src.path());
    let original = state(src.path(), "w4");
    let reference = CheckpointReader::open(src.path(), &Tag::Latest).unwrap();
    for world in [1, 2, 3] {
        for stage in common::STAGES {
            let what = format!("world {world} {stage:?}");
            let out = tempfile::tempdir().unwrap();
            let cfg = config(stage, world, 1, 1, Precision::Bf16);
            let losses = run_ranks(world, Duration::from_secs(60), |comm| {
                let rank = comm.rank();
                let mut e = Engine::new(toy::model(V, D, SEQ, 2), cfg.clone(), comm)?;
                let l = e.load_checkpoint(src.path(), &Tag::Latest)?;
                assert_eq!((l.step, l.data_position, l.saved_world_size), (3, 3, 4));
                assert_eq!(e.global_steps(), 3);
                // The live parameters are the saved master values.
                let params = e.parameters()?;
                let mut gi = 0;
                for (g, gm) in reference.meta().groups.iter().enumerate() {
                    for s in &gm.slots {
                        let want = reference.read_values(g, s.offset..s.offset + s.numel)?;
                        assert_eq!(params[gi].name, s.name);
                        assert_eq!(params[gi].data, want, "{what}: {}", s.name);
                        gi += 1;
                    }
                }
                e.save_checkpoint(out.path(), "resharded", l.data_position)?;
                let r = e.train_batch(&[toy::batch(V, SEQ, 100 + rank, 1)])?;
                Ok(r.loss)
            })
            .unwrap();
            assert!(losses.iter().all(|l| l.is_finite()), "{what}: {losses:?}");
            assert_eq!(state(out.path(), "resharded"), original, "{what}");
        }
    }
}

#[test]
fn a_bf16_checkpoint_loads_into_an_f32_engine() {
    let src = tempfile::tempdir().unwrap();
    save_at_world_4(src.path());
    let reference = CheckpointReader::open(src.path(), &Tag::Latest).unwrap();
    let cfg = config(ZeroStage::Stage1, 2, 1, 1, Precision::F32);
    let params = run_ranks(2, Duration::from_secs(60), |comm| {
        let mut e = Engine::new(toy::model(V, D, SEQ, 2), cfg.clone(), comm)?;
        e.load_checkpoint(src.path(), &Tag::Named("w4".into()))?;
        e.parameters()
    })
    .unwrap();
    let g0 = &reference.meta().groups[0].slots[0];
    let want = reference
        .read_values(0, g0.offset..g0.offset + g0.numel)
        .unwrap();
    assert_eq!(params[0][0].data, want);
}
