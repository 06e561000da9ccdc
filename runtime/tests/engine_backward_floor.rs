//! Backward stops at the lowest unit that reads a trainable parameter
//! (`Model::backward_floor`), as autograd stops where nothing below needs a gradient, and
//! forward keeps nothing for the units below it: the gradients of what trains are the bits
//! of a full backward, and the frozen units' activations are no longer held.

mod common;

use std::time::Duration;

use common::{checkpointing, config, tiny, toy};
use ferrozero_config::resolved::{Precision, ResolvedConfig, ZeroStage};
use ferrozero_runtime::comm::local::run_ranks;
use ferrozero_runtime::engine::ledger::{Category, Location};
use ferrozero_runtime::engine::Engine;
use ferrozero_runtime::nn::freeze::Freeze;
use ferrozero_runtime::nn::Model;

const T: usize = 8;
const MICRO: usize = 2;

/// GPT-2 of three blocks with the embeddings and the first two blocks frozen: units 0-2
/// (embeddings, h.0, h.1) have no gradient to compute.
fn bottom_frozen() -> Model {
    let f = Freeze::new(&[
        "transformer.w?e.weight",
        "transformer.h.0.*",
        "transformer.h.1.*",
    ]);
    tiny::gpt2_model(3).freeze(f.unwrap()).unwrap()
}

/// Rank 0's gradient of every trainable parameter, by name, after one forward and backward,
/// and the ledger's peak of device activations.
fn gradients(build: fn() -> Model, cfg: &ResolvedConfig) -> (Vec<(String, Vec<u32>)>, u64) {
    let world = cfg.world_size;
    let out = run_ranks(world, Duration::from_secs(60), |comm| {
        let rank = comm.rank();
        let mut e = Engine::new(build(), cfg.clone(), comm)?;
        e.forward(&toy::batch(tiny::VOCAB, T, rank * MICRO, MICRO))?;
        e.backward()?;
        let mut named = Vec::new();
        for shard in e.gradient_shards()? {
            named.push((
                shard.params.join(","),
                shard.data.iter().map(|x| x.to_bits()).collect(),
            ));
        }
        Ok((
            named,
            e.ledger().peak(Location::Device, Category::Activations),
        ))
    })
    .expect("backward failed");
    out.into_iter().next().unwrap()
}

#[test]
fn the_floor_is_the_first_unit_that_reads_a_trainable_parameter() {
    assert_eq!(bottom_frozen().backward_floor(), 3);
    assert_eq!(tiny::gpt2_model(3).backward_floor(), 0);
    // The tied table trains: the embedding unit reads it.
    let f = Freeze::new(&["transformer.wpe.weight", "transformer.h.*"]).unwrap();
    assert_eq!(tiny::gpt2_model(3).freeze(f).unwrap().backward_floor(), 0);
    // LoRA on every block leaves only the embeddings below the floor.
    assert_eq!(tiny::gpt2_lora(r#""all-linear""#, "[]").backward_floor(), 1);
}

/// The trainable groups' gradients are the bits a full backward gives them, at every stage,
/// with and without checkpointing; the frozen units' activations are not held.
#[test]
fn gradients_above_the_floor_are_a_full_backwards_bits() {
    let full = || tiny::gpt2_model(3);
    let mut checked = 0;
    for stage in [ZeroStage::Stage0, ZeroStage::Stage3] {
        for ckpt in [None, Some(checkpointing(false)), Some(checkpointing(true))] {
            let mut cfg = config(stage, 2, MICRO, 1, Precision::F32);
            cfg.activation_checkpointing = ckpt.clone();
            let (frozen, frozen_peak) = gradients(bottom_frozen, &cfg);
            let (all, all_peak) = gradients(full, &cfg);
            let at = format!("{stage:?}, checkpointing {ckpt:?}");
            assert!(!frozen.is_empty(), "{at}");
            for (names, bits) in &frozen {
                let want = all.iter().find(|(n, _)| n == names);
                let want = want.unwrap_or_else(|| panic!("{at}: no group {names}"));
                assert!(&want.1 == bits, "{at}: {names}");
                checked += 1;
            }
            if ckpt.is_none() {
                assert!(frozen_peak < all_peak, "{at}: {frozen_peak} vs {all_peak}");
            }
        }
    }
    assert!(checked >= 6, "{checked} groups compared");
}
