//! What an optimizer step reads back before it can decide: the micro-steps' losses and the
//! gradient's sums of squares (its norm, and the overflow check). Read together, they cost a
//! device one wait per step instead of one per value.

use crate::tensor::{BufRef, View};
use crate::{Error, Result};

/// The values [`super::OptimizerOps::step_status`] reads back.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepStatus {
    /// Each loss view's value, in the order given.
    pub losses: Vec<f32>,
    /// Each gradient view's sum of squares in f64, in the order given.
    pub sum_squares: Vec<f64>,
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
