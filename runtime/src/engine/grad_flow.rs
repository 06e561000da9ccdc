//! The gradients' flow: a unit's gradient from backward to its accumulator (reductions,
//! inline or on the communication worker, and the downloads to host accumulators).

use super::grad_download::GradDownloads;
use super::overlap::CommOverlap;

/// What carries gradients from backward to the accumulators.
pub(super) struct GradFlow {
    /// The communication worker, or inline collectives.
    pub(super) overlap: CommOverlap,
    /// Reduced gradients on their way to host accumulators (optimizer state off the device).
    pub(super) downloads: GradDownloads,
    /// Gradient bytes handed to reductions since the last step report.
    pub(super) reduced_bytes: u64,
}
