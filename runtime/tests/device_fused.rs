//! The fused residual operations on every device (`test_device!`): a residual add with the norm
//! after it, a norm's input gradient with the residual gradient, RoPE on queries and keys at
//! once, and a product written over a residual. Each gives, on its own device, the bits of the
//! separate operations it replaces (so fusing changes no CPU bit and no device bit), and agrees
//! with the CPU within the device's tolerance; bad shapes are refused by name.

#[macro_use]
mod device_common;

use device_common::{assert_close, cpu, get, rand, Dev};
use ferrozero_runtime::backend::{
    AttentionShape, Epilogue, MatmulShape, Rope, Rotation, Transpose,
};
use ferrozero_runtime::tensor::Storage;

/// Widths: vectorised rows (40) and element-by-element ones (7).
const SHAPES: [(usize, usize); 2] = [(45, 40), (5, 7)];

fn assert_bits(what: &str, got: &Storage, want: &Storage) {
    let (g, w) = (get(got), get(want));
    assert_eq!(g.len(), w.len(), "{what}: lengths");
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        assert_eq!(
            a.to_bits(),
            b.to_bits(),
            "{what}[{i}]: fused {a}, separate {b}"
        );
    }
}

/// The fused forward norms against `copy`, `add_assign` and the plain norm on the same device.
fn residual_norm_forward(d: &Dev) {
    for (rows, dim) in SHAPES {
        let x = d.round(
            &rand(rows * dim, 31)
                .iter()
                .map(|v| v * 3.0)
                .collect::<Vec<_>>(),
        );
        let (r, gamma, beta) = (d.round(&rand(rows * dim, 32)), rand(dim, 33), rand(dim, 34));
        let (dx, dr, dg, db) = (
            d.put(&x),
            d.put(&r),
            d.put(&d.round(&gamma)),
            d.put(&d.round(&beta)),
        );
        for residual in [None, Some(dr.view())] {
            let what = |k: &str| {
                format!(
                    "{} {k} {rows}x{dim} residual {}",
                    d.name,
                    residual.is_some()
                )
            };
            let (mut sum, mut y) = (d.zeros(rows * dim), d.zeros(rows * dim));
            let (mut mean, mut rstd) = (d.zeros_f32(rows), d.zeros_f32(rows));
            let stats = (mean.view_mut(), rstd.view_mut());
            d.be.residual_layernorm_forward(
                dx.view(),
                residual,
                dg.view(),
                db.view(),
                1e-5,
                sum.view_mut(),
                y.view_mut(),
                stats,
            )
            .unwrap();
            let mut want_sum = d.be.copy(dx.view()).unwrap();
            if let Some(r) = residual {
                d.be.add_assign(want_sum.view_mut(), r).unwrap();
            }
            let (mut wy, mut wm, mut wr) =
                (d.zeros(rows * dim), d.zeros_f32(rows), d.zeros_f32(rows));
            d.be.layernorm_forward(
                want_sum.view(),
                dg.view(),
                db.view(),
                1e-5,
                wy.view_mut(),
                wm.view_mut(),
                wr.view_mut(),
            )
            .unwrap();
            assert_bits(&what("layernorm sum"), &sum, &want_sum);
            assert_bits(&what("layernorm y"), &y, &wy);
            assert_bits(&what("layernorm mean"), &mean, &wm);
            assert_bits(&what("layernorm rstd"), &rstd, &wr);
            // Against the CPU's fused operation on the same (rounded) inputs.
            let c = cpu();
            let (cx, cr) = (c.put(&x), c.put(&r));
            let (mut cs, mut cy, mut cm, mut crs) = (
                c.zeros(rows * dim),
                c.zeros(rows * dim),
                c.zeros_f32(rows),
                c.zeros_f32(rows),
            );
            let (cg, cb) = (c.put(&d.round(&gamma)), c.put(&d.round(&beta)));
            c.be.residual_layernorm_forward(
                cx.view(),
                residual.map(|_| cr.view()),
                cg.view(),
                cb.view(),
                1e-5,
                cs.view_mut(),
                cy.view_mut(),
                (cm.view_mut(), crs.view_mut()),
            )
            .unwrap();
            assert_close(&what("layernorm y vs cpu"), &get(&y), &get(&cy), d.tol());
            assert_close(
                &what("layernorm sum vs cpu"),
                &get(&sum),
                &get(&cs),
                d.tol(),
            );

            // RMSNorm.
            let (mut sum, mut y, mut rstd) =
                (d.zeros(rows * dim), d.zeros(rows * dim), d.zeros_f32(rows));
            d.be.residual_rmsnorm_forward(
                dx.view(),
                residual,
                dg.view(),
                1e-6,
                sum.view_mut(),
                y.view_mut(),
                rstd.view_mut(),
            )
            .unwrap();
            let (mut wy, mut wr) = (d.zeros(rows * dim), d.zeros_f32(rows));
            d.be.rmsnorm_forward(
                want_sum.view(),
                dg.view(),
                1e-6,
                wy.view_mut(),
                wr.view_mut(),
            )
            .unwrap();
            assert_bits(&what("rmsnorm sum"), &sum, &want_sum);
            assert_bits(&what("rmsnorm y"), &y, &wy);
            assert_bits(&what("rmsnorm rstd"), &rstd, &wr);
            let (mut cs, mut cy, mut crs) =
                (c.zeros(rows * dim), c.zeros(rows * dim), c.zeros_f32(rows));
            c.be.residual_rmsnorm_forward(
                cx.view(),
                residual.map(|_| cr.view()),
                cg.view(),
                1e-6,
                cs.view_mut(),
                cy.view_mut(),
                crs.view_mut(),
            )
            .unwrap();
            assert_close(&what("rmsnorm y vs cpu"), &get(&y), &get(&cy), d.tol());
        }
    }
}
test_device!(residual_norm_forward);

/// The norms' input gradients with the residual gradient added, against the norm backward and
/// `add_assign` on the same device, parameter gradients included.
fn norm_backward_residual(d: &Dev) {
    for (rows, dim) in SHAPES {
        let what = |k: &str| format!("{} {k} {rows}x{dim}", d.name);
        let x = d.put(
            &rand(rows * dim, 41)
                .iter()
                .map(|v| v * 2.0 + 0.5)
                .collect::<Vec<_>>(),
        );
        let (gamma, dy, dres) = (
            d.put(&rand(dim, 42)),
            d.put(&rand(rows * dim, 43)),
            d.put(&rand(rows * dim, 44)),
        );
        let (mut y, mut mean, mut rstd) =
            (d.zeros(rows * dim), d.zeros_f32(rows), d.zeros_f32(rows));
        let beta = d.put(&rand(dim, 45));
        d.be.layernorm_forward(
            x.view(),
            gamma.view(),
            beta.view(),
            1e-5,
            y.view_mut(),
            mean.view_mut(),
            rstd.view_mut(),
        )
        .unwrap();
        let grads = || {
            (
                d.zeros(rows * dim),
                d.put_f32(&vec![0.5; dim]),
                d.put_f32(&vec![0.25; dim]),
            )
        };
        let (mut dx, mut dg, mut db) = grads();
        d.be.layernorm_backward_residual(
            x.view(),
            gamma.view(),
            (mean.view(), rstd.view()),
            dy.view(),
            dres.view(),
            dx.view_mut(),
            dg.view_mut(),
            db.view_mut(),
        )
        .unwrap();
        let (mut wdx, mut wdg, mut wdb) = grads();
        d.be.layernorm_backward(
            x.view(),
            gamma.view(),
            mean.view(),
            rstd.view(),
            dy.view(),
            wdx.view_mut(),
            wdg.view_mut(),
            wdb.view_mut(),
        )
        .unwrap();
        d.be.add_assign(wdx.view_mut(), dres.view()).unwrap();
        assert_bits(&what("layernorm dx"), &dx, &wdx);
        assert_bits(&what("layernorm dgamma"), &dg, &wdg);
        assert_bits(&what("layernorm dbeta"), &db, &wdb);

        d.be.rmsnorm_forward(x.view(), gamma.view(), 1e-6, y.view_mut(), rstd.view_mut())
            .unwrap();
        let (mut dx, mut dg, _) = grads();
        d.be.rmsnorm_backward_residual(
            x.view(),
            gamma.view(),
            rstd.view(),
            dy.view(),
            dres.view(),
            dx.view_mut(),
            dg.view_mut(),
        )
        .unwrap();
        let (mut wdx, mut wdg, _) = grads();
        d.be.rmsnorm_backward(
            x.view(),
            gamma.view(),
            rstd.view(),
            dy.view(),
            wdx.view_mut(),
            wdg.view_mut(),
        )
        .unwrap();
        d.be.add_assign(wdx.view_mut(), dres.view()).unwrap();
        assert_bits(&what("rmsnorm dx"), &dx, &wdx);
        assert_bits(&what("rmsnorm dgamma"), &dg, &wdg);
    }
}
test_device!(norm_backward_residual);

/// A residual or its gradient of the wrong length is refused, naming it.
fn fused_norms_refuse_bad_shapes(d: &Dev) {
    let (rows, dim) = (4, 8);
    let (x, short, gamma, beta) = (
        d.zeros(rows * dim),
        d.zeros(rows * dim - 1),
        d.put(&[1.0; 8]),
        d.zeros(dim),
    );
    let (mut sum, mut y, mut mean, mut rstd) = (
        d.zeros(rows * dim),
        d.zeros(rows * dim),
        d.zeros_f32(rows),
        d.zeros_f32(rows),
    );
    let err =
        d.be.residual_layernorm_forward(
            x.view(),
            Some(short.view()),
            gamma.view(),
            beta.view(),
            1e-5,
            sum.view_mut(),
            y.view_mut(),
            (mean.view_mut(), rstd.view_mut()),
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("residual"), "{}: {err}", d.name);
    let mut short_sum = d.zeros(rows * dim - 1);
    let err =
        d.be.residual_rmsnorm_forward(
            x.view(),
            None,
            gamma.view(),
            1e-6,
            short_sum.view_mut(),
            y.view_mut(),
            rstd.view_mut(),
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("sum"), "{}: {err}", d.name);
    let (mut dx, mut dg, mut db) = (d.zeros(rows * dim), d.zeros_f32(dim), d.zeros_f32(dim));
    let err =
        d.be.layernorm_backward_residual(
            x.view(),
            gamma.view(),
            (mean.view(), rstd.view()),
            x.view(),
            short.view(),
            dx.view_mut(),
            dg.view_mut(),
            db.view_mut(),
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("dresidual"), "{}: {err}", d.name);
    let err =
        d.be.rmsnorm_backward_residual(
            x.view(),
            gamma.view(),
            rstd.view(),
            x.view(),
            short.view(),
            dx.view_mut(),
            dg.view_mut(),
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("dresidual"), "{}: {err}", d.name);
}
test_device!(fused_norms_refuse_bad_shapes);

/// RoPE on queries and keys at once: the bits of two `rope` calls, on every device; a key
/// buffer of the wrong length is refused by name.
fn rope_queries_and_keys(d: &Dev) {
    let (b, t, hq, hkv) = (2, 5, 4, 2);
    for hd in [8, 6] {
        let shape = AttentionShape {
            batch: b,
            seq: t,
            q_heads: hq,
            kv_heads: hkv,
            head_dim: hd,
            dropout: None,
        };
        let (q, k) = (
            d.round(&rand(b * t * hq * hd, 51)),
            d.round(&rand(b * t * hkv * hd, 52)),
        );
        let rope = Rope::plain(10000.0);
        for dir in [Rotation::Forward, Rotation::Inverse] {
            let (mut fq, mut fk) = (d.put(&q), d.put(&k));
            d.be.rope_qk(fq.view_mut(), fk.view_mut(), shape, &rope, dir)
                .unwrap();
            let (mut sq, mut sk) = (d.put(&q), d.put(&k));
            d.be.rope(sq.view_mut(), b, t, hq, hd, &rope, dir).unwrap();
            d.be.rope(sk.view_mut(), b, t, hkv, hd, &rope, dir).unwrap();
            assert_bits(&format!("{} rope q {dir:?} hd {hd}", d.name), &fq, &sq);
            assert_bits(&format!("{} rope k {dir:?} hd {hd}", d.name), &fk, &sk);
        }
        let (mut fq, mut short) = (d.put(&q), d.zeros(b * t * hkv * hd - 2));
        let err =
            d.be.rope_qk(
                fq.view_mut(),
                short.view_mut(),
                shape,
                &rope,
                Rotation::Forward,
            )
            .unwrap_err()
            .to_string();
        assert!(err.contains("k: "), "{}: {err}", d.name);
    }
}
test_device!(rope_queries_and_keys);

/// A product written over a residual (`Epilogue::Residual`), with and without a bias: on the
/// CPU the bits of the steps the layers took before (the biased product then `add_assign`; a
/// copy of the residual then the accumulating product), on every device close to them; a
/// residual of the wrong length is refused by name.
fn product_over_residual(d: &Dev) {
    let (m, k, n) = (9, 24, 16);
    let s = MatmulShape {
        m,
        n,
        k,
        ta: Transpose::No,
        tb: Transpose::Yes,
    };
    let (a, w, r, b) = (
        d.round(&rand(m * k, 61)),
        d.round(&rand(n * k, 62)),
        d.round(&rand(m * n, 63)),
        d.round(&rand(n, 64)),
    );
    let (da, dw, dr, db) = (d.put(&a), d.put(&w), d.put(&r), d.put(&b));
    let c = cpu();
    let (ca, cw, cr, cb) = (c.put(&a), c.put(&w), c.put(&r), c.put(&b));
    for bias in [false, true] {
        let what = format!("{} product over residual, bias {bias}", d.name);
        let mut y = d.zeros(m * n);
        let epilogue = Epilogue::Residual {
            residual: dr.view(),
            bias: bias.then(|| db.view()),
        };
        d.be.matmul(s, da.view(), dw.view(), y.view_mut(), epilogue)
            .unwrap();
        // The CPU's former steps.
        let mut want = if bias {
            let mut want = c.zeros(m * n);
            c.be.matmul(
                s,
                ca.view(),
                cw.view(),
                want.view_mut(),
                Epilogue::Bias(cb.view()),
            )
            .unwrap();
            c.be.add_assign(want.view_mut(), cr.view()).unwrap();
            want
        } else {
            c.be.copy(cr.view()).unwrap()
        };
        if !bias {
            c.be.matmul(
                s,
                ca.view(),
                cw.view(),
                want.view_mut(),
                Epilogue::Accumulate,
            )
            .unwrap();
        }
        if d.name == "cpu" {
            assert_bits(&what, &y, &want);
        }
        assert_close(&what, &get(&y), &get(&want), d.tol());
    }
    let (short, mut y) = (d.zeros(m * n - 1), d.zeros(m * n));
    let epilogue = Epilogue::Residual {
        residual: short.view(),
        bias: None,
    };
    let err =
        d.be.matmul(s, da.view(), dw.view(), y.view_mut(), epilogue)
            .unwrap_err()
            .to_string();
    assert!(err.contains("residual"), "{}: {err}", d.name);
}
test_device!(product_over_residual);
