//! Consolidation: the output is a standard safetensors file with the model's names, equal to
//! the live parameters (f32 bit for bit, bf16 rounded from them), and loads back into a model.

mod common;

use std::time::Duration;

use common::{config, toy};
use ferrozero_config::resolved::{Precision, ZeroStage};
use ferrozero_runtime::comm::local::run_ranks;
use ferrozero_runtime::engine::checkpoint::{consolidate, OutputDType, Tag};
use ferrozero_runtime::engine::{Engine, NamedTensor};
use safetensors::{Dtype, SafeTensors};

const V: usize = 13;
const D: usize = 8;
const SEQ: usize = 4;

fn read(path: &std::path::Path) -> Vec<NamedTensor> {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<NamedTensor> = st
        .tensors()
        .into_iter()
        .map(|(name, t)| {
            let data = match t.dtype() {
                Dtype::F32 => t
                    .data()
                    .chunks(4)
                    .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                    .collect(),
                Dtype::BF16 => t
                    .data()
                    .chunks(2)
                    .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                    .collect(),
                d => panic!("unexpected dtype {d:?}"),
            };
            NamedTensor {
                name,
                shape: t.shape().to_vec(),
                data,
            }
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

#[test]
fn consolidated_weights_equal_the_live_parameters_and_reload() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(ZeroStage::Stage3, 3, 1, 1, Precision::Bf16);
    let mut live = run_ranks(3, Duration::from_secs(30), |comm| {
        let rank = comm.rank();
        let mut e = Engine::new(toy::model(V, D, SEQ, 2), cfg.clone(), comm)?;
        for s in 0..2 {
            e.train_batch(&[toy::batch(V, SEQ, s * 3 + rank, 1)])?;
        }
        e.save_checkpoint(dir.path(), "final", 2)?;
        e.parameters()
    })
    .unwrap()
    .remove(0);
    live.sort_by(|a, b| a.name.cmp(&b.name));

    let f32_out = dir.path().join("model.safetensors");
    let rep = consolidate(dir.path(), &Tag::Latest, &f32_out, OutputDType::F32).unwrap();
    assert_eq!(rep.tensors, live.len());
    assert_eq!(rep.bytes, std::fs::metadata(&f32_out).unwrap().len());
    let got = read(&f32_out);
    assert_eq!(got, live);

    let bf_out = dir.path().join("model-bf16.safetensors");
    consolidate(
        dir.path(),
        &Tag::Named("final".into()),
        &bf_out,
        OutputDType::Bf16,
    )
    .unwrap();
    for (g, l) in read(&bf_out).iter().zip(&live) {
        let want: Vec<f32> = l
            .data
            .iter()
            .map(|x| half::bf16::from_f32(*x).to_f32())
            .collect();
        assert_eq!((&g.name, &g.shape, &g.data), (&l.name, &l.shape, &want));
    }

    // The file loads back into a fresh model at another world size and stage.
    let cfg1 = config(ZeroStage::Stage0, 1, 1, 1, Precision::F32);
    let mut back = run_ranks(1, Duration::from_secs(30), |comm| {
        let mut e = Engine::new(toy::model(V, D, SEQ, 2), cfg1.clone(), comm)?;
        e.set_parameters(&got)?;
        e.parameters()
    })
    .unwrap()
    .remove(0);
    back.sort_by(|a, b| a.name.cmp(&b.name));
    assert_eq!(back, live);
}

#[test]
fn consolidating_a_corrupt_checkpoint_fails_and_leaves_no_output() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(ZeroStage::Stage1, 2, 1, 1, Precision::F32);
    run_ranks(2, Duration::from_secs(30), |comm| {
        let e = Engine::new(toy::model(V, D, SEQ, 1), cfg.clone(), comm)?;
        e.save_checkpoint(dir.path(), "t", 0)?;
        Ok(())
    })
    .unwrap();
    let file = dir.path().join("t/rank-00000.safetensors");
    let mut b = std::fs::read(&file).unwrap();
    let last = b.len() - 1;
    b[last] ^= 1;
    std::fs::write(&file, b).unwrap();
    let out = dir.path().join("m.safetensors");
    let err = consolidate(dir.path(), &Tag::Latest, &out, OutputDType::F32)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("rank-00000.safetensors") && err.contains("checksum"),
        "{err}"
    );
    assert!(!out.exists());
}

/// Writes a larger checkpoint (48 units of 1M parameters, 2 ranks, bf16 + master + Adam)
/// into `$FERROZERO_CKPT_BIG_DIR` for measuring `ferrozero checkpoint consolidate`'s peak
/// memory by hand; does nothing without the variable.
#[test]
fn write_a_large_checkpoint_for_measurement() {
    let Some(dir) = std::env::var_os("FERROZERO_CKPT_BIG_DIR") else {
        return;
    };
    let cfg = config(ZeroStage::Stage3, 2, 1, 1, Precision::Bf16);
    run_ranks(2, Duration::from_secs(600), |comm| {
        let e = Engine::new(toy::model(1024, 1024, 4, 48), cfg.clone(), comm)?;
        let t = std::time::Instant::now();
        e.save_checkpoint(&dir, "big", 0)?;
        eprintln!("rank {} saved in {:?}", e.rank(), t.elapsed());
        Ok(())
    })
    .unwrap();
    // Load at another world size and stage, re-sharding every group.
    let cfg3 = config(ZeroStage::Stage1, 3, 1, 1, Precision::Bf16);
    run_ranks(3, Duration::from_secs(600), |comm| {
        let mut e = Engine::new(toy::model(1024, 1024, 4, 48), cfg3.clone(), comm)?;
        let t = std::time::Instant::now();
        e.load_checkpoint(&dir, &Tag::Latest)?;
        eprintln!("rank {} loaded at world 3 in {:?}", e.rank(), t.elapsed());
        Ok(())
    })
    .unwrap();
}
