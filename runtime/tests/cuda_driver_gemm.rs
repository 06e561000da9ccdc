//! GEMMs on the emulated driver compute what cuBLASLt defines: layouts, transposes, strided
//! batches, epilogues, and cuBLASLt's refusals.
#![cfg(feature = "cuda")]

mod cuda_driver_common;

use std::sync::Arc;

use cuda_driver_common::{device_err, download, emu, invalid, on_real_device, upload, values, S};
use ferrozero_runtime::backend::cuda::driver::{Batch, Driver, Epilogue, Gemm, Op};
use ferrozero_runtime::tensor::DType;

// ---------------------------------------------------------------------------------------------
// GEMM: the emulator computes what cuBLASLt defines.

/// Stores the logical `rows x cols` matrix `m` (row-major in the test) column-major with
/// leading dimension `ld`, padding filled with NaN so that reading it shows.
fn store_col_major(m: &[f32], rows: usize, cols: usize, ld: usize) -> Vec<f32> {
    let mut out = vec![f32::NAN; ld * (cols - 1) + rows];
    for i in 0..rows {
        for j in 0..cols {
            out[i + j * ld] = m[i * cols + j];
        }
    }
    out
}

/// Stores logical op(X) (`r x c`, row-major in the test) as cuBLASLt's X for `op`.
fn store_operand(opx: &[f32], r: usize, c: usize, op: Op, ld: usize) -> Vec<f32> {
    match op {
        Op::N => store_col_major(opx, r, c, ld),
        Op::T => {
            let mut t = vec![0f32; r * c];
            for i in 0..r {
                for j in 0..c {
                    t[j * r + i] = opx[i * c + j];
                }
            }
            store_col_major(&t, c, r, ld)
        }
    }
}

/// Whether `got` is `want` rounded to `t`, within one unit in the last place of `t`, plus the
/// f32 rounding of the terms (`scale`: the sum of their magnitudes) that both cuBLASLt (in f32,
/// in an unspecified order) and the emulator (f64 dot, f32 scaling) incur.
fn close(got: f32, want: f64, scale: f64, t: DType) -> bool {
    (f64::from(got) - want).abs() <= tol(want, scale, t)
}

/// [`close`]'s bound.
fn tol(want: f64, scale: f64, t: DType) -> f64 {
    ulp(t) * want.abs() + 8.0 * 2f64.powi(-24) * scale + 1e-30
}

/// One unit in the last place of `t`, relative.
fn ulp(t: DType) -> f64 {
    match t {
        DType::F32 => 2f64.powi(-23),
        DType::Bf16 => 2f64.powi(-7),
        DType::F16 => 2f64.powi(-10),
    }
}

/// `sum op(A)[i, l] op(B)[l, j]`, and the sum of the terms' magnitudes scaled by `(8 + k) / 8`:
/// with [`close`]'s `8 u`, an error bound of `(8 + k) u sum |terms|` that holds for f32
/// accumulation in any order (cuBLASLt's), not only for the emulator's f64 dot.
fn dot_scale(a: impl Fn(usize) -> f32, b: impl Fn(usize) -> f32, k: usize) -> (f64, f64) {
    let (sum, mag) = (0..k).fold((0.0, 0.0), |(s, m), l| {
        let p = f64::from(a(l)) * f64::from(b(l));
        (s + p, m + p.abs())
    });
    (sum, mag * (8 + k) as f64 / 8.0)
}

struct Case {
    ta: Op,
    tb: Op,
    m: usize,
    n: usize,
    k: usize,
    pad: usize,
    ab: DType,
    c: DType,
    alpha: f32,
    beta: f32,
}

/// Runs one GEMM through the emulator from logical matrices and checks every element of C
/// against an f64 reference computed here, independently of the driver's layout code.
fn check_case(d: &Arc<dyn Driver>, case: &Case, seed: u64) {
    let Case {
        ta,
        tb,
        m,
        n,
        k,
        pad,
        ab,
        c: ct,
        alpha,
        beta,
    } = *case;
    let opa = values(m * k, seed, ab);
    let opb = values(k * n, seed + 1, ab);
    let c0 = values(m * n, seed + 2, ct);
    let (a_rows, b_rows) = (
        if ta == Op::N { m } else { k },
        if tb == Op::N { k } else { n },
    );
    let (lda, ldb, ldc) = (a_rows + pad, b_rows + pad, m + pad);
    let a = upload(d, &store_operand(&opa, m, k, ta, lda), ab);
    let b = upload(d, &store_operand(&opb, k, n, tb, ldb), ab);
    // With beta = 0 C starts as NaN: cuBLASLt does not read it then.
    let c_init = if beta == 0.0 {
        vec![f32::NAN; m * n]
    } else {
        c0.clone()
    };
    let c = upload(d, &store_col_major(&c_init, m, n, ldc), ct);
    let mut g = Gemm::new(
        ta, tb, m as u64, n as u64, k as u64, a, lda as u64, b, ldb as u64, c, ldc as u64, ab,
    );
    g.c_type = ct;
    g.alpha = alpha;
    g.beta = beta;
    d.gemm(&g, S).unwrap();
    let out = download(d, c, ldc * (n - 1) + m, ct);
    for i in 0..m {
        for j in 0..n {
            let (dot, scale) = dot_scale(|l| opa[i * k + l], |l| opb[l * n + j], k);
            let old = if beta != 0.0 {
                f64::from(beta) * f64::from(c0[i * n + j])
            } else {
                0.0
            };
            let want = f64::from(alpha) * dot + old;
            let scale = f64::from(alpha.abs()) * scale + old.abs();
            let got = out[i + j * ldc];
            // With a bf16/f16 C and beta != 0, cuBLASLt may round alpha * op(A) op(B) to C's
            // type before adding beta * C (seen on an H100, cuBLASLt 13.1: 1.5 ulp off at k = 2):
            // one more rounding of each term. The emulator rounds once.
            let rounded_terms = if beta != 0.0 && ct != DType::F32 {
                ulp(ct) * (f64::from(alpha) * dot).abs() + ulp(ct) * old.abs()
            } else {
                0.0
            };
            assert!(
                (f64::from(got) - want).abs() <= tol(want, scale, ct) + rounded_terms,
                "{} at ({i}, {j}): got {got}, want {want}",
                g.describe()
            );
        }
    }
    // Padding rows of C are never written.
    for j in 0..n - 1 {
        for p in m..ldc {
            assert!(out[p + j * ldc].is_nan(), "padding of C written");
        }
    }
    for p in [a, b, c] {
        unsafe { d.free(p) }.unwrap();
    }
}

fn gemm_reads_operands_through_cublaslt_layouts(d: &Arc<dyn Driver>) {
    let base_allocated = d.allocated();
    let mut seed = 1;
    for (ab, ct) in [
        (DType::F32, DType::F32),
        (DType::Bf16, DType::Bf16),
        (DType::Bf16, DType::F32),
        (DType::F16, DType::F16),
        (DType::F16, DType::F32),
    ] {
        for ta in [Op::N, Op::T] {
            for tb in [Op::N, Op::T] {
                for (m, n, k, pad) in [(5, 3, 7, 0), (17, 9, 33, 3), (1, 1, 1, 0), (4, 13, 2, 8)] {
                    for (alpha, beta) in [(1.0, 0.0), (0.5, 1.0), (-2.0, 0.25)] {
                        let case = Case {
                            ta,
                            tb,
                            m,
                            n,
                            k,
                            pad,
                            ab,
                            c: ct,
                            alpha,
                            beta,
                        };
                        check_case(d, &case, seed);
                        seed += 10;
                    }
                }
            }
        }
    }
    assert_eq!(d.allocated(), base_allocated);
}

fn gemm_large_matches_reference(d: &Arc<dyn Driver>) {
    let case = Case {
        ta: Op::T,
        tb: Op::N,
        m: 70,
        n: 65,
        k: 129,
        pad: 1,
        ab: DType::Bf16,
        c: DType::F32,
        alpha: 1.0,
        beta: 1.0,
    };
    check_case(d, &case, 99);
}

/// The linear layer `Y[M, N] = X[M, K] · W[N, K]^T + bias[N]` with row-major buffers, through
/// the translation the module documentation gives (m = N, n = M, k = K, A = W with op T).
fn gemm_row_major_linear_layer_translation(d: &Arc<dyn Driver>) {
    let (mm, nn, kk) = (6usize, 5usize, 7usize);
    let x = values(mm * kk, 3, DType::F32);
    let w = values(nn * kk, 4, DType::F32);
    let bias = values(nn, 5, DType::F32);
    let (xp, wp, bp) = (
        upload(d, &x, DType::F32),
        upload(d, &w, DType::F32),
        upload(d, &bias, DType::F32),
    );
    let yp = d.malloc(mm * nn * 4).unwrap();
    let mut g = Gemm::new(
        Op::T,
        Op::N,
        nn as u64,
        mm as u64,
        kk as u64,
        wp,
        kk as u64,
        xp,
        kk as u64,
        yp,
        nn as u64,
        DType::F32,
    );
    g.epilogue = Epilogue::Bias { bias: bp };
    d.gemm(&g, S).unwrap();
    let y = download(d, yp, mm * nn, DType::F32);
    for r in 0..mm {
        for c in 0..nn {
            let (dot, scale) = dot_scale(|l| x[r * kk + l], |l| w[c * kk + l], kk);
            let want = dot + f64::from(bias[c]);
            let scale = scale + f64::from(bias[c].abs());
            assert!(close(y[r * nn + c], want, scale, DType::F32), "Y[{r}, {c}]");
        }
    }

    // The classic mistake, reading row-major X as if it were column-major M x K (m = M,
    // lda = M), computes something else: the emulator gives different numbers, as the GPU
    // would.
    let mut wrong = Gemm::new(
        Op::N,
        Op::N,
        mm as u64,
        nn as u64,
        kk as u64,
        xp,
        mm as u64,
        wp,
        kk as u64,
        yp,
        mm as u64,
        DType::F32,
    );
    wrong.epilogue = Epilogue::None;
    d.gemm(&wrong, S).unwrap();
    let y2 = download(d, yp, mm * nn, DType::F32);
    assert_ne!(y, y2);
}

fn gemm_strided_batch_with_a_shared_operand(d: &Arc<dyn Driver>) {
    let (m, n, k, count) = (3usize, 4usize, 5usize, 3usize);
    let t = DType::Bf16;
    let a_all = values(m * k * count, 11, t); // col-major m x k per product, contiguous
    let b = values(k * n, 12, t); // shared: stride 0
    let (ap, bp) = (upload(d, &a_all, t), upload(d, &b, t));
    let stride_c = m * n + 2; // a gap between outputs
    let cp = upload(d, &vec![f32::NAN; stride_c * count], DType::F32);
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
    g.c_type = DType::F32;
    g.batch = Some(Batch {
        count: count as u32,
        stride_a: (m * k) as u64,
        stride_b: 0,
        stride_c: stride_c as u64,
    });
    d.gemm(&g, S).unwrap();
    let c = download(d, cp, stride_c * count, DType::F32);
    for p in 0..count {
        for i in 0..m {
            for j in 0..n {
                let (want, scale) =
                    dot_scale(|l| a_all[p * m * k + i + l * m], |l| b[l + j * k], k);
                assert!(close(c[p * stride_c + i + j * m], want, scale, DType::F32));
            }
        }
        // The gap between products is never written.
        assert!(c[p * stride_c + m * n].is_nan() && c[p * stride_c + m * n + 1].is_nan());
    }
}

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
        let rel = if t == DType::F32 { 1e-5 } else { 1e-2 };
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

/// Out of place (`Gemm::d`): D = A·B + beta·C + bias with C only read, as cuBLASLt's separate
/// C and D pointers; a D overlapping C is refused.
fn gemm_out_of_place_reads_c_writes_d(d: &Arc<dyn Driver>) {
    let t = DType::F32;
    let (m, n, k) = (4usize, 3usize, 5usize);
    // Small integers: every sum is exact, whatever the order.
    let a: Vec<f32> = (0..m * k).map(|i| (i % 5) as f32 - 2.0).collect();
    let b: Vec<f32> = (0..k * n).map(|i| (i % 3) as f32 - 1.0).collect();
    let c: Vec<f32> = (0..m * n).map(|i| i as f32).collect();
    let bias = [1.0f32, -2.0, 3.0, 0.5];
    let (ap, bp, cp) = (upload(d, &a, t), upload(d, &b, t), upload(d, &c, t));
    let (biasp, dp) = (upload(d, &bias, t), upload(d, &vec![7.0; m * n], t));
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
    (g.beta, g.d) = (1.0, Some(dp));
    g.epilogue = Epilogue::Bias { bias: biasp };
    d.gemm(&g, S).unwrap();
    let got = download(d, dp, m * n, t);
    for j in 0..n {
        for i in 0..m {
            let dot: f32 = (0..k).map(|l| a[i + l * m] * b[l + j * k]).sum();
            let want = dot + c[i + j * m] + bias[i];
            assert_eq!(got[i + j * m], want, "D[{i}, {j}]");
        }
    }
    assert_eq!(download(d, cp, m * n, t), c, "C is only read");
    let msg = invalid(d.gemm(
        &Gemm {
            d: Some(cp.offset(4)),
            ..g
        },
        S,
    ));
    assert!(
        msg.contains("output D") && msg.contains("overlaps C"),
        "{msg}"
    );
}

fn gemm_rejects_what_cublaslt_would(d: &Arc<dyn Driver>) {
    let t = DType::F32;
    let a = upload(d, &vec![1.0; 64], t);
    let b = upload(d, &vec![1.0; 64], t);
    let c = upload(d, &vec![0.0; 64], t);
    let base = Gemm::new(Op::N, Op::N, 4, 4, 4, a, 4, b, 4, c, 4, t);
    d.gemm(&base, S).unwrap();

    let msg = invalid(d.gemm(&Gemm { m: 0, ..base }, S));
    assert!(msg.contains("at least 1"), "{msg}");
    let msg = invalid(d.gemm(&Gemm { lda: 3, ..base }, S));
    assert!(
        msg.contains("lda 3 is less than A's stored rows 4"),
        "{msg}"
    );
    let msg = invalid(d.gemm(&Gemm { ldc: 2, ..base }, S));
    assert!(msg.contains("ldc"), "{msg}");
    let msg = invalid(d.gemm(
        &Gemm {
            b_type: DType::Bf16,
            ..base
        },
        S,
    ));
    assert!(msg.contains("same type"), "{msg}");
    let msg = invalid(d.gemm(
        &Gemm {
            c_type: DType::Bf16,
            ..base
        },
        S,
    ));
    assert!(msg.contains("C must be f32 or f32"), "{msg}");
    let msg = invalid(d.gemm(
        &Gemm {
            a: a.offset(2),
            ..base
        },
        S,
    ));
    assert!(msg.contains("not aligned"), "{msg}");
    let msg = invalid(d.gemm(
        &Gemm {
            c: a.offset(16),
            ..base
        },
        S,
    ));
    assert!(msg.contains("overlaps"), "{msg}");
    let msg = invalid(d.gemm(
        &Gemm {
            epilogue: Epilogue::BiasGradB {
                bias_grad: c.offset(128),
            },
            ..base
        },
        S,
    ));
    assert!(msg.contains("only with transb = T"), "{msg}");
    let msg = invalid(d.gemm(
        &Gemm {
            epilogue: Epilogue::BiasGradA {
                bias_grad: c.offset(128),
            },
            alpha: 2.0,
            ..base
        },
        S,
    ));
    assert!(msg.contains("alpha = 1"), "{msg}");
    let msg = invalid(d.gemm(
        &Gemm {
            epilogue: Epilogue::GeluAuxBias {
                bias: c.offset(192),
                aux: c.offset(64),
                aux_ld: 4,
            },
            ..base
        },
        S,
    ));
    assert!(msg.contains("multiple of 8"), "{msg}");
    let msg = invalid(d.gemm(
        &Gemm {
            epilogue: Epilogue::GeluAuxBias {
                bias: c.offset(192),
                aux: c.offset(72),
                aux_ld: 8,
            },
            ..base
        },
        S,
    ));
    assert!(msg.contains("16-byte aligned"), "{msg}");
    let dgelu = Epilogue::DGeluBiasGrad {
        aux: c.offset(64),
        aux_ld: 8,
        bias_grad: c.offset(192),
    };
    let msg = invalid(d.gemm(
        &Gemm {
            epilogue: dgelu,
            beta: 1.0,
            ..base
        },
        S,
    ));
    assert!(msg.contains("alpha = 1 and beta = 0"), "{msg}");
    let msg = invalid(d.gemm(
        &Gemm {
            epilogue: Epilogue::DGeluBiasGrad {
                aux: c.offset(64),
                aux_ld: 4,
                bias_grad: c.offset(192),
            },
            ..base
        },
        S,
    ));
    assert!(msg.contains("CUBLASLT_EPILOGUE_DGELU_BGRAD"), "{msg}");
    assert!(msg.contains("multiple of 8"), "{msg}");
    let msg = invalid(d.gemm(
        &Gemm {
            epilogue: Epilogue::DGeluBiasGrad {
                aux: c.offset(64),
                aux_ld: 8,
                bias_grad: c.offset(68),
            },
            ..base
        },
        S,
    ));
    assert!(msg.contains("output bias_grad"), "{msg}");
    let msg = invalid(d.gemm(
        &Gemm {
            batch: Some(Batch {
                count: 2,
                stride_a: 0,
                stride_b: 0,
                stride_c: 8,
            }),
            ..base
        },
        S,
    ));
    assert!(msg.contains("overlap"), "{msg}");

    // Valid shapes whose extent leaves the allocation: a device error naming the operand, as
    // the emulator's stand-in for the GPU's illegal address.
    let (op, detail) = device_err(d.gemm(&Gemm { ldb: 21, ..base }, S));
    assert_eq!(op, "cublasLtMatmul");
    assert!(
        detail.starts_with("CUDA_ERROR_INVALID_VALUE: B "),
        "{detail}"
    );
    let (op, detail) = device_err(d.gemm(
        &Gemm {
            batch: Some(Batch {
                count: 5,
                stride_a: 16,
                stride_b: 0,
                stride_c: 16,
            }),
            ..base
        },
        S,
    ));
    assert_eq!(op, "cublasLtMatmul");
    assert!(detail.contains("past the end"), "{detail}");
    unsafe { d.free(a) }.unwrap();
    let (_, detail) = device_err(d.gemm(&base, S));
    assert!(detail.contains("freed"), "{detail}");
}

// The shared checks on the emulator.

#[test]
fn emulated_gemm_reads_operands_through_cublaslt_layouts() {
    gemm_reads_operands_through_cublaslt_layouts(&emu());
}

#[test]
fn emulated_gemm_large_matches_reference() {
    gemm_large_matches_reference(&emu());
}

#[test]
fn emulated_gemm_row_major_linear_layer_translation() {
    gemm_row_major_linear_layer_translation(&emu());
}

#[test]
fn emulated_gemm_strided_batch_with_a_shared_operand() {
    gemm_strided_batch_with_a_shared_operand(&emu());
}

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
fn emulated_gemm_rejects_what_cublaslt_would() {
    gemm_rejects_what_cublaslt_would(&emu());
}

#[test]
fn emulated_gemm_out_of_place_reads_c_writes_d() {
    gemm_out_of_place_reads_c_writes_d(&emu());
}

#[test]
fn real_device_passes_the_gemm_checks() {
    on_real_device(&[
        (
            "gemm_out_of_place_reads_c_writes_d",
            gemm_out_of_place_reads_c_writes_d,
        ),
        (
            "gemm_reads_operands_through_cublaslt_layouts",
            gemm_reads_operands_through_cublaslt_layouts,
        ),
        ("gemm_large_matches_reference", gemm_large_matches_reference),
        (
            "gemm_row_major_linear_layer_translation",
            gemm_row_major_linear_layer_translation,
        ),
        (
            "gemm_strided_batch_with_a_shared_operand",
            gemm_strided_batch_with_a_shared_operand,
        ),
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
        (
            "gemm_rejects_what_cublaslt_would",
            gemm_rejects_what_cublaslt_would,
        ),
    ]);
}
