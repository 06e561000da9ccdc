//! ferrozero's runtime: the compute core (tensors, layers with explicit backward, models),
//! the communicators that ZeRO is built on, and the ZeRO engine itself.
//!
//! Invariant: layers never own weights; the engine owns every parameter, gradient and
//! optimizer byte in flat per-unit buffers and hands layers slices of them.

pub mod backend;
pub mod comm;
pub mod engine;
pub mod error;
pub mod ledger;
pub mod monitor;
pub mod nn;
pub mod profiler;
pub mod report;
pub mod tensor;

pub use error::{Error, Result};
