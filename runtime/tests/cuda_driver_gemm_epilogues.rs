//! GEMM epilogues on the emulated driver compute what cuBLASLt documents: bias, GELU (with its
//! aux output), DGELU_BGRAD and the bias gradients BGRADA/BGRADB into f32.
#![cfg(feature = "cuda")]

mod cuda_driver_common;
mod cuda_driver_gemm_common;

use std::sync::Arc;

use cuda_driver_common::{download, emu, on_real_device, upload, values, S};
use cuda_driver_gemm_common::{close, dot_scale};
use ferrozero_runtime::backend::cuda::driver::{Driver, Epilogue, Gemm, Op};
use ferrozero_runtime::tensor::DType;

fn gelu(x: f64) -> f64 {
    0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())
}

fn gemm_epilogues_as_cublaslt_documents_them(d: &Arc<dyn Driver>) {
    let (m, n, k) = (6usize, 4usize, 9usize);
    for t in [DType::F32, DType::Bf16] {
        let a = values(m * k, 21, t); // N: m x k col-major, lda = m
        let b = values(k * n, 22, t); // N: k x n, ldb = k
        let bias = values(m, 23, t);
        let (ap, bp, biasp) = (upload(d, &a, t), upload(d, &b, t), upload(d, &bias, t));
        let aux_ld = 8usize;
        let auxp = upload(d, &vec![f32::NAN; aux_ld * n], t);
        let cp = upload(d, &vec![f32::NAN; m * n], t);
        let dot = |i: usize, j: usize| dot_scale(|l| a[i + l * m], |l| b[l + j * k], k);
        let mut g = Gemm::new(
            Op::N,
            Op::N,
            m as u64,
            n as u64,
            k as u64,
            ap,
            m as u64,
            bp,
            k as u64,
            cp,
            m as u64,
            t,
        );

        // Bias: added to every column.
        g.epilogue = Epilogue::Bias { bias: biasp };
        d.gemm(&g, S).unwrap();
        let c = download(d, cp, m * n, t);
        for i in 0..m {
            for j in 0..n {
                let (dot, scale) = dot(i, j);
                let bias = f64::from(bias[i]);
                assert!(close(c[i + j * m], dot + bias, scale + bias.abs(), t));
            }
        }

        // GELU_AUX_BIAS: aux keeps the pre-activation, C gets GELU of it.
        g.epilogue = Epilogue::GeluAuxBias {
            bias: biasp,
            aux: auxp,
            aux_ld: aux_ld as u64,
        };
        d.gemm(&g, S).unwrap();
        let c = download(d, cp, m * n, t);
        let aux = download(d, auxp, aux_ld * n, t);
        for i in 0..m {
            for j in 0..n {
                let (dot, scale) = dot(i, j);
                let pre = dot + f64::from(bias[i]);
                let scale = scale + f64::from(bias[i].abs());
                assert!(close(aux[i + j * aux_ld], pre, scale, t), "aux ({i}, {j})");
                let tol = if t == DType::F32 { 1e-5 } else { 1e-2 };
                let got = f64::from(c[i + j * m]);
                assert!(
                    (got - gelu(pre)).abs() <= tol * (1.0 + scale),
                    "gelu ({i}, {j})"
                );
            }
            // aux padding rows stay untouched.
            assert!(aux[m + 1].is_nan());
        }

        // BGRADA (transa = N): bias_grad[i] = sum over k of A[i, l]; the product as usual.
        let gradp = upload(d, &vec![f32::NAN; m.max(n)], t);
        g.epilogue = Epilogue::BiasGradA { bias_grad: gradp };
        d.gemm(&g, S).unwrap();
        let grad = download(d, gradp, m, t);
        for i in 0..m {
            let (want, scale) = dot_scale(|l| a[i + l * m], |_| 1.0, k);
            assert!(close(grad[i], want, scale, t), "BGRADA[{i}]");
        }
        let c = download(d, cp, m * n, t);
        let (dot00, scale00) = dot(0, 0);
        assert!(close(c[0], dot00, scale00, t));

        // BGRADB (transb = T): B stored n x k, bias_grad[j] = sum over k of op(B)[l, j].
        let bt = values(n * k, 24, t);
        let btp = upload(d, &bt, t);
        let mut g2 = g;
        g2.transb = Op::T;
        g2.b = btp;
        g2.ldb = n as u64;
        g2.epilogue = Epilogue::BiasGradB { bias_grad: gradp };
        d.gemm(&g2, S).unwrap();
        let grad = download(d, gradp, n, t);
        for j in 0..n {
            let (want, scale) = dot_scale(|l| bt[j + l * n], |_| 1.0, k);
            assert!(close(grad[j], want, scale, t), "BGRADB[{j}]");
        }
    }
}

fn gelu_grad(x: f64) -> f64 {
    let s = (2.0 / std::f64::consts::PI).sqrt();
    let t = (s * (x + 0.044715 * x * x * x)).tanh();
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * s * (1.0 + 3.0 * 0.044715 * x * x)
}

/// DGELU_BGRAD as a GPT-2 MLP's backward uses it: A (fc2's weight) transposed, B the output
/// gradient; D is the product times gelu'(aux) and the bias gradient its row sums.
fn gemm_dgelu_bgrad_as_cublaslt_documents_it(d: &Arc<dyn Driver>) {
    let (m, n, k) = (12usize, 5usize, 7usize);
    for t in [DType::F32, DType::Bf16] {
        let at = values(k * m, 31, t); // T: stored k x m, lda = k
        let b = values(k * n, 32, t); // N: k x n, ldb = k
        let aux_ld = 16usize;
        let pre = values(aux_ld * n, 33, t);
        let (ap, bp, auxp) = (upload(d, &at, t), upload(d, &b, t), upload(d, &pre, t));
        let cp = upload(d, &vec![f32::NAN; m * n], t);
        let gradp = upload(d, &vec![f32::NAN; m], t);
        let mut g = Gemm::new(
            Op::T,
            Op::N,
            m as u64,
            n as u64,
            k as u64,
            ap,
            k as u64,
            bp,
            k as u64,
            cp,
            m as u64,
            t,
        );
        g.epilogue = Epilogue::DGeluBiasGrad {
            aux: auxp,
            aux_ld: aux_ld as u64,
            bias_grad: gradp,
        };
        d.gemm(&g, S).unwrap();
        let (c, grad) = (download(d, cp, m * n, t), download(d, gradp, m, t));
        // cuBLASLt's GELU derivative is not f32-exact: 13.1 on an H200 was 5.4e-5 off (relative)
        // where the emulator's accurate tanh is within 1e-6.
        let rel = if t == DType::F32 { 2e-4 } else { 1e-2 };
        for i in 0..m {
            let (mut sum, mut mag) = (0.0, 0.0);
            for j in 0..n {
                let (dot, scale) = dot_scale(|l| at[l + i * k], |l| b[l + j * k], k);
                let dg = gelu_grad(f64::from(pre[i + j * aux_ld]));
                let want = dot * dg;
                let got = f64::from(c[i + j * m]);
                let bound = rel * (1.0 + scale * dg.abs());
                assert!((got - want).abs() <= bound, "D ({i}, {j}): {got} vs {want}");
                sum += want;
                mag += scale * dg.abs();
            }
            let got = f64::from(grad[i]);
            let bound = rel * (1.0 + mag);
            assert!((got - sum).abs() <= bound, "bias_grad[{i}]: {got} vs {sum}");
        }
        // aux is read, never written.
        assert_eq!(download(d, auxp, aux_ld * n, t), pre);
    }
}

/// BGRADA and BGRADB as a linear layer's weight gradient uses them: bf16 inputs, an f32 C
/// accumulated (beta = 1), transa = N and transb = T; the f32 bias gradient is the sum over
/// k of the reduced operand, overwritten.
fn gemm_weight_grad_bias_grads_into_f32(d: &Arc<dyn Driver>) {
    let (m, n, k) = (16usize, 8usize, 40usize);
    let t = DType::Bf16;
    let a = values(m * k, 41, t); // N: m x k, lda = m
    let bt = values(n * k, 42, t); // T: stored n x k, ldb = n
    let c0 = values(m * n, 43, DType::F32);
    let (ap, bp) = (upload(d, &a, t), upload(d, &bt, t));
    let gradp = upload(d, &vec![f32::NAN; m], DType::F32);
    for bgrad_of_a in [true, false] {
        let cp = upload(d, &c0, DType::F32);
        let mut g = Gemm::new(
            Op::N,
            Op::T,
            m as u64,
            n as u64,
            k as u64,
            ap,
            m as u64,
            bp,
            n as u64,
            cp,
            m as u64,
            t,
        );
        (g.c_type, g.beta) = (DType::F32, 1.0);
        g.epilogue = if bgrad_of_a {
            Epilogue::BiasGradA { bias_grad: gradp }
        } else {
            Epilogue::BiasGradB { bias_grad: gradp }
        };
        d.gemm(&g, S).unwrap();
        let c = download(d, cp, m * n, DType::F32);
        for i in 0..m {
            for j in 0..n {
                let (dot, scale) = dot_scale(|l| a[i + l * m], |l| bt[j + l * n], k);
                let want = dot + f64::from(c0[i + j * m]);
                let scale = scale + f64::from(c0[i + j * m].abs());
                assert!(close(c[i + j * m], want, scale, DType::F32), "C ({i}, {j})");
            }
        }
        let (len, which) = if bgrad_of_a {
            (m, "BGRADA")
        } else {
            (n, "BGRADB")
        };
        let grad = download(d, gradp, len, DType::F32);
        for (i, &got) in grad.iter().enumerate() {
            let (want, scale) = if bgrad_of_a {
                dot_scale(|l| a[i + l * m], |_| 1.0, k)
            } else {
                dot_scale(|l| bt[i + l * n], |_| 1.0, k)
            };
            assert!(close(got, want, scale, DType::F32), "{which}[{i}]");
        }
    }
}

// The shared checks on the emulator (`real_device_passes_the_gemm_epilogue_checks` runs them on a GPU).

#[test]
fn emulated_gemm_epilogues_as_cublaslt_documents_them() {
    gemm_epilogues_as_cublaslt_documents_them(&emu());
}

#[test]
fn emulated_gemm_dgelu_bgrad_as_cublaslt_documents_it() {
    gemm_dgelu_bgrad_as_cublaslt_documents_it(&emu());
}

#[test]
fn emulated_gemm_weight_grad_bias_grads_into_f32() {
    gemm_weight_grad_bias_grads_into_f32(&emu());
}

#[test]
fn real_device_passes_the_gemm_epilogue_checks() {
    on_real_device(&[
        (
            "gemm_epilogues_as_cublaslt_documents_them",
            gemm_epilogues_as_cublaslt_documents_them,
        ),
        (
            "gemm_dgelu_bgrad_as_cublaslt_documents_it",
            gemm_dgelu_bgrad_as_cublaslt_documents_it,
        ),
        (
            "gemm_weight_grad_bias_grads_into_f32",
            gemm_weight_grad_bias_grads_into_f32,
        ),
    ]);
}
