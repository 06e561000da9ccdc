//! The norms' launches: checks, the plain or residual kernel, and the parameter gradients'
//! finalize.

use super::{row_grid, rows_of, FINALIZE_BLOCK, ROWS_PER_CHUNK};
use crate::backend::cuda::backend::{expect_dtype, expect_len, CudaBackend};
use crate::backend::cuda::device::BLOCK;
use crate::backend::cuda::driver::{DevPtr, LaunchConfig};
use crate::backend::cuda::launch::Args;
use crate::backend::cuda::storage::{by_dtype, CudaView};
use crate::tensor::{DType, View, ViewMut};
use crate::Result;

impl CudaBackend {
    /// Backward's second pass: the chunks' partial sums added to `dgamma` (and `dbeta`, null
    /// for RMSNorm).
    fn finalize_dparams(
        &self,
        partial: DevPtr,
        chunks: usize,
        dim: usize,
        dgamma: DevPtr,
        dbeta: DevPtr,
    ) -> Result<()> {
        let outputs = if dbeta.is_null() { dim } else { 2 * dim };
        let mut args = Args::new()
            .ptr(partial)
            .len(chunks)
            .i32(dim as i32)
            .ptr(dgamma)
            .ptr(dbeta);
        let cfg = LaunchConfig::for_elements(outputs as u64, FINALIZE_BLOCK, u32::MAX);
        self.dev.launch("norm_dparams_finalize", cfg, &mut args)
    }
}

/// The plain norm's kernel, or its residual form when `fused`.
fn kernel(plain: &'static str, residual: &'static str, fused: bool) -> &'static str {
    if fused {
        residual
    } else {
        plain
    }
}

impl CudaBackend {
    /// An optional input shaped like `x` (a residual or its gradient): its pointer, or null.
    fn optional_like(
        &self,
        op: &'static str,
        what: &str,
        v: Option<View<'_>>,
        x: &CudaView<'_>,
    ) -> Result<DevPtr> {
        let Some(v) = v else {
            return Ok(DevPtr::NULL);
        };
        let v = self.dev_in(op, what, v)?;
        expect_len(op, what, v.len(), x.len())?;
        expect_dtype(op, x.dtype(), &[(what, v.dtype())])?;
        Ok(v.ptr())
    }

    /// The residual stream's output of a fused forward norm (`sum`, shaped like `x`), or null.
    fn sum_out(
        &self,
        op: &'static str,
        sum: Option<ViewMut<'_>>,
        x: &CudaView<'_>,
    ) -> Result<DevPtr> {
        let Some(sum) = sum else {
            return Ok(DevPtr::NULL);
        };
        let sum = self.dev_out(op, "sum", sum)?;
        expect_len(op, "sum", sum.len(), x.len())?;
        expect_dtype(op, x.dtype(), &[("sum", sum.dtype())])?;
        Ok(sum.ptr())
    }

    /// LayerNorm forward of `x`, or of `sum = x (+ residual)` when `sum` is given.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn layernorm_fwd(
        &self,
        op: &'static str,
        (x, residual, sum): (View<'_>, Option<View<'_>>, Option<ViewMut<'_>>),
        gamma: View<'_>,
        beta: View<'_>,
        eps: f32,
        y: ViewMut<'_>,
        mean: ViewMut<'_>,
        rstd: ViewMut<'_>,
    ) -> Result<()> {
        let (x, g, b) = (
            self.dev_in(op, "x", x)?,
            self.dev_in(op, "gamma", gamma)?,
            self.dev_in(op, "beta", beta)?,
        );
        let (y, mean, rstd) = (
            self.dev_out(op, "y", y)?,
            self.dev_out(op, "mean", mean)?,
            self.dev_out(op, "rstd", rstd)?,
        );
        let d = g.len();
        let rows = rows_of(op, x.len(), d)?;
        expect_len(op, "beta", b.len(), d)?;
        expect_len(op, "y", y.len(), x.len())?;
        expect_len(op, "mean", mean.len(), rows)?;
        expect_len(op, "rstd", rstd.len(), rows)?;
        expect_dtype(
            op,
            x.dtype(),
            &[("gamma", g.dtype()), ("beta", b.dtype()), ("y", y.dtype())],
        )?;
        expect_dtype(
            op,
            DType::F32,
            &[("mean", mean.dtype()), ("rstd", rstd.dtype())],
        )?;
        let (fused, residual) = (
            sum.is_some(),
            self.optional_like(op, "residual", residual, &x)?,
        );
        let sum = self.sum_out(op, sum, &x)?;
        if rows == 0 {
            return Ok(());
        }
        let mut args = Args::new().ptr(x.ptr());
        if fused {
            args = args.ptr(residual);
        }
        args = args.ptr(g.ptr()).ptr(b.ptr());
        if fused {
            args = args.ptr(sum);
        }
        let mut args = args
            .ptr(y.ptr())
            .ptr(mean.ptr())
            .ptr(rstd.ptr())
            .len(rows)
            .i32(d as i32)
            .f32(eps);
        let name = kernel(
            by_dtype!("layernorm_forward", x.dtype()),
            by_dtype!("residual_layernorm_forward", x.dtype()),
            fused,
        );
        self.dev.launch(name, row_grid(rows), &mut args)
    }

    /// LayerNorm backward; with `dres`, its gradient added to `dx`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn layernorm_bwd(
        &self,
        op: &'static str,
        x: View<'_>,
        gamma: View<'_>,
        (mean, rstd): (View<'_>, View<'_>),
        (dy, dres): (View<'_>, Option<View<'_>>),
        dx: ViewMut<'_>,
        dgamma: ViewMut<'_>,
        dbeta: ViewMut<'_>,
    ) -> Result<()> {
        let (x, g) = (self.dev_in(op, "x", x)?, self.dev_in(op, "gamma", gamma)?);
        let (mean, rstd, dy) = (
            self.dev_in(op, "mean", mean)?,
            self.dev_in(op, "rstd", rstd)?,
            self.dev_in(op, "dy", dy)?,
        );
        let (dx, dg, db) = (
            self.dev_out(op, "dx", dx)?,
            self.dev_out(op, "dgamma", dgamma)?,
            self.dev_out(op, "dbeta", dbeta)?,
        );
        let d = g.len();
        let rows = rows_of(op, x.len(), d)?;
        expect_len(op, "dy", dy.len(), x.len())?;
        expect_len(op, "dx", dx.len(), x.len())?;
        expect_len(op, "mean", mean.len(), rows)?;
        expect_len(op, "rstd", rstd.len(), rows)?;
        expect_len(op, "dgamma", dg.len(), d)?;
        expect_len(op, "dbeta", db.len(), d)?;
        expect_dtype(
            op,
            x.dtype(),
            &[("gamma", g.dtype()), ("dy", dy.dtype()), ("dx", dx.dtype())],
        )?;
        expect_dtype(
            op,
            DType::F32,
            &[
                ("mean", mean.dtype()),
                ("rstd", rstd.dtype()),
                ("dgamma", dg.dtype()),
                ("dbeta", db.dtype()),
            ],
        )?;
        let fused = dres.is_some();
        let dres = self.optional_like(op, "dresidual", dres, &x)?;
        if rows == 0 {
            return Ok(());
        }
        let chunks = rows.div_ceil(ROWS_PER_CHUNK);
        let partial = self.dev.alloc(2 * chunks * d * 4)?;
        let mut args = Args::new()
            .ptr(x.ptr())
            .ptr(g.ptr())
            .ptr(mean.ptr())
            .ptr(rstd.ptr())
            .ptr(dy.ptr());
        if fused {
            args = args.ptr(dres);
        }
        let mut args = args
            .ptr(dx.ptr())
            .ptr(partial.ptr())
            .len(rows)
            .i32(d as i32)
            .i32(ROWS_PER_CHUNK as i32);
        let cfg = LaunchConfig::linear(chunks.clamp(1, i32::MAX as usize) as u32, BLOCK);
        let name = kernel(
            by_dtype!("layernorm_backward", x.dtype()),
            by_dtype!("layernorm_backward_residual", x.dtype()),
            fused,
        );
        self.dev.launch(name, cfg, &mut args)?;
        self.finalize_dparams(partial.ptr(), chunks, d, dg.ptr(), db.ptr())
    }

    /// RMSNorm forward of `x`, or of `sum = x (+ residual)` when `sum` is given.
    pub(super) fn rmsnorm_fwd(
        &self,
        op: &'static str,
        (x, residual, sum): (View<'_>, Option<View<'_>>, Option<ViewMut<'_>>),
        gamma: View<'_>,
        eps: f32,
        y: ViewMut<'_>,
        rstd: ViewMut<'_>,
    ) -> Result<()> {
        let (x, g) = (self.dev_in(op, "x", x)?, self.dev_in(op, "gamma", gamma)?);
        let (y, rstd) = (self.dev_out(op, "y", y)?, self.dev_out(op, "rstd", rstd)?);
        let d = g.len();
        let rows = rows_of(op, x.len(), d)?;
        expect_len(op, "y", y.len(), x.len())?;
        expect_len(op, "rstd", rstd.len(), rows)?;
        expect_dtype(op, x.dtype(), &[("gamma", g.dtype()), ("y", y.dtype())])?;
        expect_dtype(op, DType::F32, &[("rstd", rstd.dtype())])?;
        let (fused, residual) = (
            sum.is_some(),
            self.optional_like(op, "residual", residual, &x)?,
        );
        let sum = self.sum_out(op, sum, &x)?;
        if rows == 0 {
            return Ok(());
        }
        let mut args = Args::new().ptr(x.ptr());
        if fused {
            args = args.ptr(residual);
        }
        args = args.ptr(g.ptr());
        if fused {
            args = args.ptr(sum);
        }
        let mut args = args
            .ptr(y.ptr())
            .ptr(rstd.ptr())
            .len(rows)
            .i32(d as i32)
            .f32(eps);
        let name = kernel(
            by_dtype!("rmsnorm_forward", x.dtype()),
            by_dtype!("residual_rmsnorm_forward", x.dtype()),
            fused,
        );
        self.dev.launch(name, row_grid(rows), &mut args)
    }

    /// RMSNorm backward; with `dres`, its gradient added to `dx`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn rmsnorm_bwd(
        &self,
        op: &'static str,
        x: View<'_>,
        gamma: View<'_>,
        rstd: View<'_>,
        (dy, dres): (View<'_>, Option<View<'_>>),
        dx: ViewMut<'_>,
        dgamma: ViewMut<'_>,
    ) -> Result<()> {
        let (x, g) = (self.dev_in(op, "x", x)?, self.dev_in(op, "gamma", gamma)?);
        let (rstd, dy) = (self.dev_in(op, "rstd", rstd)?, self.dev_in(op, "dy", dy)?);
        let (dx, dg) = (
            self.dev_out(op, "dx", dx)?,
            self.dev_out(op, "dgamma", dgamma)?,
        );
        let d = g.len();
        let rows = rows_of(op, x.len(), d)?;
        expect_len(op, "dy", dy.len(), x.len())?;
        expect_len(op, "dx", dx.len(), x.len())?;
        expect_len(op, "rstd", rstd.len(), rows)?;
        expect_len(op, "dgamma", dg.len(), d)?;
        expect_dtype(
            op,
            x.dtype(),
            &[("gamma", g.dtype()), ("dy", dy.dtype()), ("dx", dx.dtype())],
        )?;
        expect_dtype(
            op,
            DType::F32,
            &[("rstd", rstd.dtype()), ("dgamma", dg.dtype())],
        )?;
        let fused = dres.is_some();
        let dres = self.optional_like(op, "dresidual", dres, &x)?;
        if rows == 0 {
            return Ok(());
        }
        let chunks = rows.div_ceil(ROWS_PER_CHUNK);
        let partial = self.dev.alloc(chunks * d * 4)?;
        let mut args = Args::new()
            .ptr(x.ptr())
            .ptr(g.ptr())
            .ptr(rstd.ptr())
            .ptr(dy.ptr());
        if fused {
            args = args.ptr(dres);
        }
        let mut args = args
            .ptr(dx.ptr())
            .ptr(partial.ptr())
            .len(rows)
            .i32(d as i32)
            .i32(ROWS_PER_CHUNK as i32);
        let cfg = LaunchConfig::linear(chunks.clamp(1, i32::MAX as usize) as u32, BLOCK);
        let name = kernel(
            by_dtype!("rmsnorm_backward", x.dtype()),
            by_dtype!("rmsnorm_backward_residual", x.dtype()),
            fused,
        );
        self.dev.launch(name, cfg, &mut args)?;
        self.finalize_dparams(partial.ptr(), chunks, d, dg.ptr(), DevPtr::NULL)
    }
}
