//! What an optimizer step reads back: the micro-steps' losses and the gradient's sums of
//! squares (its norm, and the overflow check). Read together, they cost a device one wait per
//! step instead of one per value. At one rank a device also decides the step from them
//! itself ([`ClipRule`], `OptimizerOps::whole_step`), so that wait comes after the update.

use super::{OptimizerOps, UpdateRule};
use crate::tensor::{BufRef, DType, View, ViewMut};
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
    /// The accumulated gradient (still loss-scaled), as the update reads it.
    pub grads: GradView<'a>,
    /// First moment (or momentum).
    pub m: ViewMut<'a>,
    /// Second moment (Adam; empty otherwise).
    pub v: ViewMut<'a>,
    /// The low-precision copy written in the same pass, if any.
    pub lp: Option<ViewMut<'a>>,
}

/// A gradient as an optimizer update or a sum of squares reads it: the stored values, and the
/// dtype each element is rounded to on the way in, when they stand for an accumulator of that
/// dtype that was never written. At one micro-step per step the f32 micro-step gradient (or the
/// reduced sum) *is* the step's gradient: read as `round(x) + 0.0`, exactly what adding it into
/// a zeroed accumulator of that dtype would have held (rounded to nearest even, f16 overflow to
/// infinity, -0.0 turned +0.0), so overflow checks, norms and updates see the same bits.
#[derive(Debug, Clone, Copy)]
pub struct GradView<'a> {
    /// The stored elements.
    pub values: View<'a>,
    /// The accumulator dtype the values stand for; `None`: read as stored.
    pub round: Option<DType>,
}

impl<'a> GradView<'a> {
    /// Values read as stored.
    pub fn exact(values: View<'a>) -> Self {
        Self {
            values,
            round: None,
        }
    }

    /// Values read as an accumulator of `dtype` would hold them: f32 values rounded to it, or
    /// values already in it (then only -0.0 becomes +0.0).
    pub fn rounded(values: View<'a>, dtype: DType) -> Self {
        Self {
            values,
            round: Some(dtype),
        }
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.values.len()
    }

    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// Elements `range`, read the same way.
    pub fn range(self, range: std::ops::Range<usize>) -> Result<Self> {
        Ok(Self {
            values: self.values.range(range)?,
            round: self.round,
        })
    }

    /// The rounding, checked: f32 values stand for any dtype, half-precision ones only for
    /// their own. `op` names the operation in the error.
    pub fn checked_round(&self, op: &str) -> Result<Option<DType>> {
        let stored = self.values.dtype();
        match self.round {
            Some(d) if stored != DType::F32 && stored != d => Err(Error::Invalid(format!(
                "{op}: {stored:?} gradients cannot be read as {d:?} (only f32 values are \
                 rounded on the way in)"
            ))),
            r => Ok(r),
        }
    }
}

impl<'a> From<View<'a>> for GradView<'a> {
    fn from(values: View<'a>) -> Self {
        Self::exact(values)
    }
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
    grads: &[GradView<'_>],
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

/// The sum of squares of a gradient in host memory (the order `Storage::sum_squares` uses on
/// the host, over the values as read); `None` for device memory.
pub(crate) fn host_sum_squares(op: &str, g: GradView<'_>) -> Result<Option<f64>> {
    let round = g.checked_round(op)?;
    Ok(match g.values {
        View::Host(b) => Some(match round {
            Some(d) => b.sum_squares_as(d),
            None => b.sum_squares(),
        }),
        View::Cuda(_) | View::Meta(_) => None,
    })
}
