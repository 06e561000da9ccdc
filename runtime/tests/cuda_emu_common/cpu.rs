//! Every call to the CPU backend and the CPU-side helpers in one place, with plain slices
//! wrapped into the backend's views here.

use ferrozero_runtime::backend::{cpu, Accumulate, HeadShape, Rope, Rotation};
use ferrozero_runtime::tensor::{FlatBuf, IdBuf, View, ViewMut};

fn v(x: &[f32]) -> View<'_> {
    View::from(x)
}

fn m(x: &mut [f32]) -> ViewMut<'_> {
    ViewMut::from(x)
}

fn ids(t: &[u32]) -> IdBuf {
    IdBuf::Host(t.iter().map(|&x| x as i32).collect())
}

pub fn gelu_forward(x: &[f32]) -> Vec<f32> {
    let mut y = vec![0.0; x.len()];
    cpu().gelu_forward(v(x), m(&mut y)).unwrap();
    y
}

pub fn gelu_backward(x: &[f32], dy: &[f32]) -> Vec<f32> {
    let mut dx = vec![0.0; x.len()];
    cpu().gelu_backward(v(x), v(dy), m(&mut dx)).unwrap();
    dx
}

pub fn swiglu_forward(gate: &[f32], up: &[f32]) -> Vec<f32> {
    let mut y = vec![0.0; gate.len()];
    cpu().swiglu_forward(v(gate), v(up), m(&mut y)).unwrap();
    y
}

/// (dgate, dup).
pub fn swiglu_backward(gate: &[f32], up: &[f32], dy: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let mut dg = vec![0.0; gate.len()];
    let mut du = vec![0.0; gate.len()];
    cpu()
        .swiglu_backward(v(gate), v(up), v(dy), m(&mut dg), m(&mut du))
        .unwrap();
    (dg, du)
}

pub fn add_assign(dst: &mut [f32], src: &[f32]) {
    cpu().add_assign(m(dst), v(src)).unwrap();
}

pub fn dropout(seed: u64, offset: u64, p: f32, x: &mut [f32]) {
    cpu().dropout(seed, offset, p, m(x)).unwrap();
}

/// (y, mean, rstd).
pub fn layernorm_forward(
    x: &[f32],
    gamma: &[f32],
    beta: &[f32],
    eps: f32,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let rows = x.len() / gamma.len();
    let (mut y, mut mean, mut rstd) = (vec![0.0; x.len()], vec![0.0; rows], vec![0.0; rows]);
    cpu()
        .layernorm_forward(
            v(x),
            v(gamma),
            v(beta),
            eps,
            m(&mut y),
            m(&mut mean),
            m(&mut rstd),
        )
        .unwrap();
    (y, mean, rstd)
}

/// dx; dgamma and dbeta accumulated.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward(
    x: &[f32],
    gamma: &[f32],
    mean: &[f32],
    rstd: &[f32],
    dy: &[f32],
    dgamma: &mut [f32],
    dbeta: &mut [f32],
) -> Vec<f32> {
    let mut dx = vec![0.0; x.len()];
    cpu()
        .layernorm_backward(
            v(x),
            v(gamma),
            v(mean),
            v(rstd),
            v(dy),
            m(&mut dx),
            m(dgamma),
            m(dbeta),
        )
        .unwrap();
    dx
}

/// (y, rstd).
pub fn rmsnorm_forward(x: &[f32], gamma: &[f32], eps: f32) -> (Vec<f32>, Vec<f32>) {
    let rows = x.len() / gamma.len();
    let (mut y, mut rstd) = (vec![0.0; x.len()], vec![0.0; rows]);
    cpu()
        .rmsnorm_forward(v(x), v(gamma), eps, m(&mut y), m(&mut rstd))
        .unwrap();
    (y, rstd)
}

/// dx; dgamma accumulated.
pub fn rmsnorm_backward(
    x: &[f32],
    gamma: &[f32],
    rstd: &[f32],
    dy: &[f32],
    dgamma: &mut [f32],
) -> Vec<f32> {
    let mut dx = vec![0.0; x.len()];
    cpu()
        .rmsnorm_backward(v(x), v(gamma), v(rstd), v(dy), m(&mut dx), m(dgamma))
        .unwrap();
    dx
}

#[allow(clippy::too_many_arguments)]
pub fn rope(
    x: &mut [f32],
    batch: usize,
    seq: usize,
    heads: usize,
    head_dim: usize,
    theta: f32,
    inverse: bool,
) {
    let dir = if inverse {
        Rotation::Inverse
    } else {
        Rotation::Forward
    };
    cpu()
        .rope(m(x), batch, seq, heads, head_dim, &Rope::plain(theta), dir)
        .unwrap();
}

/// `out (=|+=) table[tokens]`.
pub fn embedding_forward(tokens: &[u32], table: &[f32], dim: usize, out: &mut [f32], add: bool) {
    let acc = if add {
        Accumulate::Add
    } else {
        Accumulate::Overwrite
    };
    cpu()
        .embedding_forward(ids(tokens).ids(), v(table), dim, m(out), acc)
        .expect("tokens in range");
}

pub fn embedding_backward(tokens: &[u32], dout: &[f32], dim: usize, dtable: &mut [f32]) {
    cpu()
        .embedding_backward(ids(tokens).ids(), v(dout), dim, m(dtable))
        .unwrap();
}

/// The identity `[vocab, vocab]`: with it as the head's weight, its logits are its input.
fn eye(n: usize) -> Vec<f32> {
    let mut e = vec![0.0; n * n];
    (0..n).for_each(|i| e[i * n + i] = 1.0);
    e
}

/// (probabilities, sum of the losses), through the head's loss with an identity weight (the
/// product with it is exact).
pub fn cross_entropy_forward(logits: &[f32], vocab: usize, targets: &[i32]) -> (Vec<f32>, f64) {
    let s = HeadShape {
        rows: targets.len(),
        dim: vocab,
        vocab,
    };
    let t = IdBuf::Host(targets.to_vec());
    let w = eye(vocab);
    let out = cpu()
        .head_loss_forward(s, v(logits), v(&w), t.ids(), true)
        .expect("targets in range");
    let probs = out.saved.expect("kept").to_vec_f32().unwrap();
    let sum = out.loss.to_vec_f32().unwrap()[0];
    (probs, f64::from(sum))
}

/// dlogits from the logits (the CPU recomputes its probabilities).
pub fn cross_entropy_backward(logits: &[f32], vocab: usize, targets: &[i32], g: f32) -> Vec<f32> {
    let s = HeadShape {
        rows: targets.len(),
        dim: vocab,
        vocab,
    };
    let t = IdBuf::Host(targets.to_vec());
    let w = eye(vocab);
    let out = cpu()
        .head_loss_forward(s, v(logits), v(&w), t.ids(), true)
        .expect("targets in range");
    let (mut dx, mut dw) = (vec![0.0; logits.len()], vec![0.0; w.len()]);
    cpu()
        .head_loss_backward(
            s,
            v(logits),
            v(&w),
            t.ids(),
            out.saved.unwrap(),
            g,
            m(&mut dx),
            Some(m(&mut dw)),
        )
        .unwrap();
    dx
}

pub fn argmax_rows(x: &[f32], width: usize) -> Vec<u32> {
    cpu().argmax_rows(v(x), width).unwrap()
}

/// `acc[j] += Σ_i m[i, j]` (the bias gradient helper).
pub fn column_sums(mat: &[f32], cols: usize, acc: &mut [f32]) {
    cpu().sum_rows(v(mat), cols, m(acc)).unwrap();
}

/// Σ x² in f64 (the gradient norm's local part, in the CPU backend's blocked order).
pub fn sum_squares(x: &[f32]) -> f64 {
    FlatBuf::F32(x.to_vec()).sum_squares(0..x.len())
}
