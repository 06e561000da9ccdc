//! LAMB with DeepSpeed's `FusedLamb` semantics (`deepspeed.ops.lamb`, the kernels of
//! `csrc/lamb/fused_lamb_cuda_kernel.cu`), in two passes over a tensor.
//!
//! For one parameter tensor `w` with gradient `g` at step `t` (1-based), `s` the step's
//! gradient scale (loss-scale removal and clipping, multiplied in):
//!
//! ```text
//! g'  = g * s
//! m   = beta1 * m + (1 - beta1) * g'
//! v   = beta2 * v + (1 - beta2) * g' * g'
//! d   = sqrt(v) + eps                 (eps_inside_sqrt = false, DeepSpeed's default)
//!     | sqrt(v + eps)                 (eps_inside_sqrt = true)
//! u   = m / d + weight_decay * w      (w before this step's update)
//! step_size = lr * sqrt(1 - beta2^t) / (1 - beta1^t)   (lr without bias_correction)
//! |w| = sqrt(sum of w^2 over the tensor), |u| = sqrt(sum of u^2 over the tensor)
//! coeff = clamp(|w| / |u|, min_coeff, max_coeff)  when |w| != 0 and |u| != 0, else 1
//! w  -= (step_size * coeff) * u
//! ```
//!
//! `v` is not bias-corrected inside `d`: the correction lives in `step_size`, as in
//! DeepSpeed's kernel (so `eps` weighs as it does there). The moments and the update are f32,
//! computed with the operations above in that order (no FMA). The two sums of squares are
//! f64 where DeepSpeed sums f32 in a block tree: more accurate, and in an order this module
//! fixes (below), which is what lets a ZeRO shard's partial sums combine into the same bits
//! at every stage.
//!
//! Pass 1 ([`lamb_moments`]) updates `m` and `v` over a run of elements and returns the run's
//! two partial sums of squares (`w^2`, `u^2`); the caller combines the partials of a tensor's
//! runs (in a fixed order) into `|w|` and `|u|` and [`lamb_coeff`] makes the trust ratio.
//! Pass 2 ([`lamb_apply`]) recomputes `u` from `m`, `v` and `w` (as DeepSpeed's third kernel
//! does) and applies the update with the run's tensor's coefficient.
//!
//! Order of a run's sums: the run is cut into [`SUM_BLOCK`]-element blocks from its first
//! element; in a block, element `i` adds its square to lane `i % 8` (eight f64 lanes, from
//! 0.0, in element order); the lanes are added as `((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7))`; the
//! blocks' sums are added in block order from 0.0. It depends on the run's elements alone,
//! never on threads: blocks run on the rayon pool and are combined after.

use rayon::prelude::*;

use super::{check, LowPrecision};
use crate::{Error, Result};

/// Elements per block of a run's sums of squares (fixes the order; see the module doc).
pub const SUM_BLOCK: usize = 1 << 16;

/// LAMB hyper-parameters for one step (DeepSpeed's `FusedLamb` parameters).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LambHyper {
    /// Learning rate.
    pub lr: f32,
    /// First-moment decay.
    pub beta1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// Denominator epsilon.
    pub eps: f32,
    /// `eps` added under the square root (`sqrt(v + eps)`) instead of after it.
    pub eps_inside_sqrt: bool,
    /// Weight decay, added to the update direction (`u = m/d + wd * w`).
    pub weight_decay: f32,
    /// Upper clamp of the trust ratio.
    pub max_coeff: f32,
    /// Lower clamp of the trust ratio.
    pub min_coeff: f32,
    /// Fold `sqrt(1 - beta2^t) / (1 - beta1^t)` into the step size.
    pub bias_correction: bool,
}

/// The step size at `step` (1-based): `lr * sqrt(1 - beta2^t) / (1 - beta1^t)`, the two
/// corrections computed in f64 and rounded to f32 as DeepSpeed's host code does (`std::pow`
/// of a float and an int is a double there), the rest in f32; `lr` without bias correction.
pub fn lamb_step_size(hp: &LambHyper, step: u64) -> Result<f32> {
    if !hp.bias_correction {
        return Ok(hp.lr);
    }
    if step == 0 {
        return Err(Error::Invalid {
            op: "lamb_step",
            detail: "step is 1-based; step 0 divides by zero in the bias correction".into(),
        });
    }
    let t = i32::try_from(step).unwrap_or(i32::MAX);
    let bc1 = (1.0 - f64::from(hp.beta1).powi(t)) as f32;
    let bc2 = (1.0 - f64::from(hp.beta2).powi(t)) as f32;
    Ok(hp.lr * bc2.sqrt() / bc1)
}

/// The trust ratio from a tensor's two sums of squares: `|w| / |u|` clamped to
/// `[min_coeff, max_coeff]`, or 1 when either norm is 0. Computed in f64, rounded once.
pub fn lamb_coeff(hp: &LambHyper, w_sumsq: f64, u_sumsq: f64) -> f32 {
    let (w, u) = (w_sumsq.sqrt(), u_sumsq.sqrt());
    if w == 0.0 || u == 0.0 {
        return 1.0;
    }
    let mut c = w / u;
    if c > f64::from(hp.max_coeff) {
        c = f64::from(hp.max_coeff);
    }
    if c < f64::from(hp.min_coeff) {
        c = f64::from(hp.min_coeff);
    }
    c as f32
}

/// The update direction of one element: `m / d + wd * w`.
#[inline(always)]
pub(super) fn direction(hp: &LambHyper, w: f32, m: f32, v: f32) -> f32 {
    let d = if hp.eps_inside_sqrt {
        (v + hp.eps).sqrt()
    } else {
        v.sqrt() + hp.eps
    };
    m / d + hp.weight_decay * w
}

/// Eight f64 lanes added in the fixed tree order.
#[inline(always)]
pub(super) fn lanes_total(l: &[f64; 8]) -> f64 {
    ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))
}

/// Pass 1 over one block: moments updated, the block's two sums of squares.
fn moments_block(
    hp: &LambHyper,
    grad_scale: f32,
    (p, g, m, v): (&[f32], &[f32], &mut [f32], &mut [f32]),
) -> (f64, f64) {
    let (mut lw, mut lu) = ([0.0f64; 8], [0.0f64; 8]);
    for i in 0..p.len() {
        let gi = g[i] * grad_scale;
        let mi = hp.beta1 * m[i] + (1.0 - hp.beta1) * gi;
        let vi = hp.beta2 * v[i] + (1.0 - hp.beta2) * gi * gi;
        m[i] = mi;
        v[i] = vi;
        let u = f64::from(direction(hp, p[i], mi, vi));
        let w = f64::from(p[i]);
        lw[i % 8] += w * w;
        lu[i % 8] += u * u;
    }
    (lanes_total(&lw), lanes_total(&lu))
}

/// LAMB's first pass over a run of one tensor's elements (`params` are the f32 weights,
/// read only): the moments updated from `grads * grad_scale`, and the run's sums of squares
/// of the weights and of the update direction, in f64 in the order the module doc fixes.
pub fn lamb_moments(
    hp: &LambHyper,
    grad_scale: f32,
    params: &[f32],
    grads: &[f32],
    m: &mut [f32],
    v: &mut [f32],
) -> Result<(f64, f64)> {
    check(
        "lamb_moments",
        params.len(),
        &[grads.len(), m.len(), v.len()],
        &LowPrecision::None,
    )?;
    let blocks: Vec<(f64, f64)> = params
        .par_chunks(SUM_BLOCK)
        .zip(grads.par_chunks(SUM_BLOCK))
        .zip(m.par_chunks_mut(SUM_BLOCK))
        .zip(v.par_chunks_mut(SUM_BLOCK))
        .map(|(((p, g), m), v)| moments_block(hp, grad_scale, (p, g, m, v)))
        .collect();
    Ok(blocks
        .into_iter()
        .fold((0.0, 0.0), |(a, b), (w, u)| (a + w, b + u)))
}

/// LAMB's second pass over a run of one tensor's elements: the direction recomputed from the
/// updated moments and the weights, `w -= (step_size * coeff) * u`, the low-precision copy
/// written in the same pass. `coeff` is the tensor's [`lamb_coeff`].
pub fn lamb_apply(
    hp: &LambHyper,
    step: u64,
    coeff: f32,
    params: &mut [f32],
    m: &[f32],
    v: &[f32],
    lp_out: LowPrecision<'_>,
) -> Result<()> {
    check("lamb_apply", params.len(), &[m.len(), v.len()], &lp_out)?;
    let scale = lamb_step_size(hp, step)? * coeff;
    let tile = super::tiles::LambTile {
        p: params,
        m,
        v,
        lp: lp_out,
    };
    super::tiles::run(tile, &|t: super::tiles::LambTile<'_>| {
        apply_tile(hp, scale, t)
    });
    Ok(())
}

fn apply_tile(hp: &LambHyper, scale: f32, t: super::tiles::LambTile<'_>) {
    let super::tiles::LambTile { p, m, v, mut lp } = t;
    for i in 0..p.len() {
        let u = direction(hp, p[i], m[i], v[i]);
        p[i] -= scale * u;
        super::reference::write_lp(&mut lp, i, p[i]);
    }
}
