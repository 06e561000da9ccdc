//! What the `cuda_driver_gemm*` tests share: logical matrices stored as cuBLASLt reads them,
//! the error bound of a dot product accumulated in any order, and one GEMM checked element by
//! element against an f64 reference computed here, independently of the driver's layout code.
#![allow(dead_code)]

use std::sync::Arc;

use crate::cuda_driver_common::{download, upload, values, S};
use ferrozero_runtime::backend::cuda::driver::{Driver, Gemm, Op};
use ferrozero_runtime::tensor::DType;

/// Stores the logical `rows x cols` matrix `m` (row-major in the test) column-major with
/// leading dimension `ld`, padding filled with NaN so that reading it shows.
pub fn store_col_major(m: &[f32], rows: usize, cols: usize, ld: usize) -> Vec<f32> {
    let mut out = vec![f32::NAN; ld * (cols - 1) + rows];
    for i in 0..rows {
        for j in 0..cols {
            out[i + j * ld] = m[i * cols + j];
        }
    }
    out
}

/// Stores logical op(X) (`r x c`, row-major in the test) as cuBLASLt's X for `op`.
pub fn store_operand(opx: &[f32], r: usize, c: usize, op: Op, ld: usize) -> Vec<f32> {
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
pub fn close(got: f32, want: f64, scale: f64, t: DType) -> bool {
    (f64::from(got) - want).abs() <= tol(want, scale, t)
}

/// [`close`]'s bound.
pub fn tol(want: f64, scale: f64, t: DType) -> f64 {
    ulp(t) * want.abs() + 8.0 * 2f64.powi(-24) * scale + 1e-30
}

/// One unit in the last place of `t`, relative.
pub fn ulp(t: DType) -> f64 {
    match t {
        DType::F32 => 2f64.powi(-23),
        DType::Bf16 => 2f64.powi(-7),
        DType::F16 => 2f64.powi(-10),
    }
}

/// `sum op(A)[i, l] op(B)[l, j]`, and the sum of the terms' magnitudes scaled by `(8 + k) / 8`:
/// with [`close`]'s `8 u`, an error bound of `(8 + k) u sum |terms|` that holds for f32
/// accumulation in any order (cuBLASLt's), not only for the emulator's f64 dot.
pub fn dot_scale(a: impl Fn(usize) -> f32, b: impl Fn(usize) -> f32, k: usize) -> (f64, f64) {
    let (sum, mag) = (0..k).fold((0.0, 0.0), |(s, m), l| {
        let p = f64::from(a(l)) * f64::from(b(l));
        (s + p, m + p.abs())
    });
    (sum, mag * (8 + k) as f64 / 8.0)
}

/// One GEMM of [`check_case`]: the operands' ops, the sizes, the padding of every leading
/// dimension, the types and the scalars.
pub struct Case {
    pub ta: Op,
    pub tb: Op,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub pad: usize,
    pub ab: DType,
    pub c: DType,
    pub alpha: f32,
    pub beta: f32,
}

/// Runs one GEMM through the emulator from logical matrices and checks every element of C
/// against an f64 reference computed here, independently of the driver's layout code.
pub fn check_case(d: &Arc<dyn Driver>, case: &Case, seed: u64) {
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
