//! Gradients read as the accumulator they stand for (`GradView::rounded`): at one micro-step
//! per step the engine hands the optimizer and the norm the f32 micro-step gradient instead of
//! casting it and adding it into a zeroed accumulator. On every device the sums of squares, the
//! whole step's decision (clipping, overflow) and the update must equal, bit for bit, what the
//! old path gives: the cast to the accumulator's dtype, `Storage::accumulate` into zeros, and
//! the accumulator read as stored. The values include -0.0 (the addition turns it +0.0, which
//! Adam's first moment shows when beta1 is 0), ties of the rounding, f16's overflow to infinity
//! and f32's largest value (infinite in bf16).

mod device_common;

use device_common::{get, rand, Dev};
use ferrozero_offload::optim::{AdamHyper, WeightDecay};
use ferrozero_runtime::backend::{ClipRule, GradView, StepTensor, UpdateRule};
use ferrozero_runtime::tensor::{DType, Storage};

/// Elements: three blocks of the device's sum of squares, a tail that is not a whole pack.
const N: usize = 3 * 4096 + 13;

/// Gradient values at `mag`, with the special ones planted; `poison` adds a value no
/// accumulator of `dtype` holds finitely.
fn grads(mag: f32, dtype: DType, poison: bool) -> Vec<f32> {
    let mut g: Vec<f32> = rand(N, 7).iter().map(|x| x * mag).collect();
    for (i, v) in [
        -0.0,
        0.0,
        -0.0,
        1.0 + f32::EPSILON,
        -(1.0 + 3.0 * f32::EPSILON),
    ]
    .into_iter()
    .enumerate()
    {
        g[i * 997] = v;
    }
    // A bf16 tie (1 + 2^-8 lies halfway between two bf16 values) and an f16 one.
    g[4001] = 1.0 + 1.0 / 256.0;
    g[4002] = 1.0 + 1.0 / 2048.0;
    if poison {
        g[9000] = match dtype {
            DType::F16 => 70_000.0,
            _ => f32::MAX,
        };
    }
    g
}

/// The old path on `d`: `micro` cast to `dtype` and added into a zeroed accumulator.
fn accumulated(d: &Dev, micro: &Storage, dtype: DType) -> Storage {
    let mut acc = d.be.zeros(dtype, N).expect("accumulator");
    let wire = if dtype == DType::F32 {
        micro.try_clone().expect("copy")
    } else {
        let mut w = d.be.buffer_uninit(dtype, N).expect("wire buffer");
        micro.cast_into(&mut w).expect("cast");
        w
    };
    acc.accumulate(0, &wire, N, &mut Vec::new())
        .expect("accumulate");
    acc
}

/// Parameters, moments and the low-precision copy of one update, fresh.
struct State {
    p: Storage,
    m: Storage,
    v: Storage,
    lp: Storage,
}

fn state(d: &Dev) -> State {
    // Negative first moments: with beta1 = 0, beta1 * m is -0.0 and the moment's new value
    // keeps the gradient's zero sign.
    let m: Vec<f32> = rand(N, 3).iter().map(|x| -x.abs() - 0.1).collect();
    State {
        p: d.put_f32(&rand(N, 1)),
        m: d.put_f32(&m),
        v: d.put_f32(&rand(N, 5).iter().map(|x| x.abs()).collect::<Vec<_>>()),
        lp: d.be.zeros(DType::Bf16, N).expect("lp"),
    }
}

fn bits32(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn snapshot(s: &State) -> [Vec<u32>; 4] {
    [
        bits32(&get(&s.p)),
        bits32(&get(&s.m)),
        bits32(&get(&s.v)),
        bits32(&get(&s.lp)),
    ]
}

/// A whole step over `g` (two tensors and norm ranges that split it unevenly).
fn whole_step(
    d: &Dev,
    rule: &UpdateRule,
    clip: ClipRule,
    g: GradView<'_>,
) -> (Vec<u64>, u32, [Vec<u32>; 4]) {
    let mut s = state(d);
    let cut = 4100;
    let st = {
        let (p0, p1) = s.p.view_mut().split_at(cut).expect("split");
        let (m0, m1) = s.m.view_mut().split_at(cut).expect("split");
        let (v0, v1) = s.v.view_mut().split_at(cut).expect("split");
        let (l0, l1) = s.lp.view_mut().split_at(cut).expect("split");
        let ts = vec![
            StepTensor {
                params: p0,
                grads: g.range(0..cut).expect("range"),
                m: m0,
                v: v0,
                lp: Some(l0),
            },
            StepTensor {
                params: p1,
                grads: g.range(cut..N).expect("range"),
                m: m1,
                v: v1,
                lp: Some(l1),
            },
        ];
        let norms = [
            g.range(0..5).expect("range"),
            g.range(5..4104).expect("range"),
            g.range(4104..N).expect("range"),
        ];
        d.be.whole_step((rule, 2, clip), &[], &norms, ts)
            .expect("whole step")
    };
    let sums = st.sum_squares.iter().map(|x| x.to_bits()).collect();
    let scale = st.grad_scale.expect("the scale applied").to_bits();
    (sums, scale, snapshot(&s))
}

fn adam(beta1: f32) -> UpdateRule {
    UpdateRule::Adam(AdamHyper {
        lr: 1e-3,
        beta1,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        decay: WeightDecay::Decoupled,
        bias_correction: true,
    })
}

fn rounded_read_equals_accumulator(d: &Dev) {
    // (accumulator dtype, loss scale, clipping, magnitude, poisoned, Adam's beta1)
    let cases = [
        (DType::Bf16, 1.0, 1.0, 1.0, false, 0.9), // clipping binds (norm ~ 60)
        (DType::Bf16, 1.0, 0.0, 1e-3, false, 0.0), // no clipping; zero signs reach m
        (DType::Bf16, 1.0, 1.0, 1.0, true, 0.9),  // f32::MAX is infinite in bf16: skipped
        (DType::F16, 1024.0, 1.0, 8.0, false, 0.0), // loss-scaled, clipped after unscaling
        (DType::F16, 1024.0, 1.0, 8.0, true, 0.9), // f16 overflow to infinity: skipped
        (DType::F32, 1.0, 1.0, 1.0, false, 0.0),  // f32: only -0.0 becomes +0.0
    ];
    for (dtype, loss_scale, clipping, mag, poison, beta1) in cases {
        let what = format!(
            "{}: {dtype:?} x{mag} scale {loss_scale} poison {poison} beta1 {beta1}",
            d.name
        );
        let clip = ClipRule {
            loss_scale,
            clipping,
        };
        let rule = adam(beta1);
        let micro = d.put_f32(&grads(mag, dtype, poison));
        let acc = accumulated(d, &micro, dtype);
        let want = whole_step(d, &rule, clip, acc.view().into());
        let got = whole_step(d, &rule, clip, GradView::rounded(micro.view(), dtype));
        assert_eq!(got.0, want.0, "{what}: sums of squares");
        assert_eq!(
            f32::from_bits(got.1).is_nan(),
            poison,
            "{what}: overflow skips the step"
        );
        assert_eq!(got.1, want.1, "{what}: the scale applied");
        for (k, name) in ["parameters", "first moment", "second moment", "bf16 copy"]
            .iter()
            .enumerate()
        {
            assert!(got.2[k] == want.2[k], "{what}: {name} differ");
        }
        // The same gradient through the status and the per-call update.
        let sums = |g: GradView<'_>| -> Vec<u64> {
            let st = d.be.step_status(&[], &[g, g.range(8..N).expect("range")]);
            let st = st.expect("status");
            st.sum_squares.iter().map(|x| x.to_bits()).collect()
        };
        let rounded = GradView::rounded(micro.view(), dtype);
        assert_eq!(sums(rounded), sums(acc.view().into()), "{what}: status");
        if !poison {
            let update = |g: GradView<'_>| {
                let mut s = state(d);
                let (p, m, v, lp) = (
                    s.p.view_mut(),
                    s.m.view_mut(),
                    s.v.view_mut(),
                    Some(s.lp.view_mut()),
                );
                d.be.optimizer_update(&rule, 1, 0.25, p, g, m, v, lp)
                    .expect("update");
                snapshot(&s)
            };
            let same = update(rounded) == update(acc.view().into());
            assert!(same, "{what}: optimizer_update");
        }
    }
}
test_device!(rounded_read_equals_accumulator);

/// Half-precision values stand only for their own dtype: anything else is refused by name.
fn half_values_read_as_another_dtype_are_refused(d: &Dev) {
    let g = d.be.zeros(DType::Bf16, 16).expect("gradient");
    let bad = GradView::rounded(g.view(), DType::F16);
    let err = d.be.step_status(&[], &[bad]).expect_err("bf16 read as f16");
    assert!(err.to_string().contains("cannot be read as F16"), "{err}");
    let mut s = state(d);
    let (p, m, v) = (s.p.view_mut(), s.m.view_mut(), s.v.view_mut());
    let (p, m, v) = (
        p.range(0..16).expect("range"),
        m.range(0..16).expect("range"),
        v.range(0..16).expect("range"),
    );
    let err =
        d.be.optimizer_update(&adam(0.9), 1, 1.0, p, bad, m, v, None)
            .expect_err("bf16 read as f16");
    assert!(err.to_string().contains("cannot be read as F16"), "{err}");
}
test_device!(half_values_read_as_another_dtype_are_refused);
