//! Scalar reference kernels: the plain per-element loops the fast kernels must equal bit for
//! bit. Tests compare against these; the engine calls the public kernels in `optim`.
//!
//! Every expression here is written with separate multiplies and adds (no `mul_add`), which
//! is what the SIMD kernels do too: Rust never contracts `a * b + c` into an FMA.

use half::{bf16, f16};

use super::{
    adam_terms, check, kernels, AdamHyper, LionHyper, LowPrecision, SgdHyper, WeightDecay,
};
use crate::Result;

pub(super) fn write_lp(lp: &mut LowPrecision<'_>, i: usize, p: f32) {
    match lp {
        LowPrecision::None => {}
        LowPrecision::Bf16(b) => b[i] = bf16::from_f32(p),
        LowPrecision::F16(b) => b[i] = f16::from_f32(p),
    }
}

/// Reference Adam/AdamW step at `step` (1-based) over a slice.
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
        "reference::adam_step",
        params.len(),
        &[grads.len(), m.len(), v.len()],
        &lp_out,
    )?;
    let (step_size, bc2_sqrt) = adam_terms(hp, step)?;
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

/// Reference SGD step at `step` (1-based; the momentum buffer starts as the first gradient).
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
        "reference::sgd_step",
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

/// Reference Lion step over a slice.
pub fn lion_step(
    hp: &LionHyper,
    grad_scale: f32,
    params: &mut [f32],
    grads: &[f32],
    m: &mut [f32],
    mut lp_out: LowPrecision<'_>,
) -> Result<()> {
    check(
        "reference::lion_step",
        params.len(),
        &[grads.len(), m.len()],
        &lp_out,
    )?;
    for i in 0..params.len() {
        let g = grads[i] * grad_scale;
        let mut p = params[i];
        p -= hp.lr * hp.weight_decay * p;
        let c = hp.beta1 * m[i] + (1.0 - hp.beta1) * g;
        p -= hp.lr * kernels::sign(c);
        m[i] = hp.beta2 * m[i] + (1.0 - hp.beta2) * g;
        params[i] = p;
        write_lp(&mut lp_out, i, p);
    }
    Ok(())
}
