//! Every backend operation on every device against the CPU backend (one body per op family,
//! run per device by `test_device!`), with the tolerances `Dev::tol` states per dtype; the
//! operations promised bit-exact (casts, dropout masks, the optimizer step, embeddings in f32)
//! are compared bit for bit.

mod attention_common;
mod device_common;

use device_common::{assert_close, cpu, get, rand, Dev, Tol};
use ferrozero_offload::optim::{AdamHyper, LionHyper, SgdHyper, WeightDecay};
use ferrozero_runtime::backend::{
    Accumulate, Epilogue, GradView, HeadShape, MatmulShape, Rope, RopeScaling, Rotation, Transpose,
    UpdateRule,
};
use ferrozero_runtime::nn::IGNORE_INDEX;
use ferrozero_runtime::tensor::{DType, FlatBuf, Storage, View, ViewMut};

fn tol_k(d: &Dev, k: usize) -> Tol {
    let t = d.tol();
    Tol {
        abs: t.abs * (k as f64).sqrt().max(1.0),
        rel: t.rel,
    }
}

fn matmul(d: &Dev) {
    let c = cpu();
    for (m, n, k) in [(1, 1, 1), (7, 13, 5), (33, 16, 65)] {
        for ta in [Transpose::No, Transpose::Yes] {
            for tb in [Transpose::No, Transpose::Yes] {
                let s = MatmulShape { m, n, k, ta, tb };
                let (a, b) = (d.round(&rand(m * k, 1)), d.round(&rand(k * n, 2)));
                let c0 = d.round(&rand(m * n, 3));
                for acc in [false, true] {
                    let epi = || {
                        if acc {
                            Epilogue::Accumulate
                        } else {
                            Epilogue::Store
                        }
                    };
                    let (da, db, mut dc) = (d.put(&a), d.put(&b), d.put(&c0));
                    d.be.matmul(s, da.view(), db.view(), dc.view_mut(), epi())
                        .unwrap();
                    let mut want = c0.clone();
                    c.be.matmul(
                        s,
                        View::from(&a[..]),
                        View::from(&b[..]),
                        ViewMut::from(&mut want[..]),
                        epi(),
                    )
                    .unwrap();
                    assert_close(
                        &format!("{} {s:?} acc={acc}", d.name),
                        &get(&dc),
                        &want,
                        tol_k(d, k),
                    );
                }
            }
        }
    }
    // Bias and bias+GELU (n = 16 takes cuBLASLt's fused epilogue, n = 13 the separate path).
    for n in [16, 13] {
        let (m, k) = (9, 24);
        let s = MatmulShape {
            m,
            n,
            k,
            ta: Transpose::No,
            tb: Transpose::Yes,
        };
        let (a, b, bias) = (
            d.round(&rand(m * k, 4)),
            d.round(&rand(n * k, 5)),
            d.round(&rand(n, 6)),
        );
        let (da, db, dbias) = (d.put(&a), d.put(&b), d.put(&bias));
        let mut dc = d.zeros(m * n);
        d.be.matmul(
            s,
            da.view(),
            db.view(),
            dc.view_mut(),
            Epilogue::Bias(dbias.view()),
        )
        .unwrap();
        let mut want = vec![0.0; m * n];
        let (av, bv) = (View::from(&a[..]), View::from(&b[..]));
        c.be.matmul(
            s,
            av,
            bv,
            ViewMut::from(&mut want[..]),
            Epilogue::Bias(View::from(&bias[..])),
        )
        .unwrap();
        assert_close(
            &format!("{} bias n={n}", d.name),
            &get(&dc),
            &want,
            tol_k(d, k),
        );
        let (mut dpre, mut dy) = (d.zeros(m * n), d.zeros(m * n));
        let epi = Epilogue::BiasGelu {
            bias: dbias.view(),
            pre: dpre.view_mut(),
        };
        d.be.matmul(s, da.view(), db.view(), dy.view_mut(), epi)
            .unwrap();
        let (mut pre, mut y) = (vec![0.0; m * n], vec![0.0; m * n]);
        let epi = Epilogue::BiasGelu {
            bias: View::from(&bias[..]),
            pre: ViewMut::from(&mut pre[..]),
        };
        c.be.matmul(s, av, bv, ViewMut::from(&mut y[..]), epi)
            .unwrap();
        assert_close(
            &format!("{} gelu pre n={n}", d.name),
            &get(&dpre),
            &pre,
            tol_k(d, k),
        );
        assert_close(
            &format!("{} gelu n={n}", d.name),
            &get(&dy),
            &y,
            tol_k(d, k),
        );
    }
}
test_device!(matmul);

fn elementwise(d: &Dev) {
    let c = cpu();
    let n = 1031;
    let (x, y, g) = (
        d.round(&rand(n, 7)),
        d.round(&rand(n, 8)),
        d.round(&rand(n, 9)),
    );
    let t = d.tol();
    // gelu forward and backward
    let (dx, mut dy) = (d.put(&x), d.zeros(n));
    d.be.gelu_forward(dx.view(), dy.view_mut()).unwrap();
    let mut want = vec![0.0; n];
    c.be.gelu_forward(View::from(&x[..]), ViewMut::from(&mut want[..]))
        .unwrap();
    assert_close("gelu", &get(&dy), &want, t);
    let (dg, mut dgrad) = (d.put(&g), d.zeros(n));
    d.be.gelu_backward(dx.view(), dg.view(), dgrad.view_mut())
        .unwrap();
    c.be.gelu_backward(
        View::from(&x[..]),
        View::from(&g[..]),
        ViewMut::from(&mut want[..]),
    )
    .unwrap();
    assert_close("gelu backward", &get(&dgrad), &want, t);
    // swiglu forward and backward
    let dup = d.put(&y);
    let mut dout = d.zeros(n);
    d.be.swiglu_forward(dx.view(), dup.view(), dout.view_mut())
        .unwrap();
    c.be.swiglu_forward(
        View::from(&x[..]),
        View::from(&y[..]),
        ViewMut::from(&mut want[..]),
    )
    .unwrap();
    assert_close("swiglu", &get(&dout), &want, t);
    let (mut dga, mut dua) = (d.zeros(n), d.zeros(n));
    d.be.swiglu_backward(
        dx.view(),
        dup.view(),
        dg.view(),
        dga.view_mut(),
        dua.view_mut(),
    )
    .unwrap();
    let (mut wg, mut wu) = (vec![0.0; n], vec![0.0; n]);
    c.be.swiglu_backward(
        View::from(&x[..]),
        View::from(&y[..]),
        View::from(&g[..]),
        ViewMut::from(&mut wg[..]),
        ViewMut::from(&mut wu[..]),
    )
    .unwrap();
    assert_close("swiglu dgate", &get(&dga), &wg, t);
    assert_close("swiglu dup", &get(&dua), &wu, t);
    // residual add
    let mut acc = d.put(&x);
    d.be.add_assign(acc.view_mut(), dup.view()).unwrap();
    let sum: Vec<f32> = x.iter().zip(&y).map(|(a, b)| a + b).collect();
    assert_close("add", &get(&acc), &sum, t);
    // dropout: the same mask on every device, bit for bit
    let ones = vec![1.0f32; n];
    let mut dd = d.put(&ones);
    d.be.dropout(42, 0.3, dd.view_mut()).unwrap();
    let mut wd = ones.clone();
    c.be.dropout(42, 0.3, ViewMut::from(&mut wd[..])).unwrap();
    let got = get(&dd);
    for i in 0..n {
        assert_eq!(got[i] == 0.0, wd[i] == 0.0, "dropout mask at {i}");
    }
    assert_close("dropout scale", &got, &wd, t);
    // bias gradient: column sums accumulated into f32
    let (rows, cols) = (37, 19);
    let m = d.round(&rand(rows * cols, 10));
    let init = rand(cols, 11);
    let (dm, mut dacc) = (d.put(&m), d.put_f32(&init));
    d.be.sum_rows(dm.view(), cols, dacc.view_mut()).unwrap();
    let mut wacc = init.clone();
    c.be.sum_rows(View::from(&m[..]), cols, ViewMut::from(&mut wacc[..]))
        .unwrap();
    assert_close(
        "sum_rows",
        &get(&dacc),
        &wacc,
        Tol {
            abs: 1e-5,
            rel: 1e-5,
        },
    );
}
test_device!(elementwise);

fn norms(d: &Dev) {
    let c = cpu();
    let (rows, dim) = (45, 40);
    let x = d.round(
        &rand(rows * dim, 12)
            .iter()
            .map(|v| v * 3.0 + 0.5)
            .collect::<Vec<_>>(),
    );
    let (gamma, beta, dy) = (
        d.round(&rand(dim, 13)),
        d.round(&rand(dim, 14)),
        d.round(&rand(rows * dim, 15)),
    );
    let t = d.tol();
    let (dxs, dgam, dbet, ddy) = (d.put(&x), d.put(&gamma), d.put(&beta), d.put(&dy));
    let (mut y, mut mean, mut rstd) = (d.zeros(rows * dim), d.zeros_f32(rows), d.zeros_f32(rows));
    d.be.layernorm_forward(
        dxs.view(),
        dgam.view(),
        dbet.view(),
        1e-5,
        y.view_mut(),
        mean.view_mut(),
        rstd.view_mut(),
    )
    .unwrap();
    let (mut wy, mut wm, mut wr) = (vec![0.0; rows * dim], vec![0.0; rows], vec![0.0; rows]);
    c.be.layernorm_forward(
        View::from(&x[..]),
        View::from(&gamma[..]),
        View::from(&beta[..]),
        1e-5,
        ViewMut::from(&mut wy[..]),
        ViewMut::from(&mut wm[..]),
        ViewMut::from(&mut wr[..]),
    )
    .unwrap();
    assert_close("layernorm y", &get(&y), &wy, t);
    assert_close(
        "layernorm mean",
        &get(&mean),
        &wm,
        Tol {
            abs: 1e-5,
            rel: 1e-5,
        },
    );
    assert_close(
        "layernorm rstd",
        &get(&rstd),
        &wr,
        Tol {
            abs: 1e-5,
            rel: 1e-4,
        },
    );
    let (mut dx, mut dg, mut db) = (
        d.zeros(rows * dim),
        d.put_f32(&vec![0.5; dim]),
        d.put_f32(&vec![0.25; dim]),
    );
    d.be.layernorm_backward(
        dxs.view(),
        dgam.view(),
        mean.view(),
        rstd.view(),
        ddy.view(),
        dx.view_mut(),
        dg.view_mut(),
        db.view_mut(),
    )
    .unwrap();
    let (mut wdx, mut wdg, mut wdb) = (vec![0.0; rows * dim], vec![0.5; dim], vec![0.25; dim]);
    c.be.layernorm_backward(
        View::from(&x[..]),
        View::from(&gamma[..]),
        View::from(&wm[..]),
        View::from(&wr[..]),
        View::from(&dy[..]),
        ViewMut::from(&mut wdx[..]),
        ViewMut::from(&mut wdg[..]),
        ViewMut::from(&mut wdb[..]),
    )
    .unwrap();
    assert_close("layernorm dx", &get(&dx), &wdx, tol_k(d, dim));
    assert_close("layernorm dgamma", &get(&dg), &wdg, tol_k(d, rows));
    assert_close("layernorm dbeta", &get(&db), &wdb, tol_k(d, rows));
    // RMSNorm
    let (mut y, mut rstd) = (d.zeros(rows * dim), d.zeros_f32(rows));
    d.be.rmsnorm_forward(dxs.view(), dgam.view(), 1e-6, y.view_mut(), rstd.view_mut())
        .unwrap();
    let mut wr = vec![0.0; rows];
    c.be.rmsnorm_forward(
        View::from(&x[..]),
        View::from(&gamma[..]),
        1e-6,
        ViewMut::from(&mut wy[..]),
        ViewMut::from(&mut wr[..]),
    )
    .unwrap();
    assert_close("rmsnorm y", &get(&y), &wy, t);
    let (mut dx, mut dg) = (d.zeros(rows * dim), d.zeros_f32(dim));
    d.be.rmsnorm_backward(
        dxs.view(),
        dgam.view(),
        rstd.view(),
        ddy.view(),
        dx.view_mut(),
        dg.view_mut(),
    )
    .unwrap();
    let mut wdg = vec![0.0; dim];
    c.be.rmsnorm_backward(
        View::from(&x[..]),
        View::from(&gamma[..]),
        View::from(&wr[..]),
        View::from(&dy[..]),
        ViewMut::from(&mut wdx[..]),
        ViewMut::from(&mut wdg[..]),
    )
    .unwrap();
    assert_close("rmsnorm dx", &get(&dx), &wdx, tol_k(d, dim));
    assert_close("rmsnorm dgamma", &get(&dg), &wdg, tol_k(d, rows));
}
test_device!(norms);

fn rope(d: &Dev) {
    let c = cpu();
    let (b, t, h, hd) = (2, 7, 3, 8);
    let x = d.round(&rand(b * t * h * hd, 16));
    for dir in [Rotation::Forward, Rotation::Inverse] {
        let mut dx = d.put(&x);
        d.be.rope(dx.view_mut(), b, t, h, hd, &Rope::plain(10000.0), dir)
            .unwrap();
        let mut want = x.clone();
        c.be.rope(
            ViewMut::from(&mut want[..]),
            b,
            t,
            h,
            hd,
            &Rope::plain(10000.0),
            dir,
        )
        .unwrap();
        assert_close(&format!("rope {dir:?}"), &get(&dx), &want, d.tol());
    }
}
test_device!(rope);

/// Scaled frequencies (Llama 3's bands, linear interpolation) rotate alike on every device:
/// each backend builds its table from `Rope::angles`, and a device keyed its cached table by
/// every scaling parameter (a scaled rope after a plain one gets its own table).
fn rope_scaled(d: &Dev) {
    let c = cpu();
    // head_dim 16: with base 1e4 and 256/4..256/1 the 8 wavelengths fall in all three bands.
    let (b, t, h, hd) = (2, 9, 2, 16);
    let x = d.round(&rand(b * t * h * hd, 18));
    let llama3 = RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 256,
    };
    let linear = RopeScaling::Linear { factor: 2.0 };
    let mut outs = vec![];
    for scaling in [RopeScaling::None, llama3, linear] {
        let rope = Rope {
            theta: 10000.0,
            scaling,
        };
        let mut dx = d.put(&x);
        d.be.rope(dx.view_mut(), b, t, h, hd, &rope, Rotation::Forward)
            .unwrap();
        let mut want = x.clone();
        c.be.rope(
            ViewMut::from(&mut want[..]),
            b,
            t,
            h,
            hd,
            &rope,
            Rotation::Forward,
        )
        .unwrap();
        assert_close(&format!("rope {scaling:?}"), &get(&dx), &want, d.tol());
        let mut dinv = d.put(&x);
        d.be.rope(dinv.view_mut(), b, t, h, hd, &rope, Rotation::Inverse)
            .unwrap();
        let mut inv = x.clone();
        c.be.rope(
            ViewMut::from(&mut inv[..]),
            b,
            t,
            h,
            hd,
            &rope,
            Rotation::Inverse,
        )
        .unwrap();
        assert_close(
            &format!("rope {scaling:?} inverse"),
            &get(&dinv),
            &inv,
            d.tol(),
        );
        outs.push(want);
    }
    assert_ne!(outs[0], outs[1], "llama3 scaling changes the rotation");
    assert_ne!(outs[0], outs[2], "linear scaling changes the rotation");
}
test_device!(rope_scaled);

fn embeddings(d: &Dev) {
    let c = cpu();
    let (vocab, dim, b, t) = (11, 12, 3, 5);
    let table = d.round(&rand(vocab * dim, 17));
    let tokens: Vec<i32> = (0..b * t).map(|i| ((i * 7 + 3) % vocab) as i32).collect();
    let (dids, cids) = (
        d.be.upload_ids(&tokens).unwrap(),
        c.be.upload_ids(&tokens).unwrap(),
    );
    let dt = d.put(&table);
    let mut out = d.zeros(b * t * dim);
    d.be.embedding_forward(
        dids.ids(),
        dt.view(),
        dim,
        out.view_mut(),
        Accumulate::Overwrite,
    )
    .unwrap();
    let wpe = d.round(&rand(t * dim, 18));
    let dw = d.put(&wpe);
    d.be.position_forward(dw.view(), b, t, out.view_mut())
        .unwrap();
    let mut want = vec![0.0; b * t * dim];
    c.be.embedding_forward(
        cids.ids(),
        View::from(&table[..]),
        dim,
        ViewMut::from(&mut want[..]),
        Accumulate::Overwrite,
    )
    .unwrap();
    c.be.position_forward(View::from(&wpe[..]), b, t, ViewMut::from(&mut want[..]))
        .unwrap();
    assert_close("embedding + positions", &get(&out), &want, d.tol());
    // Backward: f32 tables, summed in position order on every device.
    let dout = d.round(&rand(b * t * dim, 19));
    let ddout = d.put(&dout);
    let (mut dtab, mut dpos) = (d.zeros_f32(vocab * dim), d.zeros_f32(t * dim));
    d.be.embedding_backward(dids.ids(), ddout.view(), dim, dtab.view_mut())
        .unwrap();
    d.be.position_backward(ddout.view(), b, t, dpos.view_mut())
        .unwrap();
    let (mut wtab, mut wpos) = (vec![0.0; vocab * dim], vec![0.0; t * dim]);
    c.be.embedding_backward(
        cids.ids(),
        View::from(&dout[..]),
        dim,
        ViewMut::from(&mut wtab[..]),
    )
    .unwrap();
    c.be.position_backward(View::from(&dout[..]), b, t, ViewMut::from(&mut wpos[..]))
        .unwrap();
    let exact = Tol { abs: 0.0, rel: 0.0 };
    assert_close("embedding backward", &get(&dtab), &wtab, exact);
    assert_close("position backward", &get(&dpos), &wpos, exact);
    // A token outside the table is an error, not a read out of bounds.
    let bad = d.be.upload_ids(&[0, vocab as i32]).unwrap();
    let mut o = d.zeros(2 * dim);
    assert!(d
        .be
        .embedding_forward(
            bad.ids(),
            dt.view(),
            dim,
            o.view_mut(),
            Accumulate::Overwrite
        )
        .is_err());
}
test_device!(embeddings);

fn head_loss(d: &Dev) {
    let c = cpu();
    let s = HeadShape {
        rows: 13,
        dim: 16,
        vocab: 37,
    };
    let x = d.round(&rand(s.rows * s.dim, 20));
    let w = d.round(&rand(s.vocab * s.dim, 21));
    let targets: Vec<i32> = (0..s.rows)
        .map(|r| {
            if r % 5 == 2 {
                IGNORE_INDEX
            } else {
                ((r * 11) % s.vocab) as i32
            }
        })
        .collect();
    let (dt, ct) = (
        d.be.upload_ids(&targets).unwrap(),
        c.be.upload_ids(&targets).unwrap(),
    );
    let (dxs, dw) = (d.put(&x), d.put(&w));
    let out =
        d.be.head_loss_forward(s, dxs.view(), dw.view(), dt.ids(), true)
            .unwrap();
    let want =
        c.be.head_loss_forward(s, View::from(&x[..]), View::from(&w[..]), ct.ids(), true)
            .unwrap();
    let loss = get(&out.loss);
    let wl = get(&want.loss);
    assert_close(
        "loss sum",
        &loss,
        &wl,
        Tol {
            abs: 1e-3,
            rel: d.tol().rel,
        },
    );
    let (mut ddx, mut ddw) = (d.zeros(s.rows * s.dim), d.zeros_f32(s.vocab * s.dim));
    d.be.head_loss_backward(
        s,
        dxs.view(),
        dw.view(),
        dt.ids(),
        out.saved.unwrap(),
        0.5,
        ddx.view_mut(),
        ddw.view_mut(),
    )
    .unwrap();
    let (mut wdx, mut wdw) = (vec![0.0; s.rows * s.dim], vec![0.0; s.vocab * s.dim]);
    c.be.head_loss_backward(
        s,
        View::from(&x[..]),
        View::from(&w[..]),
        ct.ids(),
        want.saved.unwrap(),
        0.5,
        ViewMut::from(&mut wdx[..]),
        ViewMut::from(&mut wdw[..]),
    )
    .unwrap();
    assert_close("head dx", &get(&ddx), &wdx, tol_k(d, s.vocab));
    assert_close("head dw", &get(&ddw), &wdw, tol_k(d, s.rows));
    // Argmax of the logits.
    let logits = d.round(&rand(5 * 9, 22));
    let am = d.be.argmax_rows(d.put(&logits).view(), 9).unwrap();
    assert_eq!(am, c.be.argmax_rows(View::from(&logits[..]), 9).unwrap());
    // A target outside the vocabulary is an error.
    let bad = d.be.upload_ids(&vec![s.vocab as i32; s.rows]).unwrap();
    assert!(d
        .be
        .head_loss_forward(s, dxs.view(), dw.view(), bad.ids(), false)
        .is_err());
}
test_device!(head_loss);

fn optimizer(d: &Dev) {
    let c = cpu();
    let n = 1027;
    let rules = [
        UpdateRule::Adam(AdamHyper {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            decay: WeightDecay::Decoupled,
            bias_correction: true,
        }),
        UpdateRule::Sgd(SgdHyper {
            lr: 0.05,
            momentum: 0.9,
            dampening: 0.0,
            weight_decay: 0.01,
            nesterov: true,
        }),
        UpdateRule::Lion(LionHyper {
            lr: 1e-4,
            beta1: 0.9,
            beta2: 0.99,
            weight_decay: 0.1,
        }),
    ];
    for rule in rules {
        for lp_dtype in [None, Some(DType::Bf16)] {
            let (p0, g, m0, v0) = (
                rand(n, 30),
                rand(n, 31),
                rand(n, 32),
                rand(n, 33).iter().map(|v| v.abs()).collect::<Vec<_>>(),
            );
            let (mut dp, dg, mut dm, mut dv) = (
                d.put_f32(&p0),
                d.put_f32(&g),
                d.put_f32(&m0),
                d.put_f32(&v0),
            );
            let mut dlp = lp_dtype.map(|t| d.be.zeros(t, n).unwrap());
            let (mut cp, mut cm, mut cv) = (p0.clone(), m0.clone(), v0.clone());
            let mut clp = lp_dtype.map(|t| FlatBuf::zeros(t, n));
            for step in 1..=3 {
                d.be.optimizer_update(
                    &rule,
                    step,
                    0.5,
                    dp.view_mut(),
                    dg.view().into(),
                    dm.view_mut(),
                    dv.view_mut(),
                    dlp.as_mut().map(Storage::view_mut),
                )
                .unwrap();
                c.be.optimizer_update(
                    &rule,
                    step,
                    0.5,
                    ViewMut::from(&mut cp[..]),
                    View::from(&g[..]).into(),
                    ViewMut::from(&mut cm[..]),
                    ViewMut::from(&mut cv[..]),
                    clp.as_mut().map(|b| ViewMut::Host(b.as_mut())),
                )
                .unwrap();
            }
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&get(&dp)),
                bits(&cp),
                "{rule:?}: parameters bit for bit"
            );
            assert_eq!(
                bits(&get(&dm)),
                bits(&cm),
                "{rule:?}: first moment bit for bit"
            );
            if let (Some(dl), Some(cl)) = (&dlp, &clp) {
                let mut w = vec![0.0; n];
                cl.load_f32(0, &mut w);
                assert_eq!(bits(&get(dl)), bits(&w), "{rule:?}: bf16 copy bit for bit");
            }
        }
    }
}
test_device!(optimizer);

fn storage_ops(d: &Dev) {
    let vals = rand(3001, 40);
    // Casts round to nearest even exactly as `half` does, on every device.
    for (from, to) in [
        (DType::F32, DType::Bf16),
        (DType::F32, DType::F16),
        (DType::Bf16, DType::F32),
    ] {
        let mut src = d.be.buffer(from, vals.len()).unwrap();
        src.write_f32(0, &vals).unwrap();
        let mut dst = d.be.buffer(to, vals.len()).unwrap();
        src.cast_into(&mut dst).unwrap();
        let mut want = FlatBuf::zeros(from, vals.len());
        want.store_f32(0, &vals);
        let mut wf = vec![0.0; vals.len()];
        want.load_f32(0, &mut wf);
        let mut wt = FlatBuf::zeros(to, vals.len());
        wt.store_f32(0, &wf);
        assert_eq!(dst.to_host().unwrap(), wt, "cast {from:?} -> {to:?}");
    }
    // Accumulate, non-finite detection and the sum of squares (f64).
    let mut acc = d.be.buffer(DType::Bf16, vals.len()).unwrap();
    acc.write_f32(0, &vals).unwrap();
    let add = {
        let mut b = d.be.buffer(DType::Bf16, 1000).unwrap();
        b.write_f32(0, &vals[..1000]).unwrap();
        b
    };
    acc.accumulate(7, &add, 1000, &mut Vec::new()).unwrap();
    let mut host = FlatBuf::zeros(DType::Bf16, vals.len());
    host.store_f32(0, &vals);
    let mut hadd = FlatBuf::zeros(DType::Bf16, 1000);
    hadd.store_f32(0, &vals[..1000]);
    host.accumulate(7, &hadd, 1000, &mut Vec::new());
    assert_eq!(
        acc.to_host().unwrap(),
        host,
        "accumulate into bf16 bit for bit"
    );
    assert!(!acc.has_non_finite(0..vals.len()).unwrap());
    acc.write_f32(2000, &[f32::INFINITY]).unwrap();
    assert!(acc.has_non_finite(1990..2010).unwrap());
    assert!(!acc.has_non_finite(0..2000).unwrap());
    let mut f = d.be.buffer(DType::F32, vals.len()).unwrap();
    f.write_f32(0, &vals).unwrap();
    let want: f64 = vals.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
    let got = f.sum_squares(0..vals.len()).unwrap();
    assert!((got - want).abs() <= 1e-12 * want, "{got} vs {want}");
    // Ranges outside a buffer are errors on every device.
    assert!(f.sum_squares(0..vals.len() + 1).is_err());
    assert!(f.write_f32(vals.len(), &[1.0]).is_err());
}
test_device!(storage_ops);

/// The step's status read back at once equals each value read alone, bit for bit: losses in
/// any dtype, sums of squares of ranges of several dtypes (an empty one, a non-finite one),
/// and host views beside device views (offloaded gradients on a device backend).
fn step_status(d: &Dev) {
    let vals = rand(9000, 41);
    let mut grads = Vec::new();
    for dt in [DType::F32, DType::Bf16, DType::F16] {
        let mut g = d.be.buffer(dt, vals.len()).unwrap();
        g.write_f32(0, &vals).unwrap();
        grads.push(g);
    }
    grads[2].write_f32(8000, &[f32::INFINITY]).unwrap();
    let host = Storage::Host(FlatBuf::F32(vals[..777].to_vec()));
    let losses: Vec<Storage> = [
        (DType::F32, 3.25f32),
        (DType::Bf16, -1.5),
        (DType::F32, 1e-3),
    ]
    .iter()
    .map(|&(dt, v)| {
        let mut l = d.be.buffer(dt, 1).unwrap();
        l.write_f32(0, &[v]).unwrap();
        l
    })
    .collect();
    let ranges = [
        (0, 0..9000),
        (1, 5..4100),
        (0, 17..17),
        (2, 0..8001),
        (1, 0..1),
    ];
    let mut views: Vec<View<'_>> = ranges
        .iter()
        .map(|(i, r)| grads[*i].view().range(r.clone()).unwrap())
        .collect();
    views.push(host.view());
    let loss_views: Vec<View<'_>> = losses.iter().map(Storage::view).collect();
    let views: Vec<_> = views.into_iter().map(GradView::from).collect();
    let st = d.be.step_status(&loss_views, &views).unwrap();
    let mut want: Vec<f64> = ranges
        .iter()
        .map(|(i, r)| grads[*i].sum_squares(r.clone()).unwrap())
        .collect();
    want.push(host.sum_squares(0..777).unwrap());
    let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(
        bits(&st.sum_squares),
        bits(&want),
        "{}: sums of squares",
        d.name
    );
    assert!(st.sum_squares[3].is_infinite() && st.sum_squares[2] == 0.0);
    let want_losses: Vec<f32> = losses.iter().map(|l| get(l)[0]).collect();
    assert_eq!(st.losses, want_losses, "{}: losses", d.name);
    // Nothing to read is no error; a loss of more than one element is, by name.
    assert_eq!(d.be.step_status(&[], &[]).unwrap(), Default::default());
    let err = d.be.step_status(&[grads[0].view()], &[]).unwrap_err();
    assert!(err.to_string().contains("loss"), "{err}");
}
test_device!(step_status);

fn attention(d: &Dev) {
    attention_common::check(d);
}
test_device!(attention);
