//! LayerNorm and RMSNorm (`norm.cu`): a warp per row forward; backward in chunks of rows with
//! per-chunk parameter-gradient partials summed in chunk order (deterministic). The fused forms
//! (a residual add before the norm, a residual gradient added to its input gradient) are the
//! same kernels with the residual's pointers set; null pointers give the plain norms.

mod launch;

use super::backend::CudaBackend;
use crate::backend::NormOps;
use crate::tensor::{View, ViewMut};
use crate::Result;

/// Rows per chunk of the parameter-gradient reduction: the CPU backend's `ROW_BLOCK`, so the
/// summation order is the CPU's.
const ROWS_PER_CHUNK: usize = 32;

/// Threads per block of the parameter-gradient finalize: a thread per output element sums
/// every chunk's partial in order, so small blocks put GPT-2's 2 x 768 of those serial sums on
/// 24 multiprocessors instead of 3.
const FINALIZE_BLOCK: u32 = 64;

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
        let ln = Some((beta, mean));
        self.norm_fwd("layernorm", (x, None, None), gamma, ln, eps, y, rstd)
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
        let ln = Some((mean, dbeta));
        self.norm_bwd(
            "layernorm backward",
            x,
            (gamma, rstd),
            ln,
            (dy, None),
            dx,
            dgamma,
        )
    }

    fn rmsnorm_forward(
        &self,
        x: View<'_>,
        gamma: View<'_>,
        eps: f32,
        y: ViewMut<'_>,
        rstd: ViewMut<'_>,
    ) -> Result<()> {
        self.norm_fwd("rmsnorm", (x, None, None), gamma, None, eps, y, rstd)
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
        self.norm_bwd(
            "rmsnorm backward",
            x,
            (gamma, rstd),
            None,
            (dy, None),
            dx,
            dgamma,
        )
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
        self.norm_fwd(op, input, gamma, Some((beta, mean)), eps, y, rstd)
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
        self.norm_fwd(op, input, gamma, None, eps, y, rstd)
    }

    fn layernorm_backward_residual(
        &self,
        x: View<'_>,
        gamma: View<'_>,
        (mean, rstd): (View<'_>, View<'_>),
        dy: View<'_>,
        dresidual: View<'_>,
        dx: ViewMut<'_>,
        dgamma: ViewMut<'_>,
        dbeta: ViewMut<'_>,
    ) -> Result<()> {
        let (dys, ln) = ((dy, Some(dresidual)), Some((mean, dbeta)));
        self.norm_bwd("layernorm backward", x, (gamma, rstd), ln, dys, dx, dgamma)
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
        self.norm_bwd("rmsnorm backward", x, (gamma, rstd), None, dys, dx, dgamma)
    }
}
