//! LAMB on every device: its passes run where the optimizer state is in host memory. With
//! the state offloaded to the host (`offload_optimizer.device = "cpu"`) a device trains with
//! it, stages 0-3 bitwise identical (two ranks on one device), close to the CPU's run; a
//! device whose optimizer kernels lack LAMB refuses the state in its memory at build, naming
//! `optimizer.type` and `offload_optimizer` (the CPU runs it in place).

mod common;
mod device_common;

use std::sync::Arc;
use std::time::Duration;

use common::{config, toy};
use device_common::Dev;
use ferrozero_config::resolved::ZeroStage;
use ferrozero_config::resolved::{OffloadTarget, OptimizerConfig, Precision, ResolvedConfig};
use ferrozero_runtime::backend::{Backend, Rope};
use ferrozero_runtime::comm::local::run_ranks;
use ferrozero_runtime::engine::{Engine, NamedTensor};
use ferrozero_runtime::nn::llama::{self, LlamaConfig};
use ferrozero_runtime::nn::Model;
use ferrozero_runtime::tensor::DType;

const V: usize = 23;
const T: usize = 6;

fn model() -> Model {
    llama::build(&LlamaConfig {
        hidden_size: 16,
        intermediate_size: 24,
        num_hidden_layers: 2,
        num_attention_heads: 2,
        num_key_value_heads: None,
        head_dim: None,
        rms_norm_eps: 1e-6,
        rope: Rope::plain(10000.0),
        vocab_size: V,
        max_position_embeddings: T,
        tie_word_embeddings: true,
        initializer_range: 0.3,
        qkv_bias: false,
        sliding_window: None,
        attention_dropout: 0.0,
    })
    .expect("a valid Llama")
}

/// LAMB with the state offloaded to the host; bf16 parameters on a bf16 device.
fn cfg_for(d: &Dev, stage: ZeroStage, world: usize) -> ResolvedConfig {
    let precision = match d.act() {
        DType::Bf16 => Precision::Bf16,
        _ => Precision::F32,
    };
    let mut c = config(stage, world, 2, 2, precision);
    c.optimizer = OptimizerConfig::Lamb {
        lr: 1e-2,
        betas: (0.9, 0.999),
        eps: 1e-8,
        eps_inside_sqrt: false,
        weight_decay: 0.01,
        bias_correction: true,
        max_coeff: 10.0,
        min_coeff: 0.01,
    };
    c.zero.offload_optimizer.target = OffloadTarget::Cpu;
    c
}

fn train(
    be: &Arc<dyn Backend>,
    cfg: &ResolvedConfig,
    steps: usize,
) -> ferrozero_runtime::Result<(Vec<NamedTensor>, Vec<f64>)> {
    let world = cfg.world_size;
    let (micro, gas) = (
        cfg.train_micro_batch_size_per_gpu,
        cfg.gradient_accumulation_steps,
    );
    let out = run_ranks(world, Duration::from_secs(120), |comm| {
        let rank = comm.rank();
        let mut e = Engine::with_backend(model(), cfg.clone(), comm, be.clone())?;
        let mut losses = Vec::new();
        for s in 0..steps {
            let batches: Vec<_> = (0..gas)
                .map(|m| toy::batch(V, T, ((s * gas + m) * world + rank) * micro, micro))
                .collect();
            losses.push(e.train_batch(&batches)?.loss);
        }
        Ok((e.parameters()?, losses))
    })?;
    Ok(out.into_iter().next().unwrap())
}

fn bits(p: &[NamedTensor]) -> Vec<(String, Vec<u32>)> {
    p.iter()
        .map(|t| (t.name.clone(), t.data.iter().map(|x| x.to_bits()).collect()))
        .collect()
}

/// Offloaded LAMB: stages 0-3 (and stage 3 with the parameter shards on the host too) give
/// the same bits at two ranks on one device; one rank's run is close to the CPU's.
fn lamb_offloaded_trains_bitwise_across_stages(d: &Dev) {
    let mut reference = None;
    for (stage, params_off) in [
        (ZeroStage::Stage0, false),
        (ZeroStage::Stage1, false),
        (ZeroStage::Stage2, false),
        (ZeroStage::Stage3, false),
        (ZeroStage::Stage3, true),
    ] {
        let mut cfg = cfg_for(d, stage, 2);
        if params_off {
            cfg.zero.offload_param.target = OffloadTarget::Cpu;
        }
        let (p, losses) = train(&d.be, &cfg, 3).expect("offloaded LAMB trains");
        assert!(
            losses.iter().all(|l| l.is_finite()),
            "{}: {losses:?}",
            d.name
        );
        let b = (bits(&p), losses);
        match &reference {
            None => reference = Some(b),
            Some(r) => assert!(
                r == &b,
                "{}: stage {stage:?} (offload_param {params_off}) differs",
                d.name
            ),
        }
    }
    let cfg = cfg_for(d, ZeroStage::Stage2, 1);
    let (_, l_dev) = train(&d.be, &cfg, 3).unwrap();
    let (_, l_cpu) = train(&ferrozero_runtime::backend::cpu(), &cfg, 3).unwrap();
    let rel = d.tol().rel.max(1e-4);
    for (a, b) in l_dev.iter().zip(&l_cpu) {
        assert!(
            (a - b).abs() <= rel * b.abs(),
            "{}: losses {l_dev:?} vs CPU {l_cpu:?}",
            d.name
        );
    }
}
test_device!(lamb_offloaded_trains_bitwise_across_stages);

/// The state in the device's memory: the CPU runs LAMB in place (the same bits as offloaded:
/// one host arithmetic); a device without LAMB kernels refuses at build, naming the keys.
fn lamb_in_device_memory_runs_only_where_the_device_has_it(d: &Dev) {
    let off = cfg_for(d, ZeroStage::Stage2, 1);
    let mut in_place = off.clone();
    in_place.zero.offload_optimizer.target = OffloadTarget::None;
    match train(&d.be, &in_place, 2) {
        Ok((p, _)) => {
            assert_eq!(d.name, "cpu", "{}: LAMB ran in device memory", d.name);
            let (q, _) = train(&d.be, &off, 2).unwrap();
            assert!(bits(&p) == bits(&q), "cpu: offload changed LAMB's bits");
        }
        Err(e) => {
            let e = e.to_string();
            assert!(d.name != "cpu", "cpu: {e}");
            assert!(
                e.contains("optimizer.type = \"Lamb\"")
                    && e.contains("offload_optimizer.device = \"cpu\""),
                "{}: {e}",
                d.name
            );
        }
    }
}
test_device!(lamb_in_device_memory_runs_only_where_the_device_has_it);
