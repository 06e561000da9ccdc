//! Pointwise kernels, chunked over the current rayon pool.

use rayon::prelude::*;

use super::{math, CpuBackend};
use crate::backend::rng;
use crate::backend::ElementwiseOps;

const CHUNK: usize = 16 * 1024;
const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const GELU_C: f32 = 0.044_715;

#[inline]
fn gelu(x: f32) -> f32 {
    0.5 * x * (1.0 + math::tanh(SQRT_2_OVER_PI * (x + GELU_C * x * x * x)))
}

#[inline]
fn gelu_grad(x: f32) -> f32 {
    let u = SQRT_2_OVER_PI * (x + GELU_C * x * x * x);
    let t = math::tanh(u);
    let du = SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_C * x * x);
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du
}

#[inline]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + math::exp(-x))
}

impl ElementwiseOps for CpuBackend {
    fn gelu_forward(&self, x: &[f32], y: &mut [f32]) {
        y.par_chunks_mut(CHUNK)
            .zip(x.par_chunks(CHUNK))
            .for_each(|(y, x)| y.iter_mut().zip(x).for_each(|(y, &x)| *y = gelu(x)));
    }

    fn gelu_backward(&self, x: &[f32], dy: &[f32], dx: &mut [f32]) {
        dx.par_chunks_mut(CHUNK)
            .zip(x.par_chunks(CHUNK).zip(dy.par_chunks(CHUNK)))
            .for_each(|(dx, (x, dy))| {
                for ((d, &x), &g) in dx.iter_mut().zip(x).zip(dy) {
                    *d = g * gelu_grad(x);
                }
            });
    }

    fn swiglu_forward(&self, gate: &[f32], up: &[f32], y: &mut [f32]) {
        y.par_chunks_mut(CHUNK)
            .zip(gate.par_chunks(CHUNK).zip(up.par_chunks(CHUNK)))
            .for_each(|(y, (g, u))| {
                for ((y, &g), &u) in y.iter_mut().zip(g).zip(u) {
                    *y = g * sigmoid(g) * u;
                }
            });
    }

    fn swiglu_backward(
        &self,
        gate: &[f32],
        up: &[f32],
        dy: &[f32],
        dgate: &mut [f32],
        dup: &mut [f32],
    ) {
        dgate
            .par_chunks_mut(CHUNK)
            .zip(dup.par_chunks_mut(CHUNK))
            .zip(gate.par_chunks(CHUNK).zip(up.par_chunks(CHUNK)))
            .zip(dy.par_chunks(CHUNK))
            .for_each(|(((dg, du), (g, u)), dy)| {
                for i in 0..dg.len() {
                    let s = sigmoid(g[i]);
                    let silu = g[i] * s;
                    du[i] = dy[i] * silu;
                    dg[i] = dy[i] * u[i] * s * (1.0 + g[i] * (1.0 - s));
                }
            });
    }

    fn add_assign(&self, dst: &mut [f32], src: &[f32]) {
        dst.par_chunks_mut(CHUNK)
            .zip(src.par_chunks(CHUNK))
            .for_each(|(d, s)| d.iter_mut().zip(s).for_each(|(d, s)| *d += s));
    }

    fn dropout(&self, seed: u64, p: f32, x: &mut [f32]) {
        if p <= 0.0 {
            return;
        }
        let scale = 1.0 / (1.0 - p);
        x.par_chunks_mut(CHUNK).enumerate().for_each(|(c, x)| {
            let base = (c * CHUNK) as u64;
            for (i, v) in x.iter_mut().enumerate() {
                let keep = rng::uniform_f32(seed, base + i as u64) >= p;
                *v = if keep { *v * scale } else { 0.0 };
            }
        });
    }
}
