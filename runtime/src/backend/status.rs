//! What an optimizer step reads back: the micro-steps' losses and the gradient's sums of
//! squares (its norm, and the overflow check). Read together, they cost a device one wait per
//! step instead of one per value. At one rank a device also decides the step from them
//! itself ([`ClipRule`], `OptimizerOps::whole_step`), so that wait comes after the update.

use super::{OptimizerOps, UpdateRule};
use crate::tensor::{BufRef, View, ViewMut};
use crate::{Error, Result};

/// The values [`super::OptimizerOps::step_status`] reads back.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepStatus {
    /// Each loss view's value, in the order given.
    pub losses: Vec<f32>,
    /// Each gradient view's sum of squares in f64, in the order given.
    pub sum_squares: Vec<f64>,
    /// The gradient scale the optimizer applied, as `OptimizerOps::whole_step` decided it
    /// (NaN: the step was skipped for an overflow); `None` from `step_status`.
    pub grad_scale: Option<f32>,
}

/// One run of elements a whole step updates: an optimizer tile of a group's owned range.
#[derive(Debug)]
pub struct StepTensor<'a> {
    /// The f32 values updated (master weights in mixed precision).
    pub params: ViewMut<'a>,
    /// The accumulated gradient (any dtype; still loss-scaled).
    pub grads: View<'a>,
    /// First moment (or momentum).
    pub m: ViewMut<'a>,
    /// Second moment (Adam; empty otherwise).
    pub v: ViewMut<'a>,
    /// The low-precision copy written in the same pass, if any.
    pub lp: Option<ViewMut<'a>>,
}

/// How a step at one rank turns its gradient's sums of squares into the optimizer's gradient
/// scale: the engine's host arithmetic, written once here, which a device reproduces
/// operation for operation (`clip_grad_scale` in `optim.cu`) so that both give the same bits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ClipRule {
    /// The loss scale in force for this step's backward (1 without scaling).
    pub loss_scale: f64,
    /// `gradient_clipping`: the global norm's bound (0: none).
    pub clipping: f64,
}

impl ClipRule {
    /// A rank's sum of squares: its groups' sums in order, from -0.0 (what `Iterator::sum`
    /// starts from, so an all-zero gradient keeps its bits). Finite exactly when every
    /// gradient element is: the overflow check.
    pub fn total(sums: impl IntoIterator<Item = f64>) -> f64 {
        sums.into_iter().fold(-0.0, |acc, s| acc + s)
    }

    /// The unscaled global norm from the global sum of squares as the all-reduce carries it
    /// (f32).
    pub fn norm(&self, global: f32) -> f64 {
        f64::from(global).sqrt() / self.loss_scale
    }

    /// The clipping coefficient for a global norm (1 without clipping or below the bound).
    pub fn coef(&self, norm: f64) -> f64 {
        if self.clipping > 0.0 && norm > self.clipping {
            self.clipping / (norm + 1e-6)
        } else {
            1.0
        }
    }

    /// What multiplies every gradient: the loss scale's removal times the clipping
    /// coefficient.
    pub fn grad_scale(&self, norm: f64) -> f32 {
        (self.coef(norm) / self.loss_scale) as f32
    }

    /// The scale at one rank from its groups' sums of squares; `None` when they overflowed
    /// (the step is skipped).
    pub fn decide(&self, sums: &[f64]) -> Option<f32> {
        let total = Self::total(sums.iter().copied());
        total
            .is_finite()
            .then(|| self.grad_scale(self.norm(total as f32)))
    }
}

/// `OptimizerOps::whole_step` from its parts: the status, the decision on the host, then
/// each tensor's update. The CPU takes this path; a device overrides it to decide where the
/// gradients live.
pub(crate) fn whole_step_by_parts<B: OptimizerOps + ?Sized>(
    be: &B,
    (rule, step, clip): (&UpdateRule, u64, ClipRule),
    losses: &[View<'_>],
    grads: &[View<'_>],
    tensors: Vec<StepTensor<'_>>,
) -> Result<StepStatus> {
    let mut st = be.step_status(losses, grads)?;
    let scale = clip.decide(&st.sum_squares);
    if let Some(gs) = scale {
        for t in tensors {
            be.optimizer_update(rule, step, gs, t.params, t.grads, t.m, t.v, t.lp)?;
        }
    }
    st.grad_scale = Some(scale.unwrap_or(f32::NAN));
    Ok(st)
}

/// A one-element loss in host memory as f32; `None` for device memory.
pub(crate) fn host_loss(op: &'static str, v: View<'_>) -> Result<Option<f32>> {
    let View::Host(b) = v else {
        return Ok(None);
    };
    if b.len() != 1 {
        return Err(Error::Shape {
            op,
            expected: "a one-element loss".into(),
            got: format!("{} elements", b.len()),
        });
    }
    Ok(Some(match b {
        BufRef::F32(s) => s[0],
        BufRef::Bf16(s) => s[0].to_f32(),
        BufRef::F16(s) => s[0].to_f32(),
    }))
}

/// The sum of squares of a view in host memory (the order `Storage::sum_squares` uses on
/// the host); `None` for device memory.
pub(crate) fn host_sum_squares(v: View<'_>) -> Option<f64> {
    match v {
        View::Host(b) => Some(b.sum_squares()),
        View::Cuda(_) => None,
    }
}
