//! The optimizer step on host memory: the offload crate's SIMD kernels, fed f32 gradients
//! (half-precision ones widened into a reused buffer first); bf16 optimizer values go through
//! `optim_wide.rs`.

use std::borrow::Cow;

use ferrozero_offload::optim::{self, LambHyper, LowPrecision};

use super::{expect_len, f32_in, f32_out, foreign, CpuBackend};
use crate::backend::status::{host_loss, host_sum_squares};
use crate::backend::{GradView, OptimizerOps, StepStatus, UpdateRule};
use crate::tensor::{round_as_accumulated, spare, BufMut, BufRef, DType, FlatBuf, View, ViewMut};
use crate::Result;

const OP: &str = "optimizer step";

/// The gradients as f32, as [`GradView`] reads them: borrowed when they are f32 read as
/// stored, else widened (and rounded) into a cached buffer.
fn f32_grads(grads: GradView<'_>) -> Result<Cow<'_, [f32]>> {
    let round = grads.checked_round(OP)?;
    match (grads.values, round) {
        (View::Host(BufRef::F32(s)), None) => Ok(Cow::Borrowed(s)),
        (View::Host(b), _) => {
            // Straight from the staged half-precision copy, on every core: a GPU's offloaded
            // step widens the whole owned gradient here.
            let mut w = spare::take_f32(b.len());
            FlatBuf::widen_into(b, &mut w);
            if let Some(d) = round {
                round_as_accumulated(&mut w, d);
            }
            Ok(Cow::Owned(w))
        }
        (View::Cuda(_) | View::Meta(_), _) => {
            f32_in(OP, "gradients", grads.values).map(Cow::Borrowed)
        }
    }
}

/// The copy a step writes beside the f32 values: half precision in the same pass, or (the
/// second element) an f32 copy made after it.
type LpOut<'a> = (LowPrecision<'a>, Option<&'a mut [f32]>);

/// `lp` as the step writes it (host memory only).
fn low_precision<'a>(op: &'static str, lp: Option<ViewMut<'a>>) -> Result<LpOut<'a>> {
    Ok(match lp {
        None => (LowPrecision::None, None),
        Some(ViewMut::Host(BufMut::Bf16(b))) => (LowPrecision::Bf16(b), None),
        Some(ViewMut::Host(BufMut::F16(b))) => (LowPrecision::F16(b), None),
        Some(ViewMut::Host(BufMut::F32(b))) => (LowPrecision::None, Some(b)),
        Some(ViewMut::Cuda(_) | ViewMut::Meta(_)) => {
            return Err(foreign(op, "the low-precision copy"))
        }
    })
}

/// The f32 copy of the updated values `p`, when one was asked for.
fn f32_copy(op: &'static str, copy: Option<&mut [f32]>, p: &[f32]) -> Result<()> {
    if let Some(b) = copy {
        expect_len(op, "an f32 copy", b.len(), p.len())?;
        b.copy_from_slice(p);
    }
    Ok(())
}

impl OptimizerOps for CpuBackend {
    fn step_status(&self, losses: &[View<'_>], grads: &[GradView<'_>]) -> Result<StepStatus> {
        const STATUS: &str = "step status";
        let losses = losses
            .iter()
            .map(|l| host_loss(STATUS, *l)?.ok_or_else(|| foreign(STATUS, "a loss")))
            .collect::<Result<_>>()?;
        let sum_squares = grads
            .iter()
            .map(|g| host_sum_squares(STATUS, *g)?.ok_or_else(|| foreign(STATUS, "a gradient")))
            .collect::<Result<_>>()?;
        Ok(StepStatus {
            losses,
            sum_squares,
            grad_scale: None,
        })
    }

    fn optimizer_update(
        &self,
        rule: &UpdateRule,
        step: u64,
        grad_scale: f32,
        params: ViewMut<'_>,
        grads: GradView<'_>,
        m: ViewMut<'_>,
        v: ViewMut<'_>,
        lp: Option<ViewMut<'_>>,
    ) -> Result<()> {
        let f32_state = [params.dtype(), m.dtype(), v.dtype()]
            .iter()
            .all(|d| *d == DType::F32);
        if !f32_state {
            let g = f32_grads(grads)?;
            let r = super::optim_wide::update(rule, step, grad_scale, params, &g, m, v, lp);
            if let Cow::Owned(w) = g {
                spare::give_f32(w);
            }
            return r;
        }
        let (p, m, v) = (
            f32_out(OP, "parameters", params)?,
            f32_out(OP, "first moment", m)?,
            f32_out(OP, "second moment", v)?,
        );
        let g = f32_grads(grads)?;
        // An f32 copy is written after the update; half precision in the same pass.
        let (lp_out, lp_f32) = low_precision(OP, lp)?;
        let r = match rule {
            UpdateRule::Adam(hp) => optim::adam_step(hp, step, grad_scale, p, &g, m, v, lp_out),
            UpdateRule::Sgd(hp) => optim::sgd_step(hp, step, grad_scale, p, &g, m, lp_out),
            UpdateRule::Lion(hp) => optim::lion_step(hp, grad_scale, p, &g, m, lp_out),
        };
        if let Cow::Owned(w) = g {
            spare::give_f32(w);
        }
        r?;
        f32_copy(OP, lp_f32, p)
    }

    fn lamb_moments(
        &self,
        hp: &LambHyper,
        grad_scale: f32,
        (params, grads): (View<'_>, GradView<'_>),
        m: ViewMut<'_>,
        v: ViewMut<'_>,
    ) -> Result<(f64, f64)> {
        const OP: &str = "LAMB moments";
        let p = f32_in(OP, "f32 parameters (LAMB keeps f32 weights)", params)?;
        let (m, v) = (
            f32_out(OP, "f32 first moment", m)?,
            f32_out(OP, "f32 second moment", v)?,
        );
        let g = f32_grads(grads)?;
        let r = optim::lamb_moments(hp, grad_scale, p, &g, m, v);
        if let Cow::Owned(w) = g {
            spare::give_f32(w);
        }
        Ok(r?)
    }

    fn lamb_apply(
        &self,
        (hp, step, coeff): (&LambHyper, u64, f32),
        params: ViewMut<'_>,
        (m, v): (View<'_>, View<'_>),
        lp: Option<ViewMut<'_>>,
    ) -> Result<()> {
        const OP: &str = "LAMB update";
        let p = f32_out(OP, "f32 parameters (LAMB keeps f32 weights)", params)?;
        let (m, v) = (
            f32_in(OP, "f32 first moment", m)?,
            f32_in(OP, "f32 second moment", v)?,
        );
        let (lp_out, lp_f32) = low_precision(OP, lp)?;
        optim::lamb_apply(hp, step, coeff, p, m, v, lp_out)?;
        f32_copy(OP, lp_f32, p)
    }
}
