//! Pointwise kernels, chunked over the current rayon pool.

use rayon::prelude::*;

use super::simd::simd_kernel;
use super::{expect_len, f32_in, f32_out, math, CpuBackend};
use crate::backend::rng;
use crate::backend::{check, ElementwiseOps};
use crate::tensor::{View, ViewMut};
use crate::Result;

const CHUNK: usize = 16 * 1024;
const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const GELU_C: f32 = 0.044_715;

#[inline(always)]
fn gelu(x: f32) -> f32 {
    0.5 * x * (1.0 + math::tanh(SQRT_2_OVER_PI * (x + GELU_C * x * x * x)))
}

#[inline(always)]
fn gelu_grad(x: f32) -> f32 {
    let u = SQRT_2_OVER_PI * (x + GELU_C * x * x * x);
    let t = math::tanh(u);
    let du = SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_C * x * x);
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du
}

#[inline(always)]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + math::exp(-x))
}

simd_kernel! {
    fn gelu_chunk(y: &mut [f32], x: &[f32]) {
        y.iter_mut().zip(x).for_each(|(y, &x)| *y = gelu(x));
    }
}

simd_kernel! {
    fn gelu_grad_chunk(dx: &mut [f32], x: &[f32], dy: &[f32]) {
        for ((d, &x), &g) in dx.iter_mut().zip(x).zip(dy) {
            *d = g * gelu_grad(x);
        }
    }
}

simd_kernel! {
    fn swiglu_chunk(y: &mut [f32], gate: &[f32], up: &[f32]) {
        for ((y, &g), &u) in y.iter_mut().zip(gate).zip(up) {
            *y = g * sigmoid(g) * u;
        }
    }
}

simd_kernel! {
    fn swiglu_grad_chunk(dg: &mut [f32], du: &mut [f32], g: &[f32], u: &[f32], dy: &[f32]) {
        let n = dg.len();
        let (du, g, u, dy) = (&mut du[..n], &g[..n], &u[..n], &dy[..n]);
        for i in 0..n {
            let s = sigmoid(g[i]);
            let silu = g[i] * s;
            du[i] = dy[i] * silu;
            dg[i] = dy[i] * u[i] * s * (1.0 + g[i] * (1.0 - s));
        }
    }
}

simd_kernel! {
    /// `d += s` element-wise.
    pub(super) fn add_chunk(d: &mut [f32], s: &[f32]) {
        d.iter_mut().zip(s).for_each(|(d, s)| *d += s);
    }
}

simd_kernel! {
    /// `acc += row[j0..j0 + acc.len()]` for every row of `m` in order.
    fn add_column_block(acc: &mut [f32], m: &[f32], cols: usize, j0: usize) {
        let w = acc.len();
        for row in m.chunks_exact(cols) {
            acc.iter_mut().zip(&row[j0..j0 + w]).for_each(|(a, v)| *a += v);
        }
    }
}

impl ElementwiseOps for CpuBackend {
    fn gelu_forward(&self, x: View<'_>, y: ViewMut<'_>) -> Result<()> {
        let (x, y) = (f32_in("gelu", "x", x)?, f32_out("gelu", "y", y)?);
        expect_len("gelu", "y", y.len(), x.len())?;
        y.par_chunks_mut(CHUNK)
            .zip(x.par_chunks(CHUNK))
            .for_each(|(y, x)| gelu_chunk(y, x));
        Ok(())
    }

    fn gelu_backward(&self, x: View<'_>, dy: View<'_>, dx: ViewMut<'_>) -> Result<()> {
        const OP: &str = "gelu backward";
        let (x, dy, dx) = (
            f32_in(OP, "x", x)?,
            f32_in(OP, "dy", dy)?,
            f32_out(OP, "dx", dx)?,
        );
        check::same_len(OP, x.len(), &[("dy", dy.len()), ("dx", dx.len())])?;
        dx.par_chunks_mut(CHUNK)
            .zip(x.par_chunks(CHUNK).zip(dy.par_chunks(CHUNK)))
            .for_each(|(dx, (x, dy))| gelu_grad_chunk(dx, x, dy));
        Ok(())
    }

    fn swiglu_forward(&self, gate: View<'_>, up: View<'_>, y: ViewMut<'_>) -> Result<()> {
        const OP: &str = "swiglu";
        let (gate, up) = (f32_in(OP, "gate", gate)?, f32_in(OP, "up", up)?);
        let y = f32_out(OP, "y", y)?;
        check::same_len(OP, gate.len(), &[("up", up.len()), ("y", y.len())])?;
        y.par_chunks_mut(CHUNK)
            .zip(gate.par_chunks(CHUNK).zip(up.par_chunks(CHUNK)))
            .for_each(|(y, (g, u))| swiglu_chunk(y, g, u));
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
        let lens = [
            ("up", up.len()),
            ("dy", dy.len()),
            ("dgate", dgate.len()),
            ("dup", dup.len()),
        ];
        check::same_len(OP, gate.len(), &lens)?;
        dgate
            .par_chunks_mut(CHUNK)
            .zip(dup.par_chunks_mut(CHUNK))
            .zip(gate.par_chunks(CHUNK).zip(up.par_chunks(CHUNK)))
            .zip(dy.par_chunks(CHUNK))
            .for_each(|(((dg, du), (g, u)), dy)| swiglu_grad_chunk(dg, du, g, u, dy));
        Ok(())
    }

    fn add_assign(&self, dst: ViewMut<'_>, src: View<'_>) -> Result<()> {
        let (dst, src) = (f32_out("add", "dst", dst)?, f32_in("add", "src", src)?);
        expect_len("add", "src", src.len(), dst.len())?;
        dst.par_chunks_mut(CHUNK)
            .zip(src.par_chunks(CHUNK))
            .for_each(|(d, s)| add_chunk(d, s));
        Ok(())
    }

    fn dropout(&self, seed: u64, offset: u64, p: f32, x: ViewMut<'_>) -> Result<()> {
        let x = f32_out("dropout", "x", x)?;
        if p <= 0.0 {
            return Ok(());
        }
        let scale = 1.0 / (1.0 - p);
        x.par_chunks_mut(CHUNK).enumerate().for_each(|(c, x)| {
            let base = offset.wrapping_add((c * CHUNK) as u64);
            for (i, v) in x.iter_mut().enumerate() {
                let keep = rng::uniform_f32(seed, base.wrapping_add(i as u64)) >= p;
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
        check::whole_rows("sum_rows", m.len(), cols)?;
        // Parallel over column blocks, serial over rows: a fixed summation order.
        const BLOCK: usize = 64;
        acc.par_chunks_mut(BLOCK)
            .enumerate()
            .for_each(|(c, a)| add_column_block(a, m, cols, c * BLOCK));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_values::same_bits;
    use super::*;

    /// Values across GELU's and the sigmoid's interesting range, both signs, with a tail that
    /// is not a multiple of any vector width.
    fn inputs(n: usize, salt: u32) -> Vec<f32> {
        super::super::test_values::hashed(n, salt, 13, 24.0)
    }

    #[test]
    fn dispatched_kernels_give_the_scalar_bits() {
        let n = 1003;
        let (x, u, dy) = (inputs(n, 1), inputs(n, 2), inputs(n, 3));
        let mut y = vec![0.0; n];
        gelu_chunk(&mut y, &x);
        let want: Vec<f32> = x.iter().map(|&v| gelu(v)).collect();
        assert!(same_bits(&y, &want), "gelu");
        gelu_grad_chunk(&mut y, &x, &dy);
        let want: Vec<f32> = x.iter().zip(&dy).map(|(&v, &g)| g * gelu_grad(v)).collect();
        assert!(same_bits(&y, &want), "gelu grad");
        swiglu_chunk(&mut y, &x, &u);
        let want: Vec<f32> = x
            .iter()
            .zip(&u)
            .map(|(&g, &u)| g * sigmoid(g) * u)
            .collect();
        assert!(same_bits(&y, &want), "swiglu");
        let mut acc = vec![0.5f32; 7];
        add_column_block(&mut acc, &x[..1000], 20, 9);
        let mut want = vec![0.5f32; 7];
        for row in x[..1000].chunks(20) {
            for (j, w) in want.iter_mut().enumerate() {
                *w += row[9 + j];
            }
        }
        assert!(same_bits(&acc, &want), "column sums");
    }
}
