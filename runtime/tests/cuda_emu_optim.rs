//! ferrozero's CUDA kernels on the CPU emulator of the device: `optim.cu`: the multi-tensor
//! Adam, SGD and Lion steps (gradients in any dtype, a NaN scale skipping the step), bit for
//! bit against the reference optimizers, and `clip_grad_scale` against the host's `ClipRule`.
//! Tolerances and the skip rule: `cuda_emu_common/mod.rs`.

#[macro_use]
mod cuda_emu_common;

use cuda_emu_common::*;
use ferrozero_offload::optim::{
    adam_terms, reference, AdamHyper, LionHyper, LowPrecision, SgdHyper, WeightDecay,
};
use ferrozero_runtime::backend::cuda::kernels::params::OptTensor;
use ferrozero_runtime::backend::ClipRule;
use ferrozero_runtime::tensor::DType;

// ---- optimizers ----------------------------------------------------------------------------

fn addr(a: Arg) -> u64 {
    match a {
        Arg::Ptr(p) => p as usize as u64,
        _ => unreachable!(),
    }
}

#[derive(Clone, Copy, Debug)]
enum Opt {
    Adam(AdamHyper, u64),
    Sgd(SgdHyper, u64),
    Lion(LionHyper),
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Lp {
    None,
    Bf16,
    F16,
}

/// One tensor's state on the host.
#[derive(Clone)]
struct State {
    p: Vec<f32>,
    g: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
    lp_bf: Vec<bf16>,
    lp_h: Vec<f16>,
}

fn reference_step(opt: Opt, gs: f32, s: &mut State, lp: Lp) {
    let lp_out = match lp {
        Lp::None => LowPrecision::None,
        Lp::Bf16 => LowPrecision::Bf16(&mut s.lp_bf),
        Lp::F16 => LowPrecision::F16(&mut s.lp_h),
    };
    match opt {
        Opt::Adam(hp, step) => {
            reference::adam_step(&hp, step, gs, &mut s.p, &s.g, &mut s.m, &mut s.v, lp_out)
        }
        Opt::Sgd(hp, step) => reference::sgd_step(&hp, step, gs, &mut s.p, &s.g, &mut s.m, lp_out),
        Opt::Lion(hp) => reference::lion_step(&hp, gs, &mut s.p, &s.g, &mut s.m, lp_out),
    }
    .expect("reference step");
}

/// The gradients as the device holds them: f32, or rounded to half precision (the
/// reference reads them widened, exactly).
fn grad_values(seed: u64, n: usize, dtype: DType) -> Vec<f32> {
    let g = rand_vec(seed, n, 4.0);
    match dtype {
        DType::F32 => g,
        DType::Bf16 => g.iter().map(|&x| bf16::from_f32(x).to_f32()).collect(),
        DType::F16 => g.iter().map(|&x| f16::from_f32(x).to_f32()).collect(),
    }
}

/// A device copy of gradients in `dtype` (exact: [`grad_values`] are representable).
enum GradBuf {
    F32(Buf<f32>),
    Bf16(Buf<bf16>),
    F16(Buf<f16>),
}

impl GradBuf {
    fn new(g: &[f32], dtype: DType) -> Self {
        match dtype {
            DType::F32 => GradBuf::F32(Buf::from(g)),
            DType::Bf16 => GradBuf::Bf16(Buf::from(
                &g.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>(),
            )),
            DType::F16 => GradBuf::F16(Buf::from(
                &g.iter().map(|&x| f16::from_f32(x)).collect::<Vec<_>>(),
            )),
        }
    }
    fn ptr(&self) -> Arg {
        match self {
            GradBuf::F32(b) => b.ptr(),
            GradBuf::Bf16(b) => b.ptr(),
            GradBuf::F16(b) => b.ptr(),
        }
    }
    fn get(&self) -> Vec<f32> {
        match self {
            GradBuf::F32(b) => b.get(),
            GradBuf::Bf16(b) => b.get().iter().map(|x| x.to_f32()).collect(),
            GradBuf::F16(b) => b.get().iter().map(|x| x.to_f32()).collect(),
        }
    }
}

fn run_optimizer(emu: &Emu, opt: Opt, lp: Lp, chunk: usize) {
    run_optimizer_with(emu, opt, lp, chunk, DType::F32, 0.5);
}

/// One multi-tensor launch over six tensors against the reference, gradients in `gdt`,
/// scale `gs` (NaN: the step is skipped and nothing may change).
fn run_optimizer_with(emu: &Emu, opt: Opt, lp: Lp, chunk: usize, gdt: DType, gs: f32) {
    let lens = [1usize, 7, 1000, 4099, 33, 64];
    let mut states: Vec<State> = lens
        .iter()
        .enumerate()
        .map(|(i, &n)| State {
            p: rand_vec(10 + i as u64, n, 1.0),
            g: grad_values(20 + i as u64, n, gdt),
            m: rand_vec(30 + i as u64, n, 0.1),
            v: rand_vec(40 + i as u64, n, 0.01)
                .iter()
                .map(|v| v.abs())
                .collect(),
            lp_bf: vec![bf16::ZERO; n],
            lp_h: vec![f16::ZERO; n],
        })
        .collect();
    let sgd_without_momentum = matches!(opt, Opt::Sgd(hp, _) if hp.momentum == 0.0);

    // Device copies and descriptors.
    let dev_p: Vec<Buf<f32>> = states.iter().map(|s| Buf::from(&s.p)).collect();
    let dev_g: Vec<GradBuf> = states.iter().map(|s| GradBuf::new(&s.g, gdt)).collect();
    let dev_m: Vec<Buf<f32>> = states.iter().map(|s| Buf::from(&s.m)).collect();
    let dev_v: Vec<Buf<f32>> = states.iter().map(|s| Buf::from(&s.v)).collect();
    let dev_bf: Vec<Buf<bf16>> = states.iter().map(|s| Buf::from(&s.lp_bf)).collect();
    let dev_h: Vec<Buf<f16>> = states.iter().map(|s| Buf::from(&s.lp_h)).collect();
    let mut descs = Vec::new();
    let mut first = 0i64;
    for (i, &n) in lens.iter().enumerate() {
        let lp_addr = match lp {
            Lp::None => 0,
            Lp::Bf16 => addr(dev_bf[i].ptr()),
            Lp::F16 => addr(dev_h[i].ptr()),
        };
        descs.push(OptTensor {
            params: addr(dev_p[i].ptr()),
            grads: addr(dev_g[i].ptr()),
            m: if sgd_without_momentum {
                0
            } else {
                addr(dev_m[i].ptr())
            },
            v: addr(dev_v[i].ptr()),
            lp: lp_addr,
            n: n as i64,
            first_chunk: first,
            grad_dtype: OptTensor::grad_dtype_of(gdt),
        });
        first += n.div_ceil(chunk) as i64;
    }
    let total_chunks = first;
    let desc = Buf::from(&descs);
    let gsb = Buf::from(&[gs]);
    let suffix = match lp {
        Lp::None => "f32",
        Lp::Bf16 => "bf16",
        Lp::F16 => "f16",
    };
    let mut args = vec![
        desc.ptr(),
        Arg::I32(lens.len() as i32),
        Arg::I64(total_chunks),
        Arg::I32(chunk as i32),
    ];
    let kernel = match opt {
        Opt::Adam(hp, step) => {
            let (step_size, bc2_sqrt) = adam_terms(&hp, step).expect("adam terms");
            args.extend([
                Arg::F32(hp.lr),
                Arg::F32(hp.beta1),
                Arg::F32(hp.beta2),
                Arg::F32(hp.eps),
                Arg::F32(hp.weight_decay),
                Arg::I32((hp.decay == WeightDecay::Decoupled) as i32),
                Arg::F32(step_size),
                Arg::F32(bc2_sqrt),
            ]);
            "adam_multi"
        }
        Opt::Sgd(hp, step) => {
            args.extend([
                Arg::F32(hp.lr),
                Arg::F32(hp.momentum),
                Arg::F32(hp.dampening),
                Arg::F32(hp.weight_decay),
                Arg::I32(hp.nesterov as i32),
                Arg::I32((step <= 1) as i32),
            ]);
            "sgd_multi"
        }
        Opt::Lion(hp) => {
            args.extend([
                Arg::F32(hp.lr),
                Arg::F32(hp.beta1),
                Arg::F32(hp.beta2),
                Arg::F32(hp.weight_decay),
            ]);
            "lion_multi"
        }
    };
    args.push(gsb.ptr());
    // Fewer blocks than chunks: blocks stride over chunks.
    emu.run(&format!("{kernel}_{suffix}"), 5, 64, &args);

    for (i, s) in states.iter_mut().enumerate() {
        let before = s.clone();
        if !gs.is_nan() {
            reference_step(opt, gs, s, lp);
        }
        let what = format!(
            "{opt:?} lp={lp:?} chunk={chunk} grads {gdt:?} scale {gs} tensor {i} (n={})",
            lens[i]
        );
        assert_bits(&format!("{what} params"), &dev_p[i].get(), &s.p);
        assert_bits(&format!("{what} m"), &dev_m[i].get(), &s.m);
        assert_bits(&format!("{what} v"), &dev_v[i].get(), &s.v);
        assert_eq!(dev_g[i].get(), before.g, "{what}: gradients are read-only");
        let bf: Vec<u16> = dev_bf[i].get().iter().map(|b| b.to_bits()).collect();
        let h: Vec<u16> = dev_h[i].get().iter().map(|b| b.to_bits()).collect();
        assert_eq!(
            bf,
            s.lp_bf.iter().map(|b| b.to_bits()).collect::<Vec<_>>(),
            "{what} bf16 copy"
        );
        assert_eq!(
            h,
            s.lp_h.iter().map(|b| b.to_bits()).collect::<Vec<_>>(),
            "{what} f16 copy"
        );
    }
}

#[test]
fn optimizers_match_reference_bit_for_bit() {
    let emu = emu_or_skip!();
    let adamw = AdamHyper {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
        decay: WeightDecay::Decoupled,
        bias_correction: true,
    };
    let adam_l2 = AdamHyper {
        decay: WeightDecay::L2,
        weight_decay: 0.1,
        ..adamw
    };
    let adam_plain = AdamHyper {
        bias_correction: false,
        ..adamw
    };
    let sgd = SgdHyper {
        lr: 0.05,
        momentum: 0.9,
        dampening: 0.1,
        weight_decay: 1e-4,
        nesterov: false,
    };
    let lion = LionHyper {
        lr: 1e-4,
        beta1: 0.9,
        beta2: 0.99,
        weight_decay: 0.1,
    };
    let opts = [
        Opt::Adam(adamw, 1),
        Opt::Adam(adamw, 7),
        Opt::Adam(adam_l2, 3),
        Opt::Adam(adam_plain, 2),
        Opt::Sgd(sgd, 1),
        Opt::Sgd(sgd, 5),
        Opt::Sgd(
            SgdHyper {
                nesterov: true,
                dampening: 0.0,
                ..sgd
            },
            4,
        ),
        Opt::Sgd(
            SgdHyper {
                momentum: 0.0,
                ..sgd
            },
            2,
        ),
        Opt::Lion(lion),
    ];
    for opt in opts {
        for lp in [Lp::None, Lp::Bf16, Lp::F16] {
            run_optimizer(emu, opt, lp, 64);
        }
        // A chunk that is not a multiple of 8 (element by element) and a large one.
        run_optimizer(emu, opt, Lp::Bf16, 100);
        run_optimizer(emu, opt, Lp::F16, 1 << 16);
    }
}

#[test]
fn optimizers_read_half_precision_gradients_and_skip_on_a_nan_scale() {
    let emu = emu_or_skip!();
    let adamw = AdamHyper {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
        decay: WeightDecay::Decoupled,
        bias_correction: true,
    };
    let sgd = SgdHyper {
        lr: 0.05,
        momentum: 0.9,
        dampening: 0.1,
        weight_decay: 1e-4,
        nesterov: false,
    };
    let lion = LionHyper {
        lr: 1e-4,
        beta1: 0.9,
        beta2: 0.99,
        weight_decay: 0.1,
    };
    for opt in [Opt::Adam(adamw, 3), Opt::Sgd(sgd, 2), Opt::Lion(lion)] {
        for gdt in [DType::Bf16, DType::F16] {
            run_optimizer_with(emu, opt, Lp::Bf16, 64, gdt, 0.25);
            // Not a multiple of 8: element by element.
            run_optimizer_with(emu, opt, Lp::None, 100, gdt, 0.25);
        }
        for gdt in [DType::F32, DType::Bf16] {
            run_optimizer_with(emu, opt, Lp::Bf16, 64, gdt, f32::NAN);
        }
    }
}

/// `clip_grad_scale` on the device against [`ClipRule::decide`] on the host: the same bits
/// for clipping that binds and does not, no clipping, loss scales, zero and huge sums, and
/// the NaN verdict exactly when the host sees an overflow.
#[test]
fn clip_scale_on_the_device_is_the_hosts() {
    let emu = emu_or_skip!();
    let sums: &[&[f64]] = &[
        &[0.25, 1.5, 1e-3],
        &[3.0e4, 2.0e5, 7.77, 0.0],
        &[1e-12, 3e-13],
        &[-0.0, -0.0],
        &[0.0],
        &[],
        &[1e60, 1e70],
        &[1.0, f64::INFINITY],
        &[f64::NAN, 2.0],
        &[0.999_999_9],
        &[1.000_002],
    ];
    let rules = [
        (1.0, 1.0),
        (1.0, 0.0),
        (256.0, 1.0),
        (65536.0, 0.5),
        (2.0, 1e-3),
    ];
    for s in sums {
        for (loss_scale, clipping) in rules {
            let clip = ClipRule {
                loss_scale,
                clipping,
            };
            let dev_sums = Buf::from(if s.is_empty() { &[0.0f64][..] } else { s });
            let rule = Buf::from(&[loss_scale, clipping]);
            let out = Buf::from(&[0.0f32]);
            let args = [
                dev_sums.ptr(),
                Arg::I32(s.len() as i32),
                rule.ptr(),
                out.ptr(),
            ];
            emu.run("clip_grad_scale", 1, 1, &args);
            let got = out.get()[0];
            let what = format!("sums {s:?}, loss scale {loss_scale}, clipping {clipping}");
            match clip.decide(s) {
                Some(want) => assert_eq!(got.to_bits(), want.to_bits(), "{what}: {got} vs {want}"),
                None => assert!(got.is_nan(), "{what}: an overflow skips, got {got}"),
            }
        }
    }
}
