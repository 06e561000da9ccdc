//! LAMB on every device: its two passes on the device equal the CPU's bit for bit (a run of
//! several sum blocks, bf16 gradients and copies); with the state offloaded to the host
//! (`offload_optimizer.device = "cpu"`) or in the device's memory a device trains with it,
//! stages 0-3 bitwise identical (two ranks on one device), offloading changing no bit, close
//! to the CPU's run.

mod common;
mod device_common;

use std::sync::Arc;

use common::runs::{losses, rank0, toy_steps};
use common::{config, lamb};
use device_common::Dev;
use device_common::{get, rand};
use ferrozero_config::resolved::ZeroStage;
use ferrozero_config::resolved::{OffloadTarget, ResolvedConfig};
use ferrozero_offload::optim::{lamb_coeff, LambHyper, SUM_BLOCK};
use ferrozero_runtime::backend::Backend;
use ferrozero_runtime::backend::GradView;
use ferrozero_runtime::engine::{Engine, NamedTensor};
use ferrozero_runtime::nn::Model;
use ferrozero_runtime::tensor::{DType, FlatBuf};

const V: usize = 23;
const T: usize = 6;

fn model() -> Model {
    common::tiny::small_llama(V, T)
}

/// LAMB with the state offloaded to the host; bf16 parameters on a bf16 device.
fn cfg_for(d: &Dev, stage: ZeroStage, world: usize) -> ResolvedConfig {
    let precision = d.training_precision();
    let mut c = config(stage, world, 2, 2, precision);
    c.optimizer = lamb(1e-2);
    c.zero.offload_optimizer.target = OffloadTarget::Cpu;
    c
}

fn train(
    be: &Arc<dyn Backend>,
    cfg: &ResolvedConfig,
    steps: usize,
) -> ferrozero_runtime::Result<(Vec<NamedTensor>, Vec<f64>)> {
    rank0(cfg.world_size, |comm| {
        let rank = comm.rank();
        let mut e = Engine::with_backend(model(), cfg.clone(), comm, be.clone())?;
        let reports = toy_steps(&mut e, cfg, (V, T), steps, rank)?;
        Ok((e.parameters()?, losses(&reports)))
    })
}

use common::runs::named_bits as bits;

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
    device_common::assert_losses_close(d, &l_dev, &l_cpu);
}
test_device!(lamb_offloaded_trains_bitwise_across_stages);

/// The state in the device's memory: the device runs LAMB's kernels, stages 0-3 bitwise at
/// two ranks, and the same bits as the offloaded run (whose passes are the CPU's).
fn lamb_in_device_memory_equals_offloaded(d: &Dev) {
    let mut reference = None;
    for stage in common::STAGES {
        let off = cfg_for(d, stage, 2);
        let mut in_place = off.clone();
        in_place.zero.offload_optimizer.target = OffloadTarget::None;
        let (p, l) = train(&d.be, &in_place, 3).expect("LAMB in device memory trains");
        if stage == ZeroStage::Stage2 {
            let (q, _) = train(&d.be, &off, 3).unwrap();
            assert!(
                bits(&p) == bits(&q),
                "{}: offload changed LAMB's bits",
                d.name
            );
        }
        let b = (bits(&p), l);
        match &reference {
            None => reference = Some(b),
            Some(r) => assert!(r == &b, "{}: stage {stage:?} differs", d.name),
        }
    }
}
test_device!(lamb_in_device_memory_equals_offloaded);

/// Both passes over a run of three sum blocks and a tail, from bf16 gradients read as
/// stored and f32 ones read as a bf16 accumulator, writing a bf16 copy: the device's moments,
/// sums and parameters are the CPU's bits.
fn lamb_passes_equal_the_cpu(d: &Dev) {
    let n = 3 * SUM_BLOCK + 1234;
    let hp = LambHyper {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        eps_inside_sqrt: false,
        weight_decay: 0.01,
        max_coeff: 10.0,
        min_coeff: 0.01,
        bias_correction: true,
    };
    let (w, g) = (rand(n, 1), rand(n, 2));
    let m0 = rand(n, 3);
    let v0: Vec<f32> = rand(n, 4).iter().map(|x| x.abs() * 1e-2).collect();
    let cpu = device_common::cpu();
    let gbf16 = {
        let mut b = FlatBuf::zeros(DType::Bf16, n);
        b.store_f32(0, &g);
        b
    };
    let run = |dev: &Dev, grads_bf16: bool, eps_inside: bool| {
        let hp = LambHyper {
            eps_inside_sqrt: eps_inside,
            ..hp
        };
        let mut p = dev.put_f32(&w);
        let gs = match grads_bf16 {
            true => dev.be.upload(gbf16.as_ref()).unwrap(),
            false => dev.put_f32(&g),
        };
        let (mut m, mut v) = (dev.put_f32(&m0), dev.put_f32(&v0));
        let gv = match grads_bf16 {
            true => GradView::exact(gs.view()),
            false => GradView::rounded(gs.view(), DType::Bf16),
        };
        let sums = dev
            .be
            .lamb_moments(&hp, 0.5, (p.view(), gv), m.view_mut(), v.view_mut())
            .unwrap();
        let mut lp = dev.be.zeros(DType::Bf16, n).unwrap();
        let c = lamb_coeff(&hp, sums.0, sums.1);
        dev.be
            .lamb_apply(
                (&hp, 3, c),
                p.view_mut(),
                (m.view(), v.view()),
                Some(lp.view_mut()),
            )
            .unwrap();
        let out: Vec<Vec<u32>> = [&p, &m, &v, &lp]
            .iter()
            .map(|s| get(s).iter().map(|x| x.to_bits()).collect())
            .collect();
        ((sums.0.to_bits(), sums.1.to_bits()), out)
    };
    for (grads_bf16, eps_inside) in [(true, false), (false, true)] {
        assert!(
            run(d, grads_bf16, eps_inside) == run(&cpu, grads_bf16, eps_inside),
            "{}: LAMB's passes differ from the CPU's (bf16 grads {grads_bf16})",
            d.name
        );
    }
}
test_device!(lamb_passes_equal_the_cpu);
