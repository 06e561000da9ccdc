//! Every backend operation on every device against the CPU backend (one body per op family,
//! run per device by `test_device!`), with the tolerances `Dev::tol` states per dtype; the
//! operations promised bit-exact (casts, dropout masks) are compared bit for bit. This file:
//! products, elementwise operations, storage operations, the step's status and attention;
//! `device_ops_layers` has norms, rotary embeddings and embeddings, `device_ops_training`
//! the loss head and the optimizer step.

mod attention_common;
mod device_common;

use device_common::{assert_close, cpu, get, rand, tol_k, Dev, Tol};
use ferrozero_runtime::backend::{Epilogue, GradView, MatmulShape, Transpose};
use ferrozero_runtime::tensor::{DType, FlatBuf, Storage, View, ViewMut};

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
    let offset = (5 << 33) + 11;
    d.be.dropout(42, offset, 0.3, dd.view_mut()).unwrap();
    let mut wd = ones.clone();
    c.be.dropout(42, offset, 0.3, ViewMut::from(&mut wd[..]))
        .unwrap();
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
