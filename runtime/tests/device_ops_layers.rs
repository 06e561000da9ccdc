//! Norms, rotary embeddings and embeddings on every device against the CPU backend (one body
//! per op family, run per device by `test_device!`; embeddings in f32 bit for bit). The
//! other op families are in `device_ops` and `device_ops_training`.

mod device_common;

use device_common::{assert_close, cpu, get, rand, tol_k, Dev, Tol};
use ferrozero_runtime::backend::{Accumulate, Rope, RopeScaling, Rotation};
use ferrozero_runtime::tensor::{View, ViewMut};

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
