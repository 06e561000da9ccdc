//! CPU optimizer kernels: Adam/AdamW, SGD with momentum, Lion, and LAMB's two passes
//! (`lamb.rs`: per-element like the others, with a run's sums of squares in a fixed order).
//!
//! Invariant: every kernel is element-wise and computes each element with the same sequence
//! of operations whatever the slice's offset, length, tiling or thread count (SIMD lanes and
//! scalar tails use the same operations, with or without FMA consistently), so a ZeRO shard
//! updated alone equals the same elements updated as part of the full buffer, bit for bit.
//!
//! `grad_scale` multiplies every gradient before use: the engine folds loss-scale removal and
//! gradient clipping into it so the gradient buffer is read once. When `lp_out` is given, the
//! updated parameter is also written as a bf16/f16 copy in the same pass.
//!
//! The public kernels split large slices into tiles run on the current rayon pool and run
//! each tile through a loop compiled for AVX-512, AVX2 and baseline x86-64, chosen at run
//! time (`multiversion`). The loops use only IEEE-exact operations (separate mul and add,
//! `sqrt`, division), so every version equals [`reference`] bit for bit.

mod kernels;
mod lamb;
mod tiles;

pub mod reference;

use half::{bf16, f16};

use crate::{Error, Result};
pub use lamb::{lamb_apply, lamb_coeff, lamb_moments, lamb_step_size, LambHyper, SUM_BLOCK};
use tiles::{AdamTile, StateTile};

/// Optional low-precision copy of the updated parameters, written in the same pass.
pub enum LowPrecision<'a> {
    /// No copy.
    None,
    /// Round to bf16 (nearest even).
    Bf16(&'a mut [bf16]),
    /// Round to f16 (nearest even).
    F16(&'a mut [f16]),
}

/// How Adam applies weight decay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightDecay {
    /// Added to the gradient (classic Adam, L2).
    L2,
    /// Applied to the parameter directly (AdamW).
    Decoupled,
}

/// Adam hyper-parameters for one step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamHyper {
    /// Learning rate.
    pub lr: f32,
    /// First-moment decay.
    pub beta1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// Denominator epsilon.
    pub eps: f32,
    /// Weight decay.
    pub weight_decay: f32,
    /// L2 or decoupled.
    pub decay: WeightDecay,
    /// Apply bias correction.
    pub bias_correction: bool,
}

/// SGD hyper-parameters for one step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdHyper {
    /// Learning rate.
    pub lr: f32,
    /// Momentum (0 disables the buffer's use).
    pub momentum: f32,
    /// Dampening.
    pub dampening: f32,
    /// L2 weight decay.
    pub weight_decay: f32,
    /// Nesterov momentum.
    pub nesterov: bool,
}

/// Lion hyper-parameters for one step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LionHyper {
    /// Learning rate.
    pub lr: f32,
    /// Interpolation for the update direction.
    pub beta1: f32,
    /// Momentum decay.
    pub beta2: f32,
    /// Decoupled weight decay.
    pub weight_decay: f32,
}

impl<'a> LowPrecision<'a> {
    fn len(&self) -> Option<usize> {
        match self {
            LowPrecision::None => None,
            LowPrecision::Bf16(b) => Some(b.len()),
            LowPrecision::F16(b) => Some(b.len()),
        }
    }

    /// Splits at `mid` (the caller checked the length).
    fn split_at(self, mid: usize) -> (LowPrecision<'a>, LowPrecision<'a>) {
        match self {
            LowPrecision::None => (LowPrecision::None, LowPrecision::None),
            LowPrecision::Bf16(b) => {
                let (l, r) = b.split_at_mut(mid);
                (LowPrecision::Bf16(l), LowPrecision::Bf16(r))
            }
            LowPrecision::F16(b) => {
                let (l, r) = b.split_at_mut(mid);
                (LowPrecision::F16(l), LowPrecision::F16(r))
            }
        }
    }
}

fn check(op: &'static str, n: usize, others: &[usize], lp: &LowPrecision<'_>) -> Result<()> {
    let bad = others.iter().any(|&l| l != n) || lp.len().is_some_and(|l| l != n);
    if bad {
        return Err(Error::Length {
            op,
            detail: format!(
                "params {n}, others {others:?}, low-precision {:?}",
                lp.len()
            ),
        });
    }
    Ok(())
}

/// Adam's step size `lr / (1 - beta1^t)` and `sqrt(1 - beta2^t)`, shared by the reference and
/// the fast kernels so both start from the same bits.
pub fn adam_terms(hp: &AdamHyper, step: u64) -> Result<(f32, f32)> {
    if !hp.bias_correction {
        return Ok((hp.lr, 1.0));
    }
    if step == 0 {
        return Err(Error::Invalid {
            op: "adam_step",
            detail: "step is 1-based; step 0 divides by zero in the bias correction".into(),
        });
    }
    // beta^t underflows to 0 long before i32::MAX steps, so saturating is exact.
    let t = i32::try_from(step).unwrap_or(i32::MAX);
    let bc1 = 1.0 - hp.beta1.powi(t);
    let bc2 = 1.0 - hp.beta2.powi(t);
    Ok((hp.lr / bc1, bc2.sqrt()))
}

/// One Adam/AdamW step at `step` (1-based) over a slice.
#[allow(clippy::too_many_arguments)]
pub fn adam_step(
    hp: &AdamHyper,
    step: u64,
    grad_scale: f32,
    params: &mut [f32],
    grads: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    lp_out: LowPrecision<'_>,
) -> Result<()> {
    check(
        "adam_step",
        params.len(),
        &[grads.len(), m.len(), v.len()],
        &lp_out,
    )?;
    let (step_size, bc2_sqrt) = adam_terms(hp, step)?;
    let k = kernels::AdamConsts::new(hp, grad_scale, step_size, bc2_sqrt);
    let tile = AdamTile {
        p: params,
        g: grads,
        m,
        v,
        lp: lp_out,
    };
    tiles::run(tile, &|t: AdamTile<'_>| kernels::adam(&k, t));
    Ok(())
}

/// One SGD step at `step` (1-based; the momentum buffer starts as the first gradient).
#[allow(clippy::too_many_arguments)]
pub fn sgd_step(
    hp: &SgdHyper,
    step: u64,
    grad_scale: f32,
    params: &mut [f32],
    grads: &[f32],
    momentum: &mut [f32],
    lp_out: LowPrecision<'_>,
) -> Result<()> {
    check(
        "sgd_step",
        params.len(),
        &[grads.len(), momentum.len()],
        &lp_out,
    )?;
    let k = kernels::SgdConsts::new(hp, step, grad_scale);
    let tile = StateTile {
        p: params,
        g: grads,
        s: momentum,
        lp: lp_out,
    };
    tiles::run(tile, &|t: StateTile<'_>| kernels::one_state(&k, t));
    Ok(())
}

/// One Lion step over a slice.
pub fn lion_step(
    hp: &LionHyper,
    grad_scale: f32,
    params: &mut [f32],
    grads: &[f32],
    m: &mut [f32],
    lp_out: LowPrecision<'_>,
) -> Result<()> {
    check("lion_step", params.len(), &[grads.len(), m.len()], &lp_out)?;
    let k = kernels::LionConsts::new(hp, grad_scale);
    let tile = StateTile {
        p: params,
        g: grads,
        s: m,
        lp: lp_out,
    };
    tiles::run(tile, &|t: StateTile<'_>| kernels::one_state(&k, t));
    Ok(())
}
