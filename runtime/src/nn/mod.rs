//! Neural-network building blocks: the `Module` contract, layers and models.

pub mod init;
pub mod module;

pub use module::{
    Batch, Ctx, Grads, Init, Model, Module, ParamSpec, Params, Saved, Unit, IGNORE_INDEX,
};
