//! Every call to the CPU backend and the CPU-side helpers in one place, with plain slices:
//! the backend traits' signatures are about to change (slices become device views), and then
//! only these few lines need adapting.

use ferrozero_runtime::backend::{cpu, Accumulate, Rotation};
use ferrozero_runtime::tensor::FlatBuf;

pub fn gelu_forward(x: &[f32]) -> Vec<f32> {
    let mut y = vec![0.0; x.len()];
    cpu().gelu_forward(x, &mut y);
    y
}

pub fn gelu_backward(x: &[f32], dy: &[f32]) -> Vec<f32> {
    let mut dx = vec![0.0; x.len()];
    cpu().gelu_backward(x, dy, &mut dx);
    dx
}

pub fn swiglu_forward(gate: &[f32], up: &[f32]) -> Vec<f32> {
    let mut y = vec![0.0; gate.len()];
    cpu().swiglu_forward(gate, up, &mut y);
    y
}

/// (dgate, dup).
pub fn swiglu_backward(gate: &[f32], up: &[f32], dy: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let mut dg = vec![0.0; gate.len()];
    let mut du = vec![0.0; gate.len()];
    cpu().swiglu_backward(gate, up, dy, &mut dg, &mut du);
    (dg, du)
}

pub fn add_assign(dst: &mut [f32], src: &[f32]) {
    cpu().add_assign(dst, src);
}

pub fn dropout(seed: u64, p: f32, x: &mut [f32]) {
    cpu().dropout(seed, p, x);
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
    cpu().layernorm_forward(x, gamma, beta, eps, &mut y, &mut mean, &mut rstd);
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
    cpu().layernorm_backward(x, gamma, mean, rstd, dy, &mut dx, dgamma, dbeta);
    dx
}

/// (y, rstd).
pub fn rmsnorm_forward(x: &[f32], gamma: &[f32], eps: f32) -> (Vec<f32>, Vec<f32>) {
    let rows = x.len() / gamma.len();
    let (mut y, mut rstd) = (vec![0.0; x.len()], vec![0.0; rows]);
    cpu().rmsnorm_forward(x, gamma, eps, &mut y, &mut rstd);
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
    cpu().rmsnorm_backward(x, gamma, rstd, dy, &mut dx, dgamma);
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
    cpu().rope(x, batch, seq, heads, head_dim, theta, dir);
}

/// `out (=|+=) table[tokens]`.
pub fn embedding_forward(tokens: &[u32], table: &[f32], dim: usize, out: &mut [f32], add: bool) {
    let acc = if add {
        Accumulate::Add
    } else {
        Accumulate::Overwrite
    };
    cpu()
        .embedding_forward(tokens, table, dim, out, acc)
        .expect("tokens in range");
}

pub fn embedding_backward(tokens: &[u32], dout: &[f32], dim: usize, dtable: &mut [f32]) {
    cpu().embedding_backward(tokens, dout, dim, dtable);
}

/// (probabilities, sum of the losses).
pub fn cross_entropy_forward(logits: &[f32], vocab: usize, targets: &[i32]) -> (Vec<f32>, f64) {
    let mut probs = logits.to_vec();
    let sum = cpu()
        .cross_entropy_forward(&mut probs, vocab, targets)
        .expect("targets in range");
    (probs, sum)
}

/// dlogits from the forward's probabilities.
pub fn cross_entropy_backward(probs: &[f32], vocab: usize, targets: &[i32], g: f32) -> Vec<f32> {
    let mut d = probs.to_vec();
    cpu().cross_entropy_backward(&mut d, vocab, targets, g);
    d
}

pub fn argmax_rows(x: &[f32], width: usize) -> Vec<u32> {
    ferrozero_runtime::nn::module::argmax_rows(x, width)
}

/// `acc[j] += Σ_i m[i, j]` (the bias gradient helper).
pub fn column_sums(m: &[f32], cols: usize, acc: &mut [f32]) {
    ferrozero_runtime::nn::linear::column_sums(m, cols, acc);
}

/// Σ x² in f64, index order (the gradient norm's local part).
pub fn sum_squares(x: &[f32]) -> f64 {
    FlatBuf::F32(x.to_vec()).sum_squares(0..x.len(), &mut Vec::new())
}
