//! ferrozero's byte movers: the CPU optimizer kernels (Adam/AdamW, SGD, Lion), page-locked
//! buffer pools, the NVMe tensor store and the swap pipelines.
//!
//! Invariant: this crate knows nothing about models, ZeRO stages or configs; the engine
//! decides what moves when, this crate moves it.

pub mod bench;
pub mod error;
pub mod huge;
pub mod optim;
pub mod pipeline;
pub mod pool;
pub mod preflight;
pub mod store;
pub mod sys;
pub mod tiled;

pub use error::{Error, Result};
