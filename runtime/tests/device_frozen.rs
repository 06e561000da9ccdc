//! Frozen parameters on every device: a GPT-2 with its attention weights and embeddings
//! frozen trains to the same bits at every stage, with and without offload, on one device;
//! the frozen parameters stay what they were; and the device's run is close to the CPU's.

mod common;
mod device_common;

use std::sync::Arc;
use std::time::Duration;

use common::{config, tiny, toy};
use device_common::Dev;
use ferrozero_config::resolved::{OffloadTarget, Precision, ResolvedConfig, ZeroStage};
use ferrozero_runtime::backend::Backend;
use ferrozero_runtime::comm::local::run_ranks;
use ferrozero_runtime::engine::{Engine, NamedTensor};
use ferrozero_runtime::nn::freeze::Freeze;
use ferrozero_runtime::nn::peft::{self, LoraConfig};
use ferrozero_runtime::nn::{gpt2, Model};
use ferrozero_runtime::tensor::DType;

const T: usize = 8;
const STEPS: usize = 2;

fn model() -> Model {
    let f = Freeze::new(&["*.attn.*", "transformer.w?e.weight"]).unwrap();
    tiny::gpt2_model(2).freeze(f).unwrap()
}

/// Tiny GPT-2 with PEFT's LoRA on every linear layer (dropout 0.1), the base frozen.
fn lora_model() -> Model {
    let cfg = gpt2::Gpt2Config::from_json(&format!(
        r#"{{"n_layer": 2, "n_head": 2, "n_embd": 16, "vocab_size": {}, "n_positions": 16,
            "model_type": "gpt2", "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}}"#,
        tiny::VOCAB
    ))
    .unwrap();
    let lora = LoraConfig::from_json(
        r#"{"peft_type": "LORA", "r": 4, "lora_alpha": 8, "lora_dropout": 0.1,
            "target_modules": "all-linear"}"#,
        "test",
    )
    .unwrap();
    let sites = gpt2::linear_sites(&cfg);
    let (adapters, frozen) = peft::plan(&lora, &sites, "GPT2LMHeadModel").unwrap();
    gpt2::build_with(&cfg, &adapters)
        .unwrap()
        .freeze(frozen)
        .unwrap()
}

fn cfg_for(d: &Dev, stage: ZeroStage) -> ResolvedConfig {
    let precision = match d.act() {
        DType::Bf16 => Precision::Bf16,
        _ => Precision::F32,
    };
    config(stage, 1, 2, 2, precision)
}

/// Rank 0's losses and parameters before and after `STEPS` steps on `be`.
fn train(
    be: &Arc<dyn Backend>,
    cfg: &ResolvedConfig,
) -> (Vec<f64>, Vec<NamedTensor>, Vec<NamedTensor>) {
    train_model(be, cfg, model)
}

fn train_model(
    be: &Arc<dyn Backend>,
    cfg: &ResolvedConfig,
    build: fn() -> Model,
) -> (Vec<f64>, Vec<NamedTensor>, Vec<NamedTensor>) {
    let out = run_ranks(1, Duration::from_secs(300), |comm| {
        let mut e = Engine::with_backend(build(), cfg.clone(), comm, be.clone())?;
        let before = e.parameters()?;
        let mut losses = Vec::new();
        for s in 0..STEPS {
            let batches: Vec<_> = (0..2)
                .map(|m| toy::batch(tiny::VOCAB, T, (s * 2 + m) * 2, 2))
                .collect();
            losses.push(e.train_batch(&batches)?.loss);
        }
        Ok((losses, before, e.parameters()?))
    })
    .expect("training failed");
    out.into_iter().next().unwrap()
}

fn bits(p: &[NamedTensor]) -> Vec<Vec<u32>> {
    p.iter()
        .map(|t| t.data.iter().map(|x| x.to_bits()).collect())
        .collect()
}

fn frozen_training(d: &Dev) {
    let (losses, before, after) = train(&d.be, &cfg_for(d, ZeroStage::Stage0));
    let frozen = model();
    for (b, a) in before.iter().zip(&after) {
        let same = bits(std::slice::from_ref(b)) == bits(std::slice::from_ref(a));
        assert_eq!(same, frozen.is_frozen(&b.name), "{}: {}", d.name, b.name);
    }
    let mut offload = cfg_for(d, ZeroStage::Stage3);
    offload.zero.offload_optimizer.target = OffloadTarget::Cpu;
    offload.zero.offload_param.target = OffloadTarget::Cpu;
    for (what, cfg) in [
        ("stage 1", cfg_for(d, ZeroStage::Stage1)),
        ("stage 3", cfg_for(d, ZeroStage::Stage3)),
        ("stage 3 with offload", offload),
    ] {
        let (l, _, p) = train(&d.be, &cfg);
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
    let (want, _, _) = train(&cpu.be, &cfg_for(d, ZeroStage::Stage0));
    let rel = d.tol().rel.max(1e-4);
    for (a, b) in losses.iter().zip(&want) {
        assert!(
            (a - b).abs() <= rel * b.abs(),
            "{}: {losses:?} vs CPU {want:?}",
            d.name
        );
    }
}
test_device!(frozen_training);

/// LoRA on every linear layer: stage 0 and stage 3 with offload give the same bits on one
/// device, the base does not move, and the device is close to the CPU.
fn lora_training(d: &Dev) {
    let (losses, before, after) = train_model(&d.be, &cfg_for(d, ZeroStage::Stage0), lora_model);
    let frozen = lora_model();
    for (b, a) in before.iter().zip(&after) {
        let same = bits(std::slice::from_ref(b)) == bits(std::slice::from_ref(a));
        assert_eq!(same, frozen.is_frozen(&b.name), "{}: {}", d.name, b.name);
    }
    let mut offload = cfg_for(d, ZeroStage::Stage3);
    offload.zero.offload_optimizer.target = OffloadTarget::Cpu;
    offload.zero.offload_param.target = OffloadTarget::Cpu;
    let (l, _, p) = train_model(&d.be, &offload, lora_model);
    assert_eq!(l, losses, "{}: stage 3 with offload", d.name);
    assert!(bits(&p) == bits(&after), "{}: stage 3 with offload", d.name);
    let cpu = device_common::cpu();
    let (want, _, _) = train_model(&cpu.be, &cfg_for(d, ZeroStage::Stage0), lora_model);
    let rel = d.tol().rel.max(1e-4);
    for (a, b) in losses.iter().zip(&want) {
        assert!(
            (a - b).abs() <= rel * b.abs(),
            "{}: {losses:?} vs CPU {want:?}",
            d.name
        );
    }
}
test_device!(lora_training);
