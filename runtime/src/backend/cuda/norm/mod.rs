//! LayerNorm and RMSNorm (`norm.cu`): a warp per row forward; backward in chunks of rows with
//! per-chunk parameter-gradient partials summed in chunk order (deterministic). The fused forms
//! (a residual add before the norm, a residual gradient added to its input gradient) are the
//! same kernels with the residual's pointers set; null pointers give the plain norms.

mod launch;

use super::backend::CudaBackend;
use super::device::BLOCK;
use super::driver::LaunchConfig;
use crate::backend::NormOps;
use crate::tensor::{View, ViewMut};
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
        let input = (x, None, None);
        self.layernorm_fwd("layernorm", input, gamma, beta, eps, y, mean, rstd)
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
        let (op, stats) = ("layernorm backward", (mean, rstd));
        self.layernorm_bwd(op, x, gamma, stats, (dy, None), dx, dgamma, dbeta)
    }

    fn rmsnorm_forward(
        &self,
        x: View<'_>,
        gamma: View<'_>,
        eps: f32,
        y: ViewMut<'_>,
        rstd: ViewMut<'_>,
    ) -> Result<()> {
        self.rmsnorm_fwd("rmsnorm", (x, None, None), gamma, eps, y, rstd)
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
        self.rmsnorm_bwd("rmsnorm backward", x, gamma, rstd, (dy, None), dx, dgamma)
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
        let (op, input) = ("residual layernorm", (x, residual, Some(sum)));
        self.layernorm_fwd(op, input, gamma, beta, eps, y, mean, rstd)
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
        let (op, input) = ("residual rmsnorm", (x, residual, Some(sum)));
        self.rmsnorm_fwd(op, input, gamma, eps, y, rstd)
    }

    fn layernorm_backward_residual(
        &self,
        x: View<'_>,
        gamma: View<'_>,
        stats: (View<'_>, View<'_>),
        dy: View<'_>,
        dresidual: View<'_>,
        dx: ViewMut<'_>,
        dgamma: ViewMut<'_>,
        dbeta: ViewMut<'_>,
    ) -> Result<()> {
        let (op, dys) = ("layernorm backward", (dy, Some(dresidual)));
        self.layernorm_bwd(op, x, gamma, stats, dys, dx, dgamma, dbeta)
    }

    fn rmsnorm_backward_residual(
        &self,
        x: View<'_>,
        gamma: View<'_>,
        rstd: View<'_>,
        dy: View<'_>,
        dresidual: View<'_>,
        dx: ViewMut<'_>,
        dgamma: ViewMut<'_>,
    ) -> Result<()> {
        let dys = (dy, Some(dresidual));
        self.rmsnorm_bwd("rmsnorm backward", x, gamma, rstd, dys, dx, dgamma)
    }
}
