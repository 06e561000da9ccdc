//! Pointwise kernels, chunked over the current rayon pool.

use rayon::prelude::*;

use super::{expect_len, f32_in, f32_out, math, CpuBackend};
use crate::backend::rng;
use crate::backend::ElementwiseOps;
use crate::tensor::{View, ViewMut};
use crate::Result;

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
    fn gelu_forward(&self, x: View<'_>, y: ViewMut<'_>) -> Result<()> {
        let (x, y) = (f32_in("gelu", "x", x)?, f32_out("gelu", "y", y)?);
        expect_len("gelu", "y", y.len(), x.len())?;
        y.par_chunks_mut(CHUNK)
            .zip(x.par_chunks(CHUNK))
            .for_each(|(y, x)| y.iter_mut().zip(x).for_each(|(y, &x)| *y = gelu(x)));
        Ok(())
    }

    fn gelu_backward(&self, x: View<'_>, dy: View<'_>, dx: ViewMut<'_>) -> Result<()> {
        const OP: &str = "gelu backward";
        let (x, dy, dx) = (
            f32_in(OP, "x", x)?,
            f32_in(OP, "dy", dy)?,
            f32_out(OP, "dx", dx)?,
        );
        expect_len(OP, "dy", dy.len(), x.len())?;
        expect_len(OP, "dx", dx.len(), x.len())?;
        dx.par_chunks_mut(CHUNK)
            .zip(x.par_chunks(CHUNK).zip(dy.par_chunks(CHUNK)))
            .for_each(|(dx, (x, dy))| {
                for ((d, &x), &g) in dx.iter_mut().zip(x).zip(dy) {
                    *d = g * gelu_grad(x);
                }
            });
        Ok(())
    }

    fn swiglu_forward(&self, gate: View<'_>, up: View<'_>, y: ViewMut<'_>) -> Result<()> {
        const OP: &str = "swiglu";
        let (gate, up) = (f32_in(OP, "gate", gate)?, f32_in(OP, "up", up)?);
        let y = f32_out(OP, "y", y)?;
        expect_len(OP, "up", up.len(), gate.len())?;
        expect_len(OP, "y", y.len(), gate.len())?;
        y.par_chunks_mut(CHUNK)
            .zip(gate.par_chunks(CHUNK).zip(up.par_chunks(CHUNK)))
            .for_each(|(y, (g, u))| {
                for ((y, &g), &u) in y.iter_mut().zip(g).zip(u) {
                    *y = g * sigmoid(g) * u;
                }
            });
        Ok(())
    }

    fn swiglu_backward(
        &self,
        gate: View<'_>,
        up: View<'_>,
        dy: View<'_>,
        dgate: ViewMut<'_>,
        dup: ViewMut<'_>,
    ) -> Result<()> {
        const OP: &str = "swiglu backward";
        let (gate, up, dy) = (
            f32_in(OP, "gate", gate)?,
            f32_in(OP, "up", up)?,
            f32_in(OP, "dy", dy)?,
        );
        let (dgate, dup) = (f32_out(OP, "dgate", dgate)?, f32_out(OP, "dup", dup)?);
        for (what, len) in [
            ("up", up.len()),
            ("dy", dy.len()),
            ("dgate", dgate.len()),
            ("dup", dup.len()),
        ] {
            expect_len(OP, what, len, gate.len())?;
        }
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
        Ok(())
    }

    fn add_assign(&self, dst: ViewMut<'_>, src: View<'_>) -> Result<()> {
        let (dst, src) = (f32_out("add", "dst", dst)?, f32_in("add", "src", src)?);
        expect_len("add", "src", src.len(), dst.len())?;
        dst.par_chunks_mut(CHUNK)
            .zip(src.par_chunks(CHUNK))
            .for_each(|(d, s)| d.iter_mut().zip(s).for_each(|(d, s)| *d += s));
        Ok(())
    }

    fn dropout(&self, seed: u64, p: f32, x: ViewMut<'_>) -> Result<()> {
        let x = f32_out("dropout", "x", x)?;
        if p <= 0.0 {
            return Ok(());
        }
        let scale = 1.0 / (1.0 - p);
        x.par_chunks_mut(CHUNK).enumerate().for_each(|(c, x)| {
            let base = (c * CHUNK) as u64;
            for (i, v) in x.iter_mut().enumerate() {
                let keep = rng::uniform_f32(seed, base + i as u64) >= p;
                *v = if keep { *v * scale } else { 0.0 };
            }
        });
        Ok(())
    }

    fn sum_rows(&self, m: View<'_>, cols: usize, acc: ViewMut<'_>) -> Result<()> {
        let (m, acc) = (
            f32_in("sum_rows", "m", m)?,
            f32_out("sum_rows", "acc", acc)?,
        );
        expect_len("sum_rows", "acc", acc.len(), cols)?;
        if cols == 0 || !m.len().is_multiple_of(cols) {
            return Err(crate::Error::Shape {
                op: "sum_rows",
                expected: format!("whole rows of {cols}"),
                got: format!("{} elements", m.len()),
            });
        }
        // Parallel over column blocks, serial over rows: a fixed summation order.
        const BLOCK: usize = 64;
        acc.par_chunks_mut(BLOCK).enumerate().for_each(|(c, a)| {
            let j0 = c * BLOCK;
            for row in m.chunks(cols) {
                let w = a.len();
                a.iter_mut()
                    .zip(&row[j0..j0 + w])
                    .for_each(|(a, v)| *a += v);
            }
        });
        Ok(())
    }
}
