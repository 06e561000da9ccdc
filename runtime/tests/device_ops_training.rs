//! The loss head and the optimizer step on every device against the CPU backend (one body per
//! op family, run per device by `test_device!`; the optimizer step bit for bit). The other op
//! families are in `device_ops` and `device_ops_layers`.

mod device_common;

use device_common::{assert_close, cpu, get, rand, tol_k, Dev, Tol};
use ferrozero_offload::optim::{AdamHyper, LionHyper, SgdHyper, WeightDecay};
use ferrozero_runtime::backend::{HeadShape, UpdateRule};
use ferrozero_runtime::nn::IGNORE_INDEX;
use ferrozero_runtime::tensor::{DType, FlatBuf, Storage, View, ViewMut};

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
        Some(ddw.view_mut()),
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
        Some(ViewMut::from(&mut wdw[..])),
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
