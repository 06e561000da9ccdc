//! The micro-step's state: what forward leaves for backward (saved activations, checkpoints,
//! the fused head's gradient, the batch) and what the micro-steps leave for the step.

use super::ckpt_offload::Checkpoints;
use crate::nn::{Batch, BatchIds, Saved};
use crate::tensor::Tensor;

/// Activations and counts between forward, backward and the optimizer step.
pub(super) struct MicroState {
    /// Each unit's saved activations from forward, until its backward.
    pub(super) saved: Vec<Saved>,
    /// The bytes the ledger counts for each unit's saved activations.
    pub(super) saved_bytes: Vec<u64>,
    /// The input gradient of the last unit's fused forward and backward (`passes.rs`), until
    /// `backward_pass` starts from it (transient state, not a switch).
    pub(super) head_grad: Option<Tensor>,
    /// Checkpointed units' inputs, until their recompute (`ckpt_offload.rs`).
    pub(super) checkpoints: Checkpoints,
    /// Each micro-step's loss sum, on the device until the step reads them (in order).
    pub(super) losses: Vec<Tensor>,
    /// The last forward's batch and its ids on the device, until backward (transient).
    pub(super) last_batch: Option<(Batch, BatchIds)>,
    /// Micro-steps since the last optimizer step.
    pub(super) micro: usize,
    /// Target tokens (those with a loss) of the micro-steps since the last step.
    pub(super) tokens: u64,
    /// The lowest unit backward runs ([`crate::nn::Model::backward_floor`]): forward keeps
    /// nothing for the units below it.
    pub(super) floor: usize,
}

impl MicroState {
    /// The state before the first forward of a model of `units` units whose backward stops
    /// at unit `floor`.
    pub(super) fn new(units: usize, floor: usize) -> Self {
        Self {
            saved: (0..units).map(|_| None).collect(),
            saved_bytes: vec![0; units],
            head_grad: None,
            checkpoints: Checkpoints::new(units),
            losses: Vec::new(),
            last_batch: None,
            micro: 0,
            tokens: 0,
            floor,
        }
    }
}
