//! LAMB against DeepSpeed's `FusedLamb` formula: `fixtures/lamb/reference.json`, written by
//! `fixtures/gen_lamb_reference.py` (PyTorch), four tensors with fixed gradients over 20
//! steps in three hyper-parameter cases (defaults; weight decay, eps under the root, no bias
//! correction, a clamp that binds, a loss scale; every ratio clamped from below; a tensor
//! that starts at zero, whose first ratio is 1). The CPU backend's two passes run here as the
//! engine runs them, the last tensor cut into two runs whose partial sums are added in order.

use ferrozero_offload::optim::{lamb_coeff, LambHyper};
use ferrozero_runtime::backend::{CpuBackend, GradView, OptimizerOps};
use ferrozero_runtime::tensor::{BufMut, BufRef, View, ViewMut};
use serde_json::Value;

/// The largest difference allowed from the reference, weights and moments alike.
const TOL: f64 = 1e-6;

fn fixture() -> Value {
    let p = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/lamb/reference.json"
    );
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

fn hyper(c: &Value) -> (LambHyper, f32) {
    let f = |k: &str| c[k].as_f64().unwrap();
    let b = |k: &str| c[k].as_bool().unwrap();
    let hp = LambHyper {
        lr: f("lr") as f32,
        beta1: c["betas"][0].as_f64().unwrap() as f32,
        beta2: c["betas"][1].as_f64().unwrap() as f32,
        eps: f("eps") as f32,
        eps_inside_sqrt: b("eps_inside_sqrt"),
        weight_decay: f("weight_decay") as f32,
        max_coeff: f("max_coeff") as f32,
        min_coeff: f("min_coeff") as f32,
        bias_correction: b("bias_correction"),
    };
    // DeepSpeed divides the gradient by its scale; the engine multiplies by the inverse.
    (hp, 1.0 / f("scale") as f32)
}

/// Where each tensor is cut into runs (the last one in two, as a shard boundary cuts it).
fn runs(n: usize, last: bool) -> Vec<std::ops::Range<usize>> {
    let cut = if last { n / 2 } else { n };
    [0..cut, cut..n]
        .into_iter()
        .filter(|r| !r.is_empty())
        .collect()
}

struct State {
    w: Vec<Vec<f32>>,
    m: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

/// One step of every tensor: pass 1 over its runs, the ratio from the runs' sums added in
/// order, pass 2 over its runs. Returns the ratios.
fn step(s: &mut State, (hp, scale): (&LambHyper, f32), t: u64, grads: &[Vec<f32>]) -> Vec<f32> {
    let be = CpuBackend;
    let last = s.w.len() - 1;
    let mut coeffs = Vec::new();
    for (i, grad) in grads.iter().enumerate() {
        let (mut sw, mut su) = (0.0f64, 0.0f64);
        for r in runs(s.w[i].len(), i == last) {
            let p = View::Host(BufRef::F32(&s.w[i][r.clone()]));
            let g = GradView::exact(View::Host(BufRef::F32(&grad[r.clone()])));
            let m = ViewMut::Host(BufMut::F32(&mut s.m[i][r.clone()]));
            let v = ViewMut::Host(BufMut::F32(&mut s.v[i][r]));
            let (a, b) = be.lamb_moments(hp, scale, (p, g), m, v).unwrap();
            sw += a;
            su += b;
        }
        let c = lamb_coeff(hp, sw, su);
        for r in runs(s.w[i].len(), i == last) {
            let p = ViewMut::Host(BufMut::F32(&mut s.w[i][r.clone()]));
            let m = View::Host(BufRef::F32(&s.m[i][r.clone()]));
            let v = View::Host(BufRef::F32(&s.v[i][r]));
            be.lamb_apply((hp, t, c), p, (m, v), None).unwrap();
        }
        coeffs.push(c);
    }
    coeffs
}

fn max_diff(ours: &[Vec<f32>], theirs: &Value) -> f64 {
    let mut worst = 0.0f64;
    for (a, b) in ours.iter().zip(theirs.as_array().unwrap()) {
        for (x, y) in a.iter().zip(floats(b)) {
            worst = worst.max((f64::from(*x) - f64::from(y)).abs());
        }
    }
    worst
}

#[test]
fn matches_deepspeed_fused_lamb_reference() {
    let fx = fixture();
    let steps = fx["steps"].as_u64().unwrap();
    for case in fx["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let (hp, scale) = hyper(case);
        let init: Vec<Vec<f32>> = fx["initial"]
            .as_array()
            .unwrap()
            .iter()
            .map(floats)
            .collect();
        let mut s = State {
            m: init.iter().map(|w| vec![0.0; w.len()]).collect(),
            v: init.iter().map(|w| vec![0.0; w.len()]).collect(),
            w: init,
        };
        let mut worst_coeff = 0.0f64;
        for t in 1..=steps {
            let grads: Vec<Vec<f32>> = fx["grads"][(t - 1) as usize]
                .as_array()
                .unwrap()
                .iter()
                .map(floats)
                .collect();
            let coeffs = step(&mut s, (&hp, scale), t, &grads);
            let want = floats(&case["coeffs"][(t - 1) as usize]);
            for (c, w) in coeffs.iter().zip(&want) {
                worst_coeff = worst_coeff.max((f64::from(*c) - f64::from(*w)).abs());
            }
        }
        let dw = max_diff(&s.w, &case["weights"]);
        let dm = max_diff(&s.m, &case["m"]);
        let dv = max_diff(&s.v, &case["v"]);
        println!("{name}: max |dw| {dw:e}, |dm| {dm:e}, |dv| {dv:e}, |dcoeff| {worst_coeff:e}");
        assert!(dw <= TOL, "{name}: weights differ by {dw:e}");
        assert!(
            dm <= TOL && dv <= TOL,
            "{name}: moments differ ({dm:e}, {dv:e})"
        );
        assert!(
            worst_coeff <= TOL,
            "{name}: trust ratios differ by {worst_coeff:e}"
        );
    }
}

#[test]
fn a_tensor_cut_anywhere_gives_the_same_bits() {
    // Pass 2 is element-wise: a run updated alone equals the same elements of the whole.
    let hp = hyper(&fixture()["cases"][1]).0;
    let n = 200_000;
    let w0: Vec<f32> = (0..n).map(|i| ((i as f32) * 0.001).sin()).collect();
    let m: Vec<f32> = (0..n).map(|i| ((i as f32) * 0.002).cos() * 1e-2).collect();
    let v: Vec<f32> = (0..n)
        .map(|i| ((i as f32) * 0.003).sin().abs() * 1e-4)
        .collect();
    let be = CpuBackend;
    let apply = |w: &mut [f32], r: std::ops::Range<usize>| {
        be.lamb_apply(
            (&hp, 3, 0.7),
            ViewMut::Host(BufMut::F32(&mut w[r.clone()])),
            (
                View::Host(BufRef::F32(&m[r.clone()])),
                View::Host(BufRef::F32(&v[r])),
            ),
            None,
        )
        .unwrap()
    };
    let mut whole = w0.clone();
    apply(&mut whole, 0..n);
    let mut cut = w0;
    apply(&mut cut, 0..77_777);
    apply(&mut cut, 77_777..n);
    assert!(whole
        .iter()
        .zip(&cut)
        .all(|(a, b)| a.to_bits() == b.to_bits()));
}
