//! LayerNorm and RMSNorm over rows. Parameter gradients are reduced over fixed row blocks and
//! summed in block order, so results do not depend on the number of threads.

use rayon::prelude::*;

use super::{expect_len, f32_in, f32_out, CpuBackend};
use crate::backend::NormOps;
use crate::tensor::{View, ViewMut};
use crate::{Error, Result};

/// Rows per block of the parameter-gradient reduction (fixed for determinism).
const ROW_BLOCK: usize = 32;

/// Sums per-block partial vectors (each `width` long) into `acc`, in block order.
fn reduce_blocks(partials: Vec<Vec<f32>>, acc: &mut [f32]) {
    for p in partials {
        acc.iter_mut().zip(&p).for_each(|(a, p)| *a += p);
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
            .for_each(|((y, x), (m, r))| {
                let mu = x.iter().sum::<f32>() / d as f32;
                let var = x.iter().map(|v| (v - mu) * (v - mu)).sum::<f32>() / d as f32;
                let rs = 1.0 / (var + eps).sqrt();
                for i in 0..d {
                    y[i] = (x[i] - mu) * rs * gamma[i] + beta[i];
                }
                *m = mu;
                *r = rs;
            });
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
                    let (mu, rs) = (mean[row], rstd[row]);
                    let mut s1 = 0.0f32;
                    let mut s2 = 0.0f32;
                    for i in 0..d {
                        let xh = (xr[i] - mu) * rs;
                        let g = dyr[i] * gamma[i];
                        s1 += g;
                        s2 += g * xh;
                        dg[i] += dyr[i] * xh;
                        db[i] += dyr[i];
                    }
                    let (m1, m2) = (s1 / d as f32, s2 / d as f32);
                    for i in 0..d {
                        let xh = (xr[i] - mu) * rs;
                        dxr[i] = rs * (dyr[i] * gamma[i] - m1 - xh * m2);
                    }
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
            .for_each(|((y, x), r)| {
                let ms = x.iter().map(|v| v * v).sum::<f32>() / d as f32;
                let rs = 1.0 / (ms + eps).sqrt();
                for i in 0..d {
                    y[i] = x[i] * rs * gamma[i];
                }
                *r = rs;
            });
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
                    let rs = rstd[row];
                    let mut s = 0.0f32;
                    for i in 0..d {
                        s += dyr[i] * gamma[i] * xr[i];
                        dg[i] += dyr[i] * xr[i] * rs;
                    }
                    // d/dx of x·rs: rs·g - x·rs³·mean(g·x)
                    let c = s * rs * rs * rs / d as f32;
                    for i in 0..d {
                        dxr[i] = dyr[i] * gamma[i] * rs - xr[i] * c;
                    }
                }
                dg
            })
            .collect();
        reduce_blocks(partials, dgamma);
    }
}

/// Rows of `[rows, d]` data in `len` elements, after checking the width.
fn rows_of(op: &'static str, len: usize, d: usize) -> Result<usize> {
    if d == 0 || !len.is_multiple_of(d) {
        return Err(Error::Shape {
            op,
            expected: format!("whole rows of the parameter width {d}"),
            got: format!("{len} elements"),
        });
    }
    Ok(len / d)
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
        let rows = rows_of(OP, x.len(), gamma.len())?;
        expect_len(OP, "beta", beta.len(), gamma.len())?;
        expect_len(OP, "y", y.len(), x.len())?;
        expect_len(OP, "mean", mean.len(), rows)?;
        expect_len(OP, "rstd", rstd.len(), rows)?;
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
        let rows = rows_of(OP, x.len(), gamma.len())?;
        expect_len(OP, "dy", dy.len(), x.len())?;
        expect_len(OP, "dx", dx.len(), x.len())?;
        expect_len(OP, "mean", mean.len(), rows)?;
        expect_len(OP, "rstd", rstd.len(), rows)?;
        expect_len(OP, "dgamma", dgamma.len(), gamma.len())?;
        expect_len(OP, "dbeta", dbeta.len(), gamma.len())?;
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
        let rows = rows_of(OP, x.len(), gamma.len())?;
        expect_len(OP, "y", y.len(), x.len())?;
        expect_len(OP, "rstd", rstd.len(), rows)?;
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
        let rows = rows_of(OP, x.len(), gamma.len())?;
        expect_len(OP, "dy", dy.len(), x.len())?;
        expect_len(OP, "dx", dx.len(), x.len())?;
        expect_len(OP, "rstd", rstd.len(), rows)?;
        expect_len(OP, "dgamma", dgamma.len(), gamma.len())?;
        self.rmsnorm_backward_host(x, gamma, rstd, dy, dx, dgamma);
        Ok(())
    }
}
