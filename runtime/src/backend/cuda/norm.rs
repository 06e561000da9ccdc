//! LayerNorm and RMSNorm (`norm.cu`): a warp per row forward; backward in chunks of rows with
//! per-chunk parameter-gradient partials summed in chunk order (deterministic).

use super::backend::{expect_dtype, expect_len, CudaBackend};
use super::device::BLOCK;
use super::driver::{DevPtr, LaunchConfig};
use super::launch::Args;
use super::storage::by_dtype;
use crate::backend::NormOps;
use crate::tensor::{DType, View, ViewMut};
use crate::{Error, Result};

/// Rows per chunk of the parameter-gradient reduction: the CPU backend's `ROW_BLOCK`, so the
/// summation order is the CPU's.
const ROWS_PER_CHUNK: usize = 32;

/// Threads per block of the parameter-gradient finalize: a thread per output element sums
/// every chunk's partial in order, so small blocks put GPT-2's 2 x 768 of those serial sums on
/// 24 multiprocessors instead of 3.
const FINALIZE_BLOCK: u32 = 64;

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

/// A warp per row.
fn row_grid(rows: usize) -> LaunchConfig {
    let warps = (BLOCK / 32) as usize;
    LaunchConfig::linear(
        rows.div_ceil(warps).clamp(1, i32::MAX as usize) as u32,
        BLOCK,
    )
}

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

impl NormOps for CudaBackend {
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
        let (x, g, b) = (
            self.dev_in(OP, "x", x)?,
            self.dev_in(OP, "gamma", gamma)?,
            self.dev_in(OP, "beta", beta)?,
        );
        let (y, mean, rstd) = (
            self.dev_out(OP, "y", y)?,
            self.dev_out(OP, "mean", mean)?,
            self.dev_out(OP, "rstd", rstd)?,
        );
        let d = g.len();
        let rows = rows_of(OP, x.len(), d)?;
        expect_len(OP, "beta", b.len(), d)?;
        expect_len(OP, "y", y.len(), x.len())?;
        expect_len(OP, "mean", mean.len(), rows)?;
        expect_len(OP, "rstd", rstd.len(), rows)?;
        expect_dtype(
            OP,
            x.dtype(),
            &[("gamma", g.dtype()), ("beta", b.dtype()), ("y", y.dtype())],
        )?;
        expect_dtype(
            OP,
            DType::F32,
            &[("mean", mean.dtype()), ("rstd", rstd.dtype())],
        )?;
        if rows == 0 {
            return Ok(());
        }
        let mut args = Args::new()
            .ptr(x.ptr())
            .ptr(g.ptr())
            .ptr(b.ptr())
            .ptr(y.ptr())
            .ptr(mean.ptr())
            .ptr(rstd.ptr())
            .len(rows)
            .i32(d as i32)
            .f32(eps);
        self.dev.launch(
            by_dtype!("layernorm_forward", x.dtype()),
            row_grid(rows),
            &mut args,
        )
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
        let (x, g) = (self.dev_in(OP, "x", x)?, self.dev_in(OP, "gamma", gamma)?);
        let (mean, rstd, dy) = (
            self.dev_in(OP, "mean", mean)?,
            self.dev_in(OP, "rstd", rstd)?,
            self.dev_in(OP, "dy", dy)?,
        );
        let (dx, dg, db) = (
            self.dev_out(OP, "dx", dx)?,
            self.dev_out(OP, "dgamma", dgamma)?,
            self.dev_out(OP, "dbeta", dbeta)?,
        );
        let d = g.len();
        let rows = rows_of(OP, x.len(), d)?;
        expect_len(OP, "dy", dy.len(), x.len())?;
        expect_len(OP, "dx", dx.len(), x.len())?;
        expect_len(OP, "mean", mean.len(), rows)?;
        expect_len(OP, "rstd", rstd.len(), rows)?;
        expect_len(OP, "dgamma", dg.len(), d)?;
        expect_len(OP, "dbeta", db.len(), d)?;
        expect_dtype(
            OP,
            x.dtype(),
            &[("gamma", g.dtype()), ("dy", dy.dtype()), ("dx", dx.dtype())],
        )?;
        expect_dtype(
            OP,
            DType::F32,
            &[
                ("mean", mean.dtype()),
                ("rstd", rstd.dtype()),
                ("dgamma", dg.dtype()),
                ("dbeta", db.dtype()),
            ],
        )?;
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
            .ptr(dy.ptr())
            .ptr(dx.ptr())
            .ptr(partial.ptr())
            .len(rows)
            .i32(d as i32)
            .i32(ROWS_PER_CHUNK as i32);
        let cfg = LaunchConfig::linear(chunks.clamp(1, i32::MAX as usize) as u32, BLOCK);
        self.dev
            .launch(by_dtype!("layernorm_backward", x.dtype()), cfg, &mut args)?;
        self.finalize_dparams(partial.ptr(), chunks, d, dg.ptr(), db.ptr())
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
        let (x, g) = (self.dev_in(OP, "x", x)?, self.dev_in(OP, "gamma", gamma)?);
        let (y, rstd) = (self.dev_out(OP, "y", y)?, self.dev_out(OP, "rstd", rstd)?);
        let d = g.len();
        let rows = rows_of(OP, x.len(), d)?;
        expect_len(OP, "y", y.len(), x.len())?;
        expect_len(OP, "rstd", rstd.len(), rows)?;
        expect_dtype(OP, x.dtype(), &[("gamma", g.dtype()), ("y", y.dtype())])?;
        expect_dtype(OP, DType::F32, &[("rstd", rstd.dtype())])?;
        if rows == 0 {
            return Ok(());
        }
        let mut args = Args::new()
            .ptr(x.ptr())
            .ptr(g.ptr())
            .ptr(y.ptr())
            .ptr(rstd.ptr())
            .len(rows)
            .i32(d as i32)
            .f32(eps);
        self.dev.launch(
            by_dtype!("rmsnorm_forward", x.dtype()),
            row_grid(rows),
            &mut args,
        )
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
        let (x, g) = (self.dev_in(OP, "x", x)?, self.dev_in(OP, "gamma", gamma)?);
        let (rstd, dy) = (self.dev_in(OP, "rstd", rstd)?, self.dev_in(OP, "dy", dy)?);
        let (dx, dg) = (
            self.dev_out(OP, "dx", dx)?,
            self.dev_out(OP, "dgamma", dgamma)?,
        );
        let d = g.len();
        let rows = rows_of(OP, x.len(), d)?;
        expect_len(OP, "dy", dy.len(), x.len())?;
        expect_len(OP, "dx", dx.len(), x.len())?;
        expect_len(OP, "rstd", rstd.len(), rows)?;
        expect_len(OP, "dgamma", dg.len(), d)?;
        expect_dtype(
            OP,
            x.dtype(),
            &[("gamma", g.dtype()), ("dy", dy.dtype()), ("dx", dx.dtype())],
        )?;
        expect_dtype(
            OP,
            DType::F32,
            &[("rstd", rstd.dtype()), ("dgamma", dg.dtype())],
        )?;
        if rows == 0 {
            return Ok(());
        }
        let chunks = rows.div_ceil(ROWS_PER_CHUNK);
        let partial = self.dev.alloc(chunks * d * 4)?;
        let mut args = Args::new()
            .ptr(x.ptr())
            .ptr(g.ptr())
            .ptr(rstd.ptr())
            .ptr(dy.ptr())
            .ptr(dx.ptr())
            .ptr(partial.ptr())
            .len(rows)
            .i32(d as i32)
            .i32(ROWS_PER_CHUNK as i32);
        let cfg = LaunchConfig::linear(chunks.clamp(1, i32::MAX as usize) as u32, BLOCK);
        self.dev
            .launch(by_dtype!("rmsnorm_backward", x.dtype()), cfg, &mut args)?;
        self.finalize_dparams(partial.ptr(), chunks, d, dg.ptr(), DevPtr::NULL)
    }
}
