//! Frozen parameters on every device: a GPT-2 with its attention weights and embeddings
//! frozen, and one with LoRA on every linear layer, train to the same bits at every stage,
//! with and without offload, on one device; the frozen parameters stay what they were; and
//! the device's run is close to the CPU's.

mod common;
mod device_common;

use std::sync::Arc;

use common::runs::{losses, rank0, toy_steps};
use common::{config, tiny};
use device_common::Dev;
use ferrozero_config::resolved::{OffloadTarget, ResolvedConfig, ZeroStage};
use ferrozero_runtime::backend::Backend;
use ferrozero_runtime::engine::{Engine, NamedTensor};
use ferrozero_runtime::nn::Model;

const T: usize = 8;
const STEPS: usize = 2;

fn lora() -> Model {
    tiny::gpt2_lora(r#""all-linear""#, "[]")
}

fn cfg_for(d: &Dev, stage: ZeroStage) -> ResolvedConfig {
    cfg_world(d, stage, 1)
}

fn cfg_world(d: &Dev, stage: ZeroStage, world: usize) -> ResolvedConfig {
    let precision = d.training_precision();
    config(stage, world, 2, 2, precision)
}

/// Stage 3 with the optimizer state and the parameter shards in host memory.
fn offloaded(d: &Dev) -> ResolvedConfig {
    let mut c = cfg_for(d, ZeroStage::Stage3);
    c.zero.offload_optimizer.target = OffloadTarget::Cpu;
    c.zero.offload_param.target = OffloadTarget::Cpu;
    c
}

/// What a run leaves: each step's loss, and the parameters before and after.
type Run = (Vec<f64>, Vec<NamedTensor>, Vec<NamedTensor>);

/// Rank 0's run; every rank computes on `be` (ranks as threads on one device).
fn train(be: &Arc<dyn Backend>, cfg: &ResolvedConfig, build: fn() -> Model) -> Run {
    rank0(cfg.world_size, |comm| {
        let rank = comm.rank();
        let mut e = Engine::with_backend(build(), cfg.clone(), comm, be.clone())?;
        let before = e.parameters()?;
        let reports = toy_steps(&mut e, cfg, (tiny::VOCAB, T), STEPS, rank)?;
        Ok((losses(&reports), before, e.parameters()?))
    })
    .expect("training failed")
}

fn bits(p: &[NamedTensor]) -> Vec<Vec<u32>> {
    p.iter()
        .map(|t| t.data.iter().map(|x| x.to_bits()).collect())
        .collect()
}

/// Stage 0's run of `build` on `d` against `others` on the same device (the same bits) and
/// against the CPU (close); the frozen parameters, and only they, unmoved.
fn check(d: &Dev, build: fn() -> Model, others: Vec<(&str, ResolvedConfig)>) {
    let (losses, before, after) = train(&d.be, &cfg_for(d, ZeroStage::Stage0), build);
    let model = build();
    for (b, a) in before.iter().zip(&after) {
        let same = bits(std::slice::from_ref(b)) == bits(std::slice::from_ref(a));
        assert_eq!(same, model.is_frozen(&b.name), "{}: {}", d.name, b.name);
    }
    for (what, cfg) in others {
        let (l, _, p) = train(&d.be, &cfg, build);
        let same = l
            .iter()
            .map(|x| x.to_bits())
            .eq(losses.iter().map(|x| x.to_bits()));
        assert!(
            same,
            "{}: {what}: losses {l:?} vs stage 0 {losses:?}",
            d.name
        );
        assert!(
            bits(&p) == bits(&after),
            "{}: {what} changed the parameters",
            d.name
        );
    }
    let cpu = device_common::cpu();
    let (want, _, _) = train(&cpu.be, &cfg_for(d, ZeroStage::Stage0), build);
    device_common::assert_losses_close(d, &losses, &want);
}

fn frozen_training(d: &Dev) {
    let others = vec![
        ("stage 1", cfg_for(d, ZeroStage::Stage1)),
        ("stage 3", cfg_for(d, ZeroStage::Stage3)),
        ("stage 3 with offload", offloaded(d)),
    ];
    check(d, tiny::gpt2_part_frozen, others);
}
test_device!(frozen_training);

fn lora_training(d: &Dev) {
    let mut busy = offloaded(d);
    busy.zero.overlap_comm = true;
    busy.activation_checkpointing = Some(common::checkpointing(true));
    let others = vec![
        ("stage 2", cfg_for(d, ZeroStage::Stage2)),
        ("stage 3 with offload", offloaded(d)),
        ("stage 3, offload, overlap, host checkpoints", busy),
    ];
    check(d, lora, others);
}
test_device!(lora_training);

/// Two ranks on one device: stages 1 and 3 (offloaded, overlapped) to stage 0's bits.
fn lora_two_ranks(d: &Dev) {
    let (want, _, after) = train(&d.be, &cfg_world(d, ZeroStage::Stage0, 2), lora);
    let mut busy = cfg_world(d, ZeroStage::Stage3, 2);
    busy.zero.offload_optimizer.target = OffloadTarget::Cpu;
    busy.zero.overlap_comm = true;
    for cfg in [cfg_world(d, ZeroStage::Stage1, 2), busy] {
        let (l, _, p) = train(&d.be, &cfg, lora);
        assert_eq!(l, want, "{}: {:?}", d.name, cfg.zero.stage);
        assert!(bits(&p) == bits(&after), "{}: {:?}", d.name, cfg.zero.stage);
    }
}
test_device!(lora_two_ranks);
