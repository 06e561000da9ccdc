//! ferrozero: a ZeRO training framework.
//!
//! ```no_run
//! # fn model() -> ferrozero::runtime::nn::Model { unimplemented!() }
//! let mut engine = ferrozero::engine::initialize(model(), "ds.toml")?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! This crate is the facade: it re-exports the engine, the configuration and the offload
//! machinery, and hosts the `ferrozero` command-line tool.

pub mod data;
pub mod logging;
pub mod train;

pub use ferrozero_config as config;
pub use ferrozero_offload as offload;
pub use ferrozero_runtime as runtime;
pub use ferrozero_runtime::engine;
