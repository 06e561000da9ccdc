//! CPU optimizer kernels: Adam/AdamW, SGD with momentum, Lion.
//!
//! Invariant: every kernel is element-wise and computes each element with the same sequence
//! of operations whatever the slice's offset, length, tiling or thread count (SIMD lanes and
//! scalar tails use the same operations, with or without FMA consistently), so a ZeRO shard
//! updated alone equals the same elements updated as part of the full buffer, bit for bit.
//!
//! `grad_scale` multiplies every gradient before use: the engine folds loss-scale removal and
//! gradient clipping into it so the gradient buffer is read once. When `lp_out` is given, the
//! updated parameter is also written as a bf16/f16 copy in the same pass.

use half::{bf16, f16};

use crate::{Error, Result};

/// Optional low-precision copy of the updated parameters, written in the same pass.
pub enum LowPrecision<'a> {
    /// No copy.
    None,
    /// Round to bf16 (nearest even).
    Bf16(&'a mut [bf16]),
    /// Round to f16 (nearest even).
    F16(&'a mut [f16]),
}

impl LowPrecision<'_> {
    fn len(&self) -> Option<usize> {
        match self {
            LowPrecision::None => None,
            LowPrecision::Bf16(b) => Some(b.len()),
            LowPrecision::F16(b) => Some(b.len()),
        }
    }
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

fn write_lp(lp: &mut LowPrecision<'_>, i: usize, p: f32) {
    match lp {
        LowPrecision::None => {}
        LowPrecision::Bf16(b) => b[i] = bf16::from_f32(p),
        LowPrecision::F16(b) => b[i] = f16::from_f32(p),
    }
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
    mut lp_out: LowPrecision<'_>,
) -> Result<()> {
    check(
        "adam_step",
        params.len(),
        &[grads.len(), m.len(), v.len()],
        &lp_out,
    )?;
    let (bc1, bc2) = if hp.bias_correction {
        let t = step as i32;
        (1.0 - hp.beta1.powi(t), 1.0 - hp.beta2.powi(t))
    } else {
        (1.0, 1.0)
    };
    let step_size = hp.lr / bc1;
    let bc2_sqrt = bc2.sqrt();
    for i in 0..params.len() {
        let mut g = grads[i] * grad_scale;
        let mut p = params[i];
        match hp.decay {
            WeightDecay::L2 => g += hp.weight_decay * p,
            WeightDecay::Decoupled => p -= hp.lr * hp.weight_decay * p,
        }
        let mi = hp.beta1 * m[i] + (1.0 - hp.beta1) * g;
        let vi = hp.beta2 * v[i] + (1.0 - hp.beta2) * g * g;
        let denom = vi.sqrt() / bc2_sqrt + hp.eps;
        p -= step_size * mi / denom;
        m[i] = mi;
        v[i] = vi;
        params[i] = p;
        write_lp(&mut lp_out, i, p);
    }
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
    mut lp_out: LowPrecision<'_>,
) -> Result<()> {
    check(
        "sgd_step",
        params.len(),
        &[grads.len(), momentum.len()],
        &lp_out,
    )?;
    for i in 0..params.len() {
        let mut g = grads[i] * grad_scale + hp.weight_decay * params[i];
        if hp.momentum != 0.0 {
            let b = if step <= 1 {
                g
            } else {
                hp.momentum * momentum[i] + (1.0 - hp.dampening) * g
            };
            momentum[i] = b;
            g = if hp.nesterov { g + hp.momentum * b } else { b };
        }
        params[i] -= hp.lr * g;
        write_lp(&mut lp_out, i, params[i]);
    }
    Ok(())
}

/// One Lion step over a slice.
pub fn lion_step(
    hp: &LionHyper,
    grad_scale: f32,
    params: &mut [f32],
    grads: &[f32],
    m: &mut [f32],
    mut lp_out: LowPrecision<'_>,
) -> Result<()> {
    check("lion_step", params.len(), &[grads.len(), m.len()], &lp_out)?;
    for i in 0..params.len() {
        let g = grads[i] * grad_scale;
        let mut p = params[i];
        p -= hp.lr * hp.weight_decay * p;
        let c = hp.beta1 * m[i] + (1.0 - hp.beta1) * g;
        let sign = if c > 0.0 {
            1.0
        } else if c < 0.0 {
            -1.0
        } else {
            0.0
        };
        p -= hp.lr * sign;
        m[i] = hp.beta2 * m[i] + (1.0 - hp.beta2) * g;
        params[i] = p;
        write_lp(&mut lp_out, i, p);
    }
    Ok(())
}
