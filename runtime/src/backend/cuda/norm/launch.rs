//! The norms' launches: checks, the plain or residual kernel, and the parameter gradients'
//! finalize. LayerNorm is RMSNorm's launch with its mean and beta (or their gradients) added.

use super::{FINALIZE_BLOCK, ROWS_PER_CHUNK};
use crate::backend::check;
use crate::backend::cuda::backend::{expect_dtype, expect_len, CudaBackend};
use crate::backend::cuda::device::{warp_rows, BLOCK};
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

    /// A norm forward of `x`, or of `sum = x (+ residual)` when `sum` is given: LayerNorm with
    /// `ln`'s beta and mean, RMSNorm without.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn norm_fwd(
        &self,
        op: &'static str,
        (x, residual, sum): (View<'_>, Option<View<'_>>, Option<ViewMut<'_>>),
        gamma: View<'_>,
        ln: Option<(View<'_>, ViewMut<'_>)>,
        eps: f32,
        y: ViewMut<'_>,
        rstd: ViewMut<'_>,
    ) -> Result<()> {
        let (x, g) = (self.dev_in(op, "x", x)?, self.dev_in(op, "gamma", gamma)?);
        let ln = match ln {
            Some((b, m)) => Some((self.dev_in(op, "beta", b)?, self.dev_out(op, "mean", m)?)),
            None => None,
        };
        let (y, rstd) = (self.dev_out(op, "y", y)?, self.dev_out(op, "rstd", rstd)?);
        let d = g.len();
        let ln_lens = ln.as_ref().map(|(b, m)| [b.len(), m.len()]);
        let rows = check::norm_forward(op, [x.len(), d, y.len(), rstd.len()], ln_lens)?;
        let (mut same, mut f32s) = (vec![("gamma", g.dtype())], vec![]);
        if let Some((b, m)) = &ln {
            same.push(("beta", b.dtype()));
            f32s.push(("mean", m.dtype()));
        }
        same.push(("y", y.dtype()));
        f32s.push(("rstd", rstd.dtype()));
        expect_dtype(op, x.dtype(), &same)?;
        expect_dtype(op, DType::F32, &f32s)?;
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
        if let Some((b, _)) = &ln {
            args = args.ptr(b.ptr());
        }
        if fused {
            args = args.ptr(sum);
        }
        args = args.ptr(y.ptr());
        if let Some((_, m)) = &ln {
            args = args.ptr(m.ptr());
        }
        let mut args = args.ptr(rstd.ptr()).len(rows).i32(d as i32).f32(eps);
        let dt = x.dtype();
        let name = match (ln.is_some(), fused) {
            (true, false) => by_dtype!("layernorm_forward", dt),
            (true, true) => by_dtype!("residual_layernorm_forward", dt),
            (false, false) => by_dtype!("rmsnorm_forward", dt),
            (false, true) => by_dtype!("residual_rmsnorm_forward", dt),
        };
        self.dev.launch(name, warp_rows(rows), &mut args)
    }

    /// A norm backward, with `dres` its gradient added to `dx`: LayerNorm with `ln`'s mean and
    /// beta gradient, RMSNorm without.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn norm_bwd(
        &self,
        op: &'static str,
        x: View<'_>,
        (gamma, rstd): (View<'_>, View<'_>),
        ln: Option<(View<'_>, ViewMut<'_>)>,
        (dy, dres): (View<'_>, Option<View<'_>>),
        dx: ViewMut<'_>,
        dgamma: ViewMut<'_>,
    ) -> Result<()> {
        let (x, g) = (self.dev_in(op, "x", x)?, self.dev_in(op, "gamma", gamma)?);
        let ln = match ln {
            Some((m, db)) => Some((self.dev_in(op, "mean", m)?, self.dev_out(op, "dbeta", db)?)),
            None => None,
        };
        let (rstd, dy) = (self.dev_in(op, "rstd", rstd)?, self.dev_in(op, "dy", dy)?);
        let (dx, dg) = (
            self.dev_out(op, "dx", dx)?,
            self.dev_out(op, "dgamma", dgamma)?,
        );
        let d = g.len();
        let lens = [x.len(), d, dy.len(), dx.len(), rstd.len(), dg.len()];
        let rows = check::norm_backward(op, lens, ln.as_ref().map(|(m, b)| [m.len(), b.len()]))?;
        let same = [("gamma", g.dtype()), ("dy", dy.dtype()), ("dx", dx.dtype())];
        expect_dtype(op, x.dtype(), &same)?;
        let mut f32s = vec![("rstd", rstd.dtype()), ("dgamma", dg.dtype())];
        if let Some((m, b)) = &ln {
            f32s.extend([("mean", m.dtype()), ("dbeta", b.dtype())]);
        }
        expect_dtype(op, DType::F32, &f32s)?;
        let fused = dres.is_some();
        let dres = self.optional_like(op, "dresidual", dres, &x)?;
        if rows == 0 {
            return Ok(());
        }
        let chunks = rows.div_ceil(ROWS_PER_CHUNK);
        let sums = if ln.is_some() { 2 } else { 1 };
        let partial = self.dev.alloc(sums * chunks * d * 4)?;
        let mut args = Args::new().ptr(x.ptr()).ptr(g.ptr());
        if let Some((m, _)) = &ln {
            args = args.ptr(m.ptr());
        }
        args = args.ptr(rstd.ptr()).ptr(dy.ptr());
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
        let dt = x.dtype();
        let name = match (ln.is_some(), fused) {
            (true, false) => by_dtype!("layernorm_backward", dt),
            (true, true) => by_dtype!("layernorm_backward_residual", dt),
            (false, false) => by_dtype!("rmsnorm_backward", dt),
            (false, true) => by_dtype!("rmsnorm_backward_residual", dt),
        };
        self.dev.launch(name, cfg, &mut args)?;
        let db = ln.map_or(DevPtr::NULL, |(_, b)| b.ptr());
        self.finalize_dparams(partial.ptr(), chunks, d, dg.ptr(), db)
    }
}
