//! `OptimizerOps::whole_step` on every device against the CPU taking the step by its parts
//! (`step_status`, `ClipRule::decide` on the host, then `optimizer_update` per tensor): the
//! status, the scale applied and every updated value bit for bit, for clipping that binds and
//! does not, a loss scale, and an overflow that skips the step (nothing written). On the CUDA
//! backend the scale is decided on the device (`clip_grad_scale`) and every tensor is updated
//! in one launch reading the bf16 gradients as they are.

mod device_common;

use device_common::{cpu, get, rand, Dev};
use ferrozero_offload::optim::{AdamHyper, WeightDecay};
use ferrozero_runtime::backend::{ClipRule, GradView, StepStatus, StepTensor, UpdateRule};
use ferrozero_runtime::tensor::{BufRef, DType, FlatBuf, Storage, View, ViewMut};

const LENS: [usize; 3] = [1027, 5, 4099];

/// One run's state: per tensor parameters, gradient (bf16, as the engine accumulates it),
/// moments and bf16 copy; and two losses.
struct State {
    p: Vec<Storage>,
    g: Vec<Storage>,
    m: Vec<Storage>,
    v: Vec<Storage>,
    lp: Vec<Storage>,
    losses: Vec<Storage>,
}

fn state(d: &Dev, grad_mag: f32, poison: bool) -> State {
    let up = |vals: &[f32], dt: DType| {
        let mut b = FlatBuf::zeros(dt, vals.len());
        b.store_f32(0, vals);
        d.be.upload(b.as_ref()).expect("upload")
    };
    let mut s = State {
        p: vec![],
        g: vec![],
        m: vec![],
        v: vec![],
        lp: vec![],
        losses: vec![],
    };
    for (i, &n) in LENS.iter().enumerate() {
        let seed = 10 * i as u64;
        let mut g: Vec<f32> = rand(n, seed + 1).iter().map(|x| x * grad_mag).collect();
        if poison && i == 1 {
            g[3] = f32::INFINITY;
        }
        s.p.push(d.put_f32(&rand(n, seed + 2)));
        s.g.push(up(&g, DType::Bf16));
        s.m.push(d.put_f32(&rand(n, seed + 3)));
        let v: Vec<f32> = rand(n, seed + 4).iter().map(|x| x.abs()).collect();
        s.v.push(d.put_f32(&v));
        s.lp.push(d.be.zeros(DType::Bf16, n).expect("zeros"));
    }
    // Losses in the activation dtype, as the model's head leaves them.
    s.losses = vec![d.put(&[2.5]), d.put(&[3.25])];
    s
}

/// The losses, the gradients the norm reads, and the tensors the step updates.
type Views<'a> = (Vec<View<'a>>, Vec<GradView<'a>>, Vec<StepTensor<'a>>);

fn tensors(s: &mut State) -> Views<'_> {
    let State {
        p,
        g,
        m,
        v,
        lp,
        losses,
    } = s;
    let losses = losses.iter().map(Storage::view).collect();
    let norms = g.iter().map(|g| g.view().into()).collect();
    let ts = p
        .iter_mut()
        .zip(g.iter())
        .zip(m.iter_mut().zip(v.iter_mut()))
        .zip(lp.iter_mut())
        .map(|(((p, g), (m, v)), lp)| StepTensor {
            params: p.view_mut(),
            grads: g.view().into(),
            m: m.view_mut(),
            v: v.view_mut(),
            lp: Some(lp.view_mut()),
        })
        .collect();
    (losses, norms, ts)
}

/// The CPU's step by its parts.
fn by_parts(rule: &UpdateRule, step: u64, clip: ClipRule, s: &mut State) -> StepStatus {
    let c = cpu();
    let losses: Vec<_> = s.losses.iter().map(Storage::view).collect();
    let grads: Vec<_> = s.g.iter().map(|g| g.view().into()).collect();
    let mut st = c.be.step_status(&losses, &grads).expect("status");
    let scale = clip.decide(&st.sum_squares);
    if let Some(gs) = scale {
        let (_, _, ts) = tensors(s);
        for t in ts {
            c.be.optimizer_update(rule, step, gs, t.params, t.grads, t.m, t.v, t.lp)
                .expect("update");
        }
    }
    st.grad_scale = Some(scale.unwrap_or(f32::NAN));
    st
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn whole_step(d: &Dev) {
    let c = cpu();
    let rule = UpdateRule::Adam(AdamHyper {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        decay: WeightDecay::Decoupled,
        bias_correction: true,
    });
    // (loss scale, clipping, gradient magnitude, an Inf in a gradient)
    let cases = [
        (1.0, 1.0, 1.0, false),    // the norm (~40) is clipped to 1
        (1.0, 1.0, 1e-3, false),   // below the bound
        (1.0, 0.0, 1.0, false),    // no clipping
        (256.0, 1.0, 16.0, false), // loss-scaled gradients, clipped after unscaling
        (256.0, 1.0, 1.0, true),   // overflow: skipped
    ];
    for (step, (loss_scale, clipping, mag, poison)) in cases.into_iter().enumerate() {
        let step = step as u64 + 1;
        let clip = ClipRule {
            loss_scale,
            clipping,
        };
        let what = format!("{}: {clip:?}, gradients x{mag}, overflow {poison}", d.name);
        let mut ds = state(d, mag, poison);
        let before: Vec<Vec<f32>> = ds.p.iter().map(get).collect();
        let st = {
            let (losses, norms, ts) = tensors(&mut ds);
            d.be.whole_step((&rule, step, clip), &losses, &norms, ts)
                .expect("whole step")
        };
        let mut cs = state(&c, mag, poison);
        let want = by_parts(&rule, step, clip, &mut cs);
        let gs = st.grad_scale.expect("the scale applied");
        assert_eq!(
            gs.to_bits(),
            want.grad_scale.expect("scale").to_bits(),
            "{what}: scale {gs} vs {:?}",
            want.grad_scale
        );
        assert_eq!(gs.is_nan(), poison, "{what}: skipped exactly on overflow");
        assert_eq!(bits(&st.losses), bits(&want.losses), "{what}: losses");
        let sums = |s: &StepStatus| {
            s.sum_squares
                .iter()
                .map(|x| x.to_bits())
                .collect::<Vec<_>>()
        };
        assert_eq!(sums(&st), sums(&want), "{what}: sums of squares");
        for (i, before) in before.iter().enumerate() {
            let t = format!("{what}, tensor {i}");
            assert_eq!(
                bits(&get(&ds.p[i])),
                bits(&get(&cs.p[i])),
                "{t}: parameters"
            );
            assert_eq!(
                bits(&get(&ds.m[i])),
                bits(&get(&cs.m[i])),
                "{t}: first moment"
            );
            assert_eq!(
                bits(&get(&ds.v[i])),
                bits(&get(&cs.v[i])),
                "{t}: second moment"
            );
            assert_eq!(
                bits(&get(&ds.lp[i])),
                bits(&get(&cs.lp[i])),
                "{t}: bf16 copy"
            );
            if poison {
                assert_eq!(bits(&get(&ds.p[i])), bits(before), "{t}: untouched");
            } else {
                assert_ne!(bits(&get(&ds.p[i])), bits(before), "{t}: updated");
            }
        }
    }
}
test_device!(whole_step);

/// A whole step refuses a gradient it cannot read where it decides: on the CUDA backend a
/// host gradient is an error naming it, not a scale decided from garbage.
fn whole_step_refuses_foreign_gradients(d: &Dev) {
    if d.name == "cpu" {
        return;
    }
    let rule = UpdateRule::Adam(AdamHyper {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.0,
        decay: WeightDecay::Decoupled,
        bias_correction: true,
    });
    let host = [1.0f32, 2.0];
    let norms = [View::Host(BufRef::F32(&host)).into()];
    let clip = ClipRule {
        loss_scale: 1.0,
        clipping: 1.0,
    };
    let (mut p, g, mut m, mut v) = (
        d.put_f32(&[0.0; 2]),
        d.put_f32(&host),
        d.put_f32(&[0.0; 2]),
        d.put_f32(&[0.0; 2]),
    );
    let t = StepTensor {
        params: p.view_mut(),
        grads: g.view().into(),
        m: m.view_mut(),
        v: v.view_mut(),
        lp: None::<ViewMut<'_>>,
    };
    let e =
        d.be.whole_step((&rule, 1, clip), &[], &norms, vec![t])
            .expect_err("a host gradient on the device");
    assert!(e.to_string().contains("a gradient of the norm"), "{e}");
    assert_eq!(get(&p), vec![0.0; 2], "nothing was updated");
}
test_device!(whole_step_refuses_foreign_gradients);
