//! The ZeRO engine: `initialize`, the per-stage strategies, mixed precision and the training loop.
//!
//! Invariant: gradients are reduced across ranks at every micro-step (rank-order sums), then
//! accumulated in micro-step order, in every stage; the gradient norm sums each rank's shard
//! range in every stage. That is what makes stages 0-3 bitwise identical for one world size.

mod assemble;
mod build;
pub mod checkpoint;
mod ckpt_offload;
mod core;
pub mod estimate;
mod eval;
mod grad_download;
mod grad_flow;
pub mod group;
pub mod host_limits;
mod hpz;
mod init;
mod io;
pub mod lamb;
pub mod lane;
// The ledger and the step report sit below the engine (the monitors read them too); their
// engine paths stay.
pub use crate::ledger;
mod load_params;
pub mod loss_scale;
mod micro;
pub mod nvme;
mod observe;
pub mod offload_copies;
pub mod optimizer;
pub mod optimizer_overlap;
mod overlap;
mod param_flow;
pub mod param_swap;
mod param_upload;
pub mod params;
pub mod partition;
mod passes;
mod places;
pub use crate::report;
pub mod rules;
pub mod schedule;
pub mod stage;
mod step;
mod step_state;
pub(crate) mod swap;
pub mod timeline;
mod topology;
pub mod trace;
mod unit_views;

/// A config for the engine's unit tests: `src` as TOML, resolved for one rank.
#[cfg(test)]
pub(crate) fn test_config(
    src: &str,
    hidden_size: Option<usize>,
) -> ferrozero_config::resolved::ResolvedConfig {
    let loaded = ferrozero_config::parse(src, ferrozero_config::Format::Toml, "test").unwrap();
    let ctx = ferrozero_config::ResolveContext {
        world_size: 1,
        hidden_size,
        micro_batch_hint: None,
    };
    loaded.config.resolve(&ctx).unwrap()
}

pub use self::core::Engine;
pub use crate::report::{StepReport, SwapTraffic, Timings};
pub use build::storage_dtype;
pub use eval::Evaluation;
pub use init::{default_config_path, initialize, EngineBuilder};
pub use params::{GradShard, NamedTensor};
pub use topology::backend_name;
