//! A network small enough to compute by hand: exact activations (the loss) and the exact
//! gradient shard each rank holds, in every stage.

mod common;

use std::time::Duration;

use common::{config, toy};
use ferrozero_config::resolved::Precision;
use ferrozero_runtime::comm::local::run_ranks;
use ferrozero_runtime::engine::{Engine, NamedTensor};
use ferrozero_runtime::nn::Batch;

const D: usize = 16;

/// wte row 0 = 0.1, row 1 = 0.2 (every column); pos = 0.
fn weights() -> Vec<NamedTensor> {
    let mut wte = vec![0.1f32; D];
    wte.extend(vec![0.2f32; D]);
    vec![
        NamedTensor {
            name: "wte".into(),
            shape: vec![2, D],
            data: wte,
        },
        NamedTensor {
            name: "pos".into(),
            shape: vec![1, D],
            data: vec![0.0; D],
        },
    ]
}

/// By hand, for token `tok` with target `tgt`: x = wte[tok]; logits_c = x . wte[c];
/// loss = logsumexp - logit_tgt; dlogit = softmax - onehot; dwte[c] += dlogit_c * x (head)
/// and dwte[tok] += dx = sum_c dlogit_c * wte[c] (embedding); dpos = dx.
fn by_hand(tok: usize, tgt: usize) -> (f64, Vec<f64>, Vec<f64>) {
    let row = |c: usize| if c == 0 { 0.1f64 } else { 0.2 };
    let x = row(tok);
    let logits: Vec<f64> = (0..2).map(|c| D as f64 * x * row(c)).collect();
    let m = logits[0].max(logits[1]);
    let z: f64 = logits.iter().map(|l| (l - m).exp()).sum();
    let loss = m + z.ln() - logits[tgt];
    let p: Vec<f64> = logits.iter().map(|l| (l - m).exp() / z).collect();
    let dlogit: Vec<f64> = (0..2)
        .map(|c| p[c] - if c == tgt { 1.0 } else { 0.0 })
        .collect();
    let dx: f64 = (0..2).map(|c| dlogit[c] * row(c)).sum();
    let mut dwte = vec![0.0; 2 * D];
    for c in 0..2 {
        for k in 0..D {
            dwte[c * D + k] += dlogit[c] * x;
        }
    }
    for k in 0..D {
        dwte[tok * D + k] += dx;
    }
    (loss, dwte, vec![dx; D])
}

#[test]
fn exact_loss_and_per_rank_gradient_shards() {
    for stage in common::STAGES {
        let cfg = config(stage, 2, 1, 1, Precision::F32);
        let out = run_ranks(2, Duration::from_secs(10), |comm| {
            let rank = comm.rank();
            let mut e = Engine::new(toy::model(2, D, 1, 0), cfg.clone(), comm)?;
            e.set_parameters(&weights())?;
            // Rank 0 sees token 0 -> 1, rank 1 sees token 1 -> 0.
            let b = Batch {
                batch: 1,
                seq: 1,
                tokens: vec![rank as u32],
                targets: vec![1 - rank as i32],
            };
            let loss = e.forward(&b)?;
            e.backward()?;
            Ok((loss, e.gradient_shards()?))
        })
        .unwrap();
        let (l0, g0w, g0p) = by_hand(0, 1);
        let (l1, g1w, g1p) = by_hand(1, 0);
        assert!(
            (out[0].0 - l0).abs() < 1e-6 && (out[1].0 - l1).abs() < 1e-6,
            "{stage:?} loss"
        );
        // Gradients are averaged over the two ranks (DeepSpeed's data-parallel mean).
        let wte: Vec<f64> = g0w.iter().zip(&g1w).map(|(a, b)| (a + b) / 2.0).collect();
        let pos: Vec<f64> = g0p.iter().zip(&g1p).map(|(a, b)| (a + b) / 2.0).collect();
        // Groups: [embed (pos), head (no params), shared (wte)]. Shard length 16 with 2 ranks:
        // wte row 0 lives on rank 0, row 1 on rank 1; pos lives entirely on rank 0.
        for (rank, (_, shards)) in out.iter().enumerate() {
            let pos_shard = &shards[0];
            let wte_shard = &shards[2];
            assert_eq!(wte_shard.range, rank * D..(rank + 1) * D);
            for k in 0..D {
                assert!(
                    (wte_shard.data[k] as f64 - wte[rank * D + k]).abs() < 1e-6,
                    "{stage:?} rank {rank} wte[{k}]"
                );
                let want_pos = if rank == 0 { pos[k] } else { 0.0 };
                assert!(
                    (pos_shard.data[k] as f64 - want_pos).abs() < 1e-6,
                    "{stage:?} rank {rank} pos[{k}]"
                );
            }
        }
    }
}
