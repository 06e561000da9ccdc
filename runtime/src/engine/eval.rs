//! Evaluation's outcome (`Engine::evaluate`: forward without gradients, loss and
//! teacher-forced predictions).

/// One evaluation batch's outcome on this rank.
#[derive(Debug, Clone, PartialEq)]
pub struct Evaluation {
    /// Sum of token losses.
    pub loss_sum: f64,
    /// Target tokens counted.
    pub tokens: u64,
    /// Arg-max prediction at every position (when the model's last unit predicts).
    pub predictions: Option<Vec<u32>>,
}
