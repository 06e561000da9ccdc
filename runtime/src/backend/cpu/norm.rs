//! LayerNorm and RMSNorm over rows. Parameter gradients are reduced over fixed row blocks and
//! summed in block order, so results do not depend on the number of threads.

use rayon::prelude::*;

use super::simd::simd_kernel;
use super::{f32_in, f32_out, CpuBackend};
use crate::backend::{check, ElementwiseOps, NormOps};
use crate::tensor::{View, ViewMut};
use crate::Result;

/// Rows per block of the parameter-gradient reduction (fixed for determinism).
const ROW_BLOCK: usize = 32;

/// Sums per-block partial vectors (each `width` long) into `acc`, in block order.
fn reduce_blocks(partials: Vec<Vec<f32>>, acc: &mut [f32]) {
    for p in partials {
        super::elementwise::add_chunk(acc, &p);
    }
}

simd_kernel! {
    /// One LayerNorm row: writes `y` and returns the row's mean and reciprocal std.
    fn layernorm_row(y: &mut [f32], x: &[f32], gamma: &[f32], beta: &[f32], eps: f32) -> (f32, f32) {
        let d = gamma.len();
        let (y, x, beta) = (&mut y[..d], &x[..d], &beta[..d]);
        let mu = x.iter().sum::<f32>() / d as f32;
        let var = x.iter().map(|v| (v - mu) * (v - mu)).sum::<f32>() / d as f32;
        let rs = 1.0 / (var + eps).sqrt();
        for i in 0..d {
            y[i] = (x[i] - mu) * rs * gamma[i] + beta[i];
        }
        (mu, rs)
    }
}

simd_kernel! {
    /// One LayerNorm backward row: writes `dx` and adds the row's terms to `dg` and `db`.
    /// The two row sums are ordered chains in their own loop, so the element-wise loops
    /// around them vectorise (each sum's order is the same as in one fused loop).
    #[allow(clippy::too_many_arguments)]
    fn layernorm_backward_row(
        dx: &mut [f32],
        x: &[f32],
        dy: &[f32],
        gamma: &[f32],
        (mu, rs): (f32, f32),
        dg: &mut [f32],
        db: &mut [f32],
    ) {
        let d = gamma.len();
        let (dx, x, dy, dg, db) = (&mut dx[..d], &x[..d], &dy[..d], &mut dg[..d], &mut db[..d]);
        let mut s1 = 0.0f32;
        let mut s2 = 0.0f32;
        for i in 0..d {
            let xh = (x[i] - mu) * rs;
            let g = dy[i] * gamma[i];
            s1 += g;
            s2 += g * xh;
        }
        for i in 0..d {
            let xh = (x[i] - mu) * rs;
            dg[i] += dy[i] * xh;
            db[i] += dy[i];
        }
        let (m1, m2) = (s1 / d as f32, s2 / d as f32);
        for i in 0..d {
            let xh = (x[i] - mu) * rs;
            dx[i] = rs * (dy[i] * gamma[i] - m1 - xh * m2);
        }
    }
}

simd_kernel! {
    /// One RMSNorm row: writes `y` and returns the row's reciprocal RMS.
    fn rmsnorm_row(y: &mut [f32], x: &[f32], gamma: &[f32], eps: f32) -> f32 {
        let d = gamma.len();
        let (y, x) = (&mut y[..d], &x[..d]);
        let ms = x.iter().map(|v| v * v).sum::<f32>() / d as f32;
        let rs = 1.0 / (ms + eps).sqrt();
        for i in 0..d {
            y[i] = x[i] * rs * gamma[i];
        }
        rs
    }
}

simd_kernel! {
    /// One RMSNorm backward row: writes `dx` and adds the row's terms to `dg`.
    fn rmsnorm_backward_row(dx: &mut [f32], x: &[f32], dy: &[f32], gamma: &[f32], rs: f32, dg: &mut [f32]) {
        let d = gamma.len();
        let (dx, x, dy, dg) = (&mut dx[..d], &x[..d], &dy[..d], &mut dg[..d]);
        let mut s = 0.0f32;
        for i in 0..d {
            s += dy[i] * gamma[i] * x[i];
        }
        for i in 0..d {
            dg[i] += dy[i] * x[i] * rs;
        }
        // d/dx of x·rs: rs·g - x·rs³·mean(g·x)
        let c = s * rs * rs * rs / d as f32;
        for i in 0..d {
            dx[i] = dy[i] * gamma[i] * rs - x[i] * c;
        }
    }
}

/// The kernels on host f32 slices (lengths checked by the trait methods below).
impl CpuBackend {
    #[allow(clippy::too_many_arguments)]
    fn layernorm_forward_host(
        &self,
        x: &[f32],
        gamma: &[f32],
        beta: &[f32],
        eps: f32,
        y: &mut [f32],
        mean: &mut [f32],
        rstd: &mut [f32],
    ) {
        let d = gamma.len();
        y.par_chunks_mut(d)
            .zip(x.par_chunks(d))
            .zip(mean.par_iter_mut().zip(rstd.par_iter_mut()))
            .with_min_len(super::rows_per_task(d))
            .for_each(|((y, x), (m, r))| (*m, *r) = layernorm_row(y, x, gamma, beta, eps));
    }

    #[allow(clippy::too_many_arguments)]
    fn layernorm_backward_host(
        &self,
        x: &[f32],
        gamma: &[f32],
        mean: &[f32],
        rstd: &[f32],
        dy: &[f32],
        dx: &mut [f32],
        dgamma: &mut [f32],
        dbeta: &mut [f32],
    ) {
        let d = gamma.len();
        let partials: Vec<(Vec<f32>, Vec<f32>)> = dx
            .par_chunks_mut(d * ROW_BLOCK)
            .enumerate()
            .map(|(b, dxb)| {
                let mut dg = vec![0.0f32; d];
                let mut db = vec![0.0f32; d];
                for (r, dxr) in dxb.chunks_mut(d).enumerate() {
                    let row = b * ROW_BLOCK + r;
                    let (xr, dyr) = (&x[row * d..][..d], &dy[row * d..][..d]);
                    let stats = (mean[row], rstd[row]);
                    layernorm_backward_row(dxr, xr, dyr, gamma, stats, &mut dg, &mut db);
                }
                (dg, db)
            })
            .collect();
        let (dgs, dbs): (Vec<_>, Vec<_>) = partials.into_iter().unzip();
        reduce_blocks(dgs, dgamma);
        reduce_blocks(dbs, dbeta);
    }

    #[allow(clippy::too_many_arguments)]
    fn rmsnorm_forward_host(
        &self,
        x: &[f32],
        gamma: &[f32],
        eps: f32,
        y: &mut [f32],
        rstd: &mut [f32],
    ) {
        let d = gamma.len();
        y.par_chunks_mut(d)
            .zip(x.par_chunks(d))
            .zip(rstd.par_iter_mut())
            .with_min_len(super::rows_per_task(d))
            .for_each(|((y, x), r)| *r = rmsnorm_row(y, x, gamma, eps));
    }

    #[allow(clippy::too_many_arguments)]
    fn rmsnorm_backward_host(
        &self,
        x: &[f32],
        gamma: &[f32],
        rstd: &[f32],
        dy: &[f32],
        dx: &mut [f32],
        dgamma: &mut [f32],
    ) {
        let d = gamma.len();
        let partials: Vec<Vec<f32>> = dx
            .par_chunks_mut(d * ROW_BLOCK)
            .enumerate()
            .map(|(b, dxb)| {
                let mut dg = vec![0.0f32; d];
                for (r, dxr) in dxb.chunks_mut(d).enumerate() {
                    let row = b * ROW_BLOCK + r;
                    let (xr, dyr) = (&x[row * d..][..d], &dy[row * d..][..d]);
                    rmsnorm_backward_row(dxr, xr, dyr, gamma, rstd[row], &mut dg);
                }
                dg
            })
            .collect();
        reduce_blocks(partials, dgamma);
    }
}

impl NormOps for CpuBackend {
    fn layernorm_forward(
        &self,
        x: View<'_>,
        gamma: View<'_>,
        beta: View<'_>,
        eps: f32,
        y: ViewMut<'_>,
        mean: ViewMut<'_>,
        rstd: ViewMut<'_>,
    ) -> Result<()> {
        const OP: &str = "layernorm";
        let (x, gamma, beta) = (
            f32_in(OP, "x", x)?,
            f32_in(OP, "gamma", gamma)?,
            f32_in(OP, "beta", beta)?,
        );
        let (y, mean, rstd) = (
            f32_out(OP, "y", y)?,
            f32_out(OP, "mean", mean)?,
            f32_out(OP, "rstd", rstd)?,
        );
        check::norm_forward(
            OP,
            [x.len(), gamma.len(), y.len(), rstd.len()],
            Some([beta.len(), mean.len()]),
        )?;
        self.layernorm_forward_host(x, gamma, beta, eps, y, mean, rstd);
        Ok(())
    }

    fn layernorm_backward(
        &self,
        x: View<'_>,
        gamma: View<'_>,
        mean: View<'_>,
        rstd: View<'_>,
        dy: View<'_>,
        dx: ViewMut<'_>,
        dgamma: ViewMut<'_>,
        dbeta: ViewMut<'_>,
    ) -> Result<()> {
        const OP: &str = "layernorm backward";
        let (x, gamma, mean, rstd, dy) = (
            f32_in(OP, "x", x)?,
            f32_in(OP, "gamma", gamma)?,
            f32_in(OP, "mean", mean)?,
            f32_in(OP, "rstd", rstd)?,
            f32_in(OP, "dy", dy)?,
        );
        let (dx, dgamma, dbeta) = (
            f32_out(OP, "dx", dx)?,
            f32_out(OP, "dgamma", dgamma)?,
            f32_out(OP, "dbeta", dbeta)?,
        );
        let lens = [
            x.len(),
            gamma.len(),
            dy.len(),
            dx.len(),
            rstd.len(),
            dgamma.len(),
        ];
        check::norm_backward(OP, lens, Some([mean.len(), dbeta.len()]))?;
        self.layernorm_backward_host(x, gamma, mean, rstd, dy, dx, dgamma, dbeta);
        Ok(())
    }

    fn rmsnorm_forward(
        &self,
        x: View<'_>,
        gamma: View<'_>,
        eps: f32,
        y: ViewMut<'_>,
        rstd: ViewMut<'_>,
    ) -> Result<()> {
        const OP: &str = "rmsnorm";
        let (x, gamma) = (f32_in(OP, "x", x)?, f32_in(OP, "gamma", gamma)?);
        let (y, rstd) = (f32_out(OP, "y", y)?, f32_out(OP, "rstd", rstd)?);
        check::norm_forward(OP, [x.len(), gamma.len(), y.len(), rstd.len()], None)?;
        self.rmsnorm_forward_host(x, gamma, eps, y, rstd);
        Ok(())
    }

    fn rmsnorm_backward(
        &self,
        x: View<'_>,
        gamma: View<'_>,
        rstd: View<'_>,
        dy: View<'_>,
        dx: ViewMut<'_>,
        dgamma: ViewMut<'_>,
    ) -> Result<()> {
        const OP: &str = "rmsnorm backward";
        let (x, gamma, rstd, dy) = (
            f32_in(OP, "x", x)?,
            f32_in(OP, "gamma", gamma)?,
            f32_in(OP, "rstd", rstd)?,
            f32_in(OP, "dy", dy)?,
        );
        let (dx, dgamma) = (f32_out(OP, "dx", dx)?, f32_out(OP, "dgamma", dgamma)?);
        let lens = [
            x.len(),
            gamma.len(),
            dy.len(),
            dx.len(),
            rstd.len(),
            dgamma.len(),
        ];
        check::norm_backward(OP, lens, None)?;
        self.rmsnorm_backward_host(x, gamma, rstd, dy, dx, dgamma);
        Ok(())
    }

    fn residual_layernorm_forward(
        &self,
        x: View<'_>,
        residual: Option<View<'_>>,
        gamma: View<'_>,
        beta: View<'_>,
        eps: f32,
        sum: ViewMut<'_>,
        y: ViewMut<'_>,
        (mean, rstd): (ViewMut<'_>, ViewMut<'_>),
    ) -> Result<()> {
        let sum = self.residual_sum("residual layernorm", x, residual, sum)?;
        self.layernorm_forward(View::from(&*sum), gamma, beta, eps, y, mean, rstd)
    }

    fn residual_rmsnorm_forward(
        &self,
        x: View<'_>,
        residual: Option<View<'_>>,
        gamma: View<'_>,
        eps: f32,
        sum: ViewMut<'_>,
        y: ViewMut<'_>,
        rstd: ViewMut<'_>,
    ) -> Result<()> {
        let sum = self.residual_sum("residual rmsnorm", x, residual, sum)?;
        self.rmsnorm_forward(View::from(&*sum), gamma, eps, y, rstd)
    }
}

impl CpuBackend {
    /// `sum = x (+ residual)`: a copy, then the residual added as `add_assign` adds it, so
    /// the fused norms compute exactly the add and the norm they replace.
    fn residual_sum<'a>(
        &self,
        op: &'static str,
        x: View<'_>,
        residual: Option<View<'_>>,
        sum: ViewMut<'a>,
    ) -> Result<&'a mut [f32]> {
        let (x, sum) = (f32_in(op, "x", x)?, f32_out(op, "sum", sum)?);
        let r_len = residual.as_ref().map_or(x.len(), View::len);
        check::same_len(op, x.len(), &[("sum", sum.len()), ("residual", r_len)])?;
        sum.copy_from_slice(x);
        if let Some(r) = residual {
            self.add_assign(ViewMut::from(&mut *sum), r)?;
        }
        Ok(sum)
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_values::same_bits;
    use super::*;

    fn inputs(n: usize, salt: u32) -> Vec<f32> {
        super::super::test_values::hashed(n, salt, 11, 6.0)
    }

    /// The row kernels (dispatched per CPU, row sums in their own loops) give the bits of
    /// the plain fused loops they replaced.
    #[test]
    fn row_kernels_give_the_fused_scalar_bits() {
        let d = 389;
        let (x, dy, gamma, beta) = (inputs(d, 1), inputs(d, 2), inputs(d, 3), inputs(d, 4));
        let mut y = vec![0.0; d];
        let (mu, rs) = layernorm_row(&mut y, &x, &gamma, &beta, 1e-5);
        let want_mu = x.iter().sum::<f32>() / d as f32;
        let var = x.iter().map(|v| (v - want_mu) * (v - want_mu)).sum::<f32>() / d as f32;
        let want_rs = 1.0 / (var + 1e-5).sqrt();
        assert_eq!(
            (mu.to_bits(), rs.to_bits()),
            (want_mu.to_bits(), want_rs.to_bits())
        );
        let want: Vec<f32> = (0..d)
            .map(|i| (x[i] - mu) * rs * gamma[i] + beta[i])
            .collect();
        assert!(same_bits(&y, &want), "layernorm y");

        let (mut dx, mut dg, mut db) = (vec![0.0; d], vec![0.25; d], vec![0.5; d]);
        layernorm_backward_row(&mut dx, &x, &dy, &gamma, (mu, rs), &mut dg, &mut db);
        let (mut s1, mut s2) = (0.0f32, 0.0f32);
        let (mut wdg, mut wdb) = (vec![0.25f32; d], vec![0.5f32; d]);
        for i in 0..d {
            let xh = (x[i] - mu) * rs;
            let g = dy[i] * gamma[i];
            s1 += g;
            s2 += g * xh;
            wdg[i] += dy[i] * xh;
            wdb[i] += dy[i];
        }
        let (m1, m2) = (s1 / d as f32, s2 / d as f32);
        let wdx: Vec<f32> = (0..d)
            .map(|i| rs * (dy[i] * gamma[i] - m1 - (x[i] - mu) * rs * m2))
            .collect();
        assert!(same_bits(&dx, &wdx) && same_bits(&dg, &wdg) && same_bits(&db, &wdb));

        let r = rmsnorm_row(&mut y, &x, &gamma, 1e-6);
        let want_r = 1.0 / (x.iter().map(|v| v * v).sum::<f32>() / d as f32 + 1e-6).sqrt();
        assert_eq!(r.to_bits(), want_r.to_bits());
        let (mut dg, mut wdg) = (vec![0.25f32; d], vec![0.25f32; d]);
        rmsnorm_backward_row(&mut dx, &x, &dy, &gamma, r, &mut dg);
        let mut s = 0.0f32;
        for i in 0..d {
            s += dy[i] * gamma[i] * x[i];
            wdg[i] += dy[i] * x[i] * r;
        }
        let c = s * r * r * r / d as f32;
        let wdx: Vec<f32> = (0..d).map(|i| dy[i] * gamma[i] * r - x[i] * c).collect();
        assert!(
            same_bits(&dx, &wdx) && same_bits(&dg, &wdg),
            "rmsnorm backward"
        );
    }
}
