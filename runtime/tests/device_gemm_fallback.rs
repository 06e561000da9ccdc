//! A cuBLASLt that has no algorithm for a fused epilogue is not fatal: on an emulated driver that
//! refuses every epilogue (as a real cuBLASLt does when its heuristic returns nothing), each
//! matrix product with a bias, a GELU, a residual or a bias gradient runs as a plain product and
//! the separate kernels, gives the fused product's values within rounding, and is counted as a
//! fallback; a whole GPT-2 training run on that device follows the fused run's losses.

#![cfg(feature = "cuda")]

mod common;
mod device_common;

use std::sync::Arc;
use std::time::Duration;

use common::tiny::{gpt2_model, VOCAB};
use common::{config, toy};
use device_common::{assert_close, get, rand, tol_k, Dev};
use ferrozero_config::resolved::{Precision, ZeroStage};
use ferrozero_runtime::backend::cuda::driver::EmuDriver;
use ferrozero_runtime::backend::cuda::{self, CudaBackend, CudaDevice};
use ferrozero_runtime::backend::Transpose::{No, Yes};
use ferrozero_runtime::backend::{DeviceActivity, Epilogue, MatmulShape, Operand};
use ferrozero_runtime::comm::local::run_ranks;
use ferrozero_runtime::engine::Engine;
use ferrozero_runtime::tensor::DType;

/// Every epilogue the backend asks cuBLASLt for.
const ALL: &[&str] = &[
    "CUBLASLT_EPILOGUE_BIAS",
    "CUBLASLT_EPILOGUE_GELU_AUX_BIAS",
    "CUBLASLT_EPILOGUE_BGRADA",
    "CUBLASLT_EPILOGUE_BGRADB",
    "CUBLASLT_EPILOGUE_DGELU_BGRAD",
];

/// The device with every epilogue on, cuBLASLt's GELU-gradient one included (off by default).
fn fused(act: DType) -> Dev {
    let be = cuda::emulated(act).expect("the emulator");
    let be = Arc::new(be.with_fused_dgelu(true));
    Dev { name: "fused", be }
}

fn refusing(act: DType, epilogues: &[&'static str]) -> Dev {
    let drv = EmuDriver::builtin()
        .expect("the emulator")
        .refusing(epilogues);
    let be = CudaBackend::new(CudaDevice::new(Arc::new(drv), None), act);
    let be = Arc::new(be.with_fused_dgelu(true));
    Dev {
        name: "refusing",
        be,
    }
}

/// The outputs of one product with `epi` on `d`, and the device activity it caused.
type Outputs = (Vec<Vec<f32>>, DeviceActivity);

/// Runs every epilogue kind once on `d` with the same inputs: each case's outputs and activity.
fn every_epilogue(d: &Dev) -> Vec<(&'static str, Outputs)> {
    let (m, n, k) = (24, 16, 40);
    let nn = MatmulShape {
        m,
        n,
        k,
        ta: No,
        tb: No,
    };
    let (a, b) = (d.put(&rand(m * k, 1)), d.put(&rand(k * n, 2)));
    let bias = d.put(&rand(n, 3));
    let residual = d.put(&rand(m * n, 4));
    let pre_in = d.put(&rand(m * n, 5));
    let mut out = Vec::new();
    let mut case = |name: &'static str, f: &mut dyn FnMut() -> Vec<Vec<f32>>| {
        let before = d.be.activity().expect("device activity");
        let vals = f();
        let used = d.be.activity().expect("device activity") - before;
        out.push((name, (vals, used)));
    };
    case("bias", &mut || {
        let mut c = d.zeros(m * n);
        let epi = Epilogue::Bias(bias.view());
        d.be.matmul(nn, a.view(), b.view(), c.view_mut(), epi)
            .unwrap();
        vec![get(&c)]
    });
    case("residual with bias", &mut || {
        let mut c = d.zeros(m * n);
        let epi = Epilogue::Residual {
            residual: residual.view(),
            bias: Some(bias.view()),
        };
        d.be.matmul(nn, a.view(), b.view(), c.view_mut(), epi)
            .unwrap();
        vec![get(&c)]
    });
    case("bias and GELU", &mut || {
        let (mut c, mut pre) = (d.zeros(m * n), d.zeros(m * n));
        let epi = Epilogue::BiasGelu {
            bias: bias.view(),
            pre: pre.view_mut(),
        };
        d.be.matmul(nn, a.view(), b.view(), c.view_mut(), epi)
            .unwrap();
        vec![get(&c), get(&pre)]
    });
    case("GELU backward with bias gradient", &mut || {
        let (mut c, mut db) = (d.zeros(m * n), d.put_f32(&rand(n, 6)));
        let epi = Epilogue::GeluBackwardBiasGrad {
            pre: pre_in.view(),
            bias_grad: db.view_mut(),
        };
        d.be.matmul(nn, a.view(), b.view(), c.view_mut(), epi)
            .unwrap();
        vec![get(&c), get(&db)]
    });
    for of in [Operand::A, Operand::B] {
        let name = if of == Operand::A {
            "bias gradient of A"
        } else {
            "bias gradient of B"
        };
        // The weight gradient: the contraction over rows, the output gradient stored [k, len].
        let s = MatmulShape {
            m,
            n,
            k,
            ta: Yes,
            tb: No,
        };
        let (x, dy) = (d.put(&rand(k * m, 7)), d.put(&rand(k * n, 8)));
        let len = s.bias_grad_len(of).unwrap();
        case(name, &mut || {
            let (mut dw, mut db) = (d.put_f32(&rand(m * n, 9)), d.put_f32(&rand(len, 10)));
            let epi = Epilogue::AccumulateBiasGrad {
                of,
                bias_grad: db.view_mut(),
            };
            d.be.matmul(s, x.view(), dy.view(), dw.view_mut(), epi)
                .unwrap();
            vec![get(&dw), get(&db)]
        });
    }
    out
}

/// Products refused in each case of [`every_epilogue`] when `refused` are: the bias and
/// GELU's product falls back twice when both its fused forms are refused.
fn refusals(case: &str, refused: &[&str]) -> u64 {
    let has = |e: &str| u64::from(refused.contains(&e));
    match case {
        "bias" | "residual with bias" => has("CUBLASLT_EPILOGUE_BIAS"),
        "bias and GELU" => {
            let aux = has("CUBLASLT_EPILOGUE_GELU_AUX_BIAS");
            aux + aux * has("CUBLASLT_EPILOGUE_BIAS")
        }
        "GELU backward with bias gradient" => has("CUBLASLT_EPILOGUE_DGELU_BGRAD"),
        // Our A is cuBLASLt's B (the row-major translation swaps the operands).
        "bias gradient of A" => has("CUBLASLT_EPILOGUE_BGRADB"),
        "bias gradient of B" => has("CUBLASLT_EPILOGUE_BGRADA"),
        other => panic!("unknown case {other}"),
    }
}

/// `refused` epilogues refused: the same values within one more rounding, the refusals
/// counted and each answered by one plain GEMM and more kernels, and nothing refused on the
/// fused device.
fn refused_epilogues_run_apart(act: DType, refused: &'static [&'static str]) {
    let (f, r) = (fused(act), refusing(act, refused));
    let (want, got) = (every_epilogue(&f), every_epilogue(&r));
    for ((name, (w, wa)), (_, (g, ga))) in want.iter().zip(&got) {
        let n = refusals(name, refused);
        assert_eq!(
            wa.gemm_fallbacks, 0,
            "{name}: the fused device fell back: {wa:?}"
        );
        assert_eq!(ga.gemm_fallbacks, n, "{name}: refused products: {ga:?}");
        assert_eq!(ga.gemms, 1, "{name}: one product either way: {ga:?}");
        if n > 0 {
            assert!(
                ga.kernel_launches > wa.kernel_launches,
                "{name}: the epilogue's work runs as kernels: fused {wa:?}, apart {ga:?}"
            );
        }
        for (i, (g, w)) in g.iter().zip(w).enumerate() {
            // One extra rounding of the product before the epilogue's arithmetic.
            let mut tol = tol_k(&f, 40);
            tol.abs *= 2.0;
            assert_close(&format!("{act:?} {name}, output {i}"), g, w, tol);
        }
    }
}

#[test]
fn refused_epilogues_run_apart_f32() {
    refused_epilogues_run_apart(DType::F32, ALL);
}

#[test]
fn refused_epilogues_run_apart_bf16() {
    refused_epilogues_run_apart(DType::Bf16, ALL);
}

/// The two epilogues with aux outputs refused, the rest fused: only those fall back.
#[test]
fn only_the_refused_epilogues_run_apart() {
    const AUX: &[&str] = &[
        "CUBLASLT_EPILOGUE_GELU_AUX_BIAS",
        "CUBLASLT_EPILOGUE_DGELU_BGRAD",
    ];
    refused_epilogues_run_apart(DType::Bf16, AUX);
}

/// The losses and gradient norms of a bf16 GPT-2 trained on the device, with `refused`
/// epilogues refused, and the gemm fallbacks of its last step.
fn train(refused: &'static [&'static str]) -> (Vec<(f64, f64)>, u64) {
    let cfg = config(ZeroStage::Stage3, 1, 1, 2, Precision::Bf16);
    let out = run_ranks(1, Duration::from_secs(300), |comm| {
        let dev = refusing(DType::Bf16, refused);
        let mut e = Engine::with_backend(gpt2_model(2), cfg.clone(), comm, dev.be.clone())?;
        let (mut curve, mut fallbacks) = (Vec::new(), 0);
        for s in 0..4 {
            let batches: Vec<_> = (0..2).map(|m| toy::batch(VOCAB, 8, s * 2 + m, 1)).collect();
            let r = e.train_batch(&batches)?;
            curve.push((r.loss, r.grad_norm));
            fallbacks = r.device_activity.map_or(0, |a| a.gemm_fallbacks);
        }
        Ok((curve, fallbacks))
    })
    .expect("training on the emulated device");
    out.into_iter().next().expect("rank 0")
}

/// Training never fails for a refused epilogue, and follows the fused run.
#[test]
fn training_survives_a_cublaslt_that_refuses_every_epilogue() {
    let (fused, none) = train(&[]);
    let (apart, fallbacks) = train(ALL);
    assert_eq!(none, 0, "no refusal, no fallback");
    assert!(fallbacks > 0, "the refusing device fell back: {fallbacks}");
    for (s, ((fl, fg), (al, ag))) in fused.iter().zip(&apart).enumerate() {
        assert!(
            (fl - al).abs() <= 2e-2 * fl.abs() && (fg - ag).abs() <= 5e-2 * fg.abs().max(1e-3),
            "step {s}: fused loss {fl} norm {fg}, apart loss {al} norm {ag}"
        );
    }
}
