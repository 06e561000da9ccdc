//! The ZeRO engine: `initialize`, the per-stage strategies, mixed precision and the training loop.

pub mod ledger;
pub mod loss_scale;
pub mod partition;
pub mod schedule;
