//! Attention on one device against the CPU backend, shared by `device_ops` (every device of
//! `test_device!`) and `cuda_attention_emu` (the emulated GPU with f16 activations).
//!
//! Tolerances: `Dev::tol` for the output (a convex combination of V rows, rounded once to the
//! activation dtype). The gradients dK and dV sum one term per query row of the group's heads
//! (up to `seq * group` of them), and each term carries the rounding of P or dS to the
//! activation dtype before the tensor-core product (FlashAttention's numerics; the CPU keeps
//! f32): those errors are independent, so they grow like the square root of the number of
//! terms, and the absolute tolerance is scaled by `sqrt(seq * group / 64)` (at least 1). The
//! saved log-sum-exp is checked against an f64 evaluation of the same inputs within 1e-5, since
//! it never goes through a 16-bit rounding.
#![allow(dead_code)]

use crate::device_common::{assert_close, cpu, get, rand, Dev, Tol};
use ferrozero_runtime::backend::{AttentionGrads, AttentionShape, AttnDropout, RowView};
use ferrozero_runtime::tensor::{DType, Storage};

/// One attention layout: GPT-2's fused `[rows, 3C]` qkv (q, k, v thirds, one fused gradient
/// buffer) or Llama's separate q, k, v buffers (split gradients).
#[derive(Debug, Clone, Copy)]
pub struct AttnCase {
    pub batch: usize,
    pub seq: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub fused: bool,
}

impl AttnCase {
    pub fn shape(&self) -> AttentionShape {
        AttentionShape {
            batch: self.batch,
            seq: self.seq,
            q_heads: self.q_heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            dropout: None,
        }
    }

    pub fn rows(&self) -> usize {
        self.batch * self.seq
    }

    /// The q, k, v views and the length of each buffer (one buffer when fused).
    pub fn views(&self) -> ([RowView; 3], [usize; 3]) {
        let (qc, kc) = (self.q_heads * self.head_dim, self.kv_heads * self.head_dim);
        if self.fused {
            let stride = qc + 2 * kc;
            let at = |offset| RowView { stride, offset };
            let len = self.rows() * stride;
            ([at(0), at(qc), at(qc + kc)], [len, len, len])
        } else {
            let (q, kv) = (
                RowView {
                    stride: qc,
                    offset: 0,
                },
                RowView {
                    stride: kc,
                    offset: 0,
                },
            );
            (
                [q, kv, kv],
                [self.rows() * qc, self.rows() * kc, self.rows() * kc],
            )
        }
    }

    /// Deterministic inputs rounded to `d`'s activation dtype: the q/k/v buffer(s) (queries
    /// scaled by 2, so softmax rows are far from uniform) and dO.
    pub fn inputs(&self, d: &Dev, seed: u64) -> (Vec<Vec<f32>>, Vec<f32>) {
        let (_, lens) = self.views();
        let nbufs = if self.fused { 1 } else { 3 };
        let qkv = (0..nbufs)
            .map(|i| {
                let scale = if i == 0 { 2.0 } else { 1.0 };
                let v: Vec<f32> = rand(lens[i], seed + i as u64)
                    .iter()
                    .map(|x| x * scale)
                    .collect();
                d.round(&v)
            })
            .collect();
        let dout = d.round(&rand(self.rows() * self.q_heads * self.head_dim, seed + 7));
        (qkv, dout)
    }
}

/// What one forward and backward produced, as host f32.
pub struct AttnResult {
    pub out: Vec<f32>,
    /// The saved state when it is the log-sum-exp (devices other than the CPU), else empty.
    pub lse: Vec<f32>,
    /// The gradient buffers as they hold them afterwards: the fused one, or dq, dk, dv.
    pub grads: Vec<Vec<f32>>,
}

/// Forward and backward of `case` on `d.be`.
pub fn run(d: &Dev, case: &AttnCase, qkv: &[Vec<f32>], dout: &[f32]) -> AttnResult {
    run_shape(d, case, case.shape(), qkv, dout)
}

/// [`run`] with shape `s` (`case`'s, perhaps with dropout).
fn run_shape(
    d: &Dev,
    case: &AttnCase,
    s: AttentionShape,
    qkv: &[Vec<f32>],
    dout: &[f32],
) -> AttnResult {
    let (views, _) = case.views();
    let bufs: Vec<Storage> = qkv.iter().map(|x| d.put(x)).collect();
    let (qb, kb, vb) = if case.fused {
        (&bufs[0], &bufs[0], &bufs[0])
    } else {
        (&bufs[0], &bufs[1], &bufs[2])
    };
    let mut out = d.zeros(case.rows() * case.q_heads * case.head_dim);
    let saved =
        d.be.attention_forward(
            s,
            (qb.view(), views[0]),
            (kb.view(), views[1]),
            (vb.view(), views[2]),
            out.view_mut(),
        )
        .unwrap();
    let ddout = d.put(dout);
    // Gradient buffers start as garbage: the kernels overwrite every element of their views.
    let mut grads: Vec<Storage> = qkv.iter().map(|x| d.put(&vec![7.0; x.len()])).collect();
    let g = if case.fused {
        AttentionGrads::Fused(grads[0].view_mut())
    } else {
        let (a, rest) = grads.split_at_mut(1);
        let (b, c) = rest.split_at_mut(1);
        AttentionGrads::Split {
            dq: a[0].view_mut(),
            dk: b[0].view_mut(),
            dv: c[0].view_mut(),
        }
    };
    d.be.attention_backward(
        s,
        (qb.view(), views[0]),
        (kb.view(), views[1]),
        (vb.view(), views[2]),
        out.view(),
        &saved,
        ddout.view(),
        g,
    )
    .unwrap();
    let lse = if d.name == "cpu" {
        Vec::new()
    } else {
        get(&saved)
    };
    AttnResult {
        out: get(&out),
        lse,
        grads: grads.iter().map(get).collect(),
    }
}

/// The log-sum-exp of every query row, `[batch][q_heads][seq]`, in f64 from the inputs.
pub fn exact_lse(case: &AttnCase, qkv: &[Vec<f32>]) -> Vec<f32> {
    let (views, _) = case.views();
    let (q, k) = if case.fused {
        (&qkv[0], &qkv[0])
    } else {
        (&qkv[0], &qkv[1])
    };
    let (t, hd) = (case.seq, case.head_dim);
    let scale = 1.0 / (hd as f64).sqrt();
    let mut lse = Vec::new();
    for b in 0..case.batch {
        for h in 0..case.q_heads {
            let kvh = h / (case.q_heads / case.kv_heads);
            for i in 0..t {
                let qi = (b * t + i) * views[0].stride + views[0].offset + h * hd;
                let scores: Vec<f64> = (0..=i)
                    .map(|j| {
                        let kj = (b * t + j) * views[1].stride + views[1].offset + kvh * hd;
                        (0..hd)
                            .map(|e| f64::from(q[qi + e]) * f64::from(k[kj + e]))
                            .sum::<f64>()
                            * scale
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = scores.iter().map(|x| (x - m).exp()).sum();
                lse.push((m + sum.ln()) as f32);
            }
        }
    }
    lse
}

/// The shapes every device runs.
pub const CASES: [AttnCase; 9] = [
    // GPT-2: fused qkv thirds, batch 2, T not a multiple of any tile.
    AttnCase {
        batch: 2,
        seq: 71,
        q_heads: 2,
        kv_heads: 2,
        head_dim: 64,
        fused: true,
    },
    // Llama: split buffers, grouped-query (6 query heads on 2 kv heads).
    AttnCase {
        batch: 2,
        seq: 71,
        q_heads: 6,
        kv_heads: 2,
        head_dim: 64,
        fused: false,
    },
    // Several tiles of keys and queries in flight (the double-buffered pipelines).
    AttnCase {
        batch: 1,
        seq: 150,
        q_heads: 2,
        kv_heads: 1,
        head_dim: 64,
        fused: false,
    },
    // One token.
    AttnCase {
        batch: 2,
        seq: 1,
        q_heads: 3,
        kv_heads: 1,
        head_dim: 64,
        fused: false,
    },
    // An odd head dim: rows neither aligned nor whole vectors (element-by-element loads).
    AttnCase {
        batch: 2,
        seq: 37,
        q_heads: 3,
        kv_heads: 3,
        head_dim: 5,
        fused: true,
    },
    AttnCase {
        batch: 1,
        seq: 40,
        q_heads: 4,
        kv_heads: 2,
        head_dim: 5,
        fused: false,
    },
    // The other padded head dims: 32, 80 (padded to 96), 128.
    AttnCase {
        batch: 1,
        seq: 45,
        q_heads: 2,
        kv_heads: 1,
        head_dim: 32,
        fused: true,
    },
    AttnCase {
        batch: 1,
        seq: 45,
        q_heads: 2,
        kv_heads: 2,
        head_dim: 80,
        fused: false,
    },
    AttnCase {
        batch: 1,
        seq: 45,
        q_heads: 2,
        kv_heads: 1,
        head_dim: 128,
        fused: true,
    },
];

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Every case against the CPU backend; on devices other than the CPU also the saved
/// log-sum-exp, a second run equal bit for bit, and the errors the device adds.
pub fn check(d: &Dev) {
    let c = cpu();
    for (n, case) in CASES.iter().enumerate() {
        let (qkv, dout) = case.inputs(d, 100 + 10 * n as u64);
        let got = run(d, case, &qkv, &dout);
        let want = run(&c, case, &qkv, &dout);
        let what = format!("{} {case:?}", d.name);
        let t = d.tol();
        assert_close(&format!("{what}: out"), &got.out, &want.out, t);
        let terms = (case.seq * case.q_heads / case.kv_heads) as f64;
        let gt = Tol {
            abs: t.abs * (terms / 64.0).sqrt().max(1.0),
            rel: t.rel,
        };
        for (i, (g, w)) in got.grads.iter().zip(&want.grads).enumerate() {
            assert_close(&format!("{what}: grads[{i}]"), g, w, gt);
        }
        if d.name == "cpu" {
            continue;
        }
        let exact = exact_lse(case, &qkv);
        let lt = Tol {
            abs: 1e-5,
            rel: 1e-5,
        };
        assert_close(&format!("{what}: lse"), &got.lse, &exact, lt);
        // No atomics, no timing-dependent order: a second run gives the same bits.
        let again = run(d, case, &qkv, &dout);
        assert_eq!(bits(&again.out), bits(&got.out), "{what}: out run to run");
        assert_eq!(bits(&again.lse), bits(&got.lse), "{what}: lse run to run");
        for (i, (a, g)) in again.grads.iter().zip(&got.grads).enumerate() {
            assert_eq!(bits(a), bits(g), "{what}: grads[{i}] run to run");
        }
    }
    check_dropout(d);
    check_errors(d);
}

/// Probability dropout: the device draws the CPU's mask (a different element dropped moves the
/// output by a whole probability's share of V, far beyond the tolerances), and it does drop.
fn check_dropout(d: &Dev) {
    let c = cpu();
    for (n, case) in [CASES[0], CASES[1], CASES[4]].iter().enumerate() {
        let (qkv, dout) = case.inputs(d, 500 + n as u64);
        // An offset past 32 bits: the device's counter arithmetic is 64-bit like the CPU's.
        let dr = AttnDropout {
            seed: 77 + n as u64,
            offset: (3 << 36) * (n as u64 + 1),
            p: 0.2,
        };
        let s = AttentionShape {
            dropout: Some(dr),
            ..case.shape()
        };
        let got = run_shape(d, case, s, &qkv, &dout);
        let want = run_shape(&c, case, s, &qkv, &dout);
        let what = format!("{} dropout {case:?}", d.name);
        let t = d.tol();
        assert_close(&format!("{what}: out"), &got.out, &want.out, t);
        let terms = (case.seq * case.q_heads / case.kv_heads) as f64;
        let gt = Tol {
            abs: t.abs * (terms / 64.0).sqrt().max(1.0),
            rel: t.rel,
        };
        for (i, (g, w)) in got.grads.iter().zip(&want.grads).enumerate() {
            assert_close(&format!("{what}: grads[{i}]"), g, w, gt);
        }
        let plain = run(&c, case, &qkv, &dout);
        assert_ne!(bits(&plain.out), bits(&want.out), "{what}: nothing dropped");
    }
}

/// Views that do not fit the shape, and a saved state of the wrong size, are errors on every
/// device; a head dim above the kernels' largest tile is one on the GPU.
fn check_errors(d: &Dev) {
    let case = CASES[1];
    let s = case.shape();
    let (views, lens) = case.views();
    let (qkv, dout) = case.inputs(d, 9);
    let (q, k, v) = (d.put(&qkv[0]), d.put(&qkv[1]), d.put(&qkv[2]));
    let out_len = case.rows() * case.q_heads * case.head_dim;
    let mut out = d.zeros(out_len);
    let short_q = d.put(&qkv[0][..lens[0] - 1]);
    let err = d.be.attention_forward(
        s,
        (short_q.view(), views[0]),
        (k.view(), views[1]),
        (v.view(), views[2]),
        out.view_mut(),
    );
    assert!(err.is_err(), "{}: a short q view must be an error", d.name);
    let mut short_out = d.zeros(out_len - 1);
    let err = d.be.attention_forward(
        s,
        (q.view(), views[0]),
        (k.view(), views[1]),
        (v.view(), views[2]),
        short_out.view_mut(),
    );
    assert!(
        err.is_err(),
        "{}: a short out view must be an error",
        d.name
    );
    // A view whose heads run past its row.
    let wide = RowView {
        stride: views[1].stride,
        offset: 1,
    };
    let err = d.be.attention_forward(
        s,
        (q.view(), views[0]),
        (k.view(), wide),
        (v.view(), views[2]),
        out.view_mut(),
    );
    assert!(
        err.is_err(),
        "{}: heads past the row must be an error",
        d.name
    );
    let saved =
        d.be.attention_forward(
            s,
            (q.view(), views[0]),
            (k.view(), views[1]),
            (v.view(), views[2]),
            out.view_mut(),
        )
        .unwrap();
    let ddout = d.put(&dout);
    let mut grads: Vec<Storage> = lens.iter().map(|&n| d.zeros(n)).collect();
    let mut backward = |saved: &Storage, dq_len: usize| {
        let mut dq = d.zeros(dq_len);
        let (_, rest) = grads.split_at_mut(1);
        let (a, b) = rest.split_at_mut(1);
        d.be.attention_backward(
            s,
            (q.view(), views[0]),
            (k.view(), views[1]),
            (v.view(), views[2]),
            out.view(),
            saved,
            ddout.view(),
            AttentionGrads::Split {
                dq: dq.view_mut(),
                dk: a[0].view_mut(),
                dv: b[0].view_mut(),
            },
        )
    };
    backward(&saved, lens[0]).unwrap();
    assert!(
        backward(&saved, lens[0] - 1).is_err(),
        "{}: a short dq view must be an error",
        d.name
    );
    let wrong = d.be.zeros(DType::F32, saved.len() + 1).unwrap();
    assert!(
        backward(&wrong, lens[0]).is_err(),
        "{}: a saved state of the wrong size must be an error",
        d.name
    );
    if d.name != "cpu" {
        let big = AttnCase {
            head_dim: 160,
            ..CASES[3]
        };
        let (views, lens) = big.views();
        let (qkv, _) = big.inputs(d, 11);
        let bufs: Vec<Storage> = qkv.iter().map(|x| d.put(x)).collect();
        let mut out = d.zeros(big.rows() * big.q_heads * big.head_dim);
        let err = d.be.attention_forward(
            big.shape(),
            (bufs[0].view(), views[0]),
            (bufs[1].view(), views[1]),
            (bufs[2].view(), views[2]),
            out.view_mut(),
        );
        assert!(
            err.is_err(),
            "{}: head_dim 160 (over the largest tile) must be an error",
            d.name
        );
        let _ = lens;
    }
}
