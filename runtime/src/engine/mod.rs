//! The ZeRO engine: `initialize`, the per-stage strategies, mixed precision and the training loop.
//!
//! Invariant: gradients are reduced across ranks at every micro-step (rank-order sums), then
//! accumulated in micro-step order, in every stage; the gradient norm sums each rank's shard
//! range in every stage. That is what makes stages 0-3 bitwise identical for one world size.

pub mod buffers;
mod build;
mod core;
pub mod estimate;
pub mod group;
pub mod ledger;
pub mod loss_scale;
pub mod optimizer;
pub mod params;
pub mod partition;
pub mod report;
pub mod schedule;
pub mod stage;
mod step;

pub use self::core::Engine;
pub use build::storage_dtype;
pub use params::{GradShard, NamedTensor};
pub use report::{StepReport, Timings};
