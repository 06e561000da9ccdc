//! GEMMs on the emulated driver compute what cuBLASLt defines: layouts, transposes, strided
//! batches and separate C and D; `cuda_driver_gemm_epilogues` has the epilogues,
//! `cuda_driver_gemm_refusals` cuBLASLt's refusals.
#![cfg(feature = "cuda")]

mod cuda_driver_common;
mod cuda_driver_gemm_common;

use std::sync::Arc;

use cuda_driver_common::{download, emu, invalid, on_real_device, upload, values, S};
use cuda_driver_gemm_common::{check_case, close, dot_scale, Case};
use ferrozero_runtime::backend::cuda::driver::{Batch, Driver, Epilogue, Gemm, Op};
use ferrozero_runtime::tensor::DType;

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

// The shared checks on the emulator (`real_device_passes_the_gemm_checks` runs them on a GPU).

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
fn emulated_gemm_out_of_place_reads_c_writes_d() {
    gemm_out_of_place_reads_c_writes_d(&emu());
}

#[test]
fn real_device_passes_the_gemm_checks() {
    on_real_device(&[
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
            "gemm_out_of_place_reads_c_writes_d",
            gemm_out_of_place_reads_c_writes_d,
        ),
    ]);
}
