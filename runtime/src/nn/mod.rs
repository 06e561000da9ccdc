//! Neural-network building blocks: the `Module` contract, layers and models.

pub mod freeze;
pub mod gpt2;
pub mod gradcheck;
pub mod hf;
pub mod init;
pub mod layers;
pub mod linear;
pub mod llama;
pub mod module;
pub mod peft;
pub(crate) mod saved;
pub mod weights;

pub use module::{
    Batch, BatchIds, Ctx, Grads, Init, Model, Module, ParamSpec, Params, Saved, Unit, IGNORE_INDEX,
};

use crate::backend::Backend;
use crate::tensor::{DType, Storage, Tensor};
use crate::{Error, Result};

/// An activation buffer of `len` elements in the backend's activation dtype whose contents
/// are unspecified: every caller hands it to an op that overwrites each element before
/// anything reads it (a layer that needs zeros uses [`Ctx::alloc`]). The CPU serves it from
/// the thread's buffer cache without a fill, a GPU without a memset; layers hand their
/// buffers back with [`crate::backend::MemoryOps::recycle`] when they die, so a step reuses
/// the previous step's memory.
pub(crate) fn act(be: &dyn Backend, len: usize) -> Result<Storage> {
    be.buffer_uninit(be.act_dtype(), len)
}

/// A zero-filled f32 buffer of per-row statistics (norm means and reciprocal stds stay f32
/// whatever the activation dtype).
pub(crate) fn stats(be: &dyn Backend, len: usize) -> Result<Storage> {
    be.zeros(DType::F32, len)
}

/// Checks that `t` holds `rows` rows of `width`; returns `rows`.
pub(crate) fn check_rows(op: &'static str, t: &Tensor, rows: usize, width: usize) -> Result<usize> {
    if t.numel() != rows * width || t.shape.last().copied().unwrap_or(0) != width {
        return Err(Error::Shape {
            op,
            expected: format!("{rows} rows of width {width}"),
            got: format!("shape {:?}", t.shape),
        });
    }
    Ok(rows)
}

/// Checks a batch's consistency and that its sequence fits the position table.
pub(crate) fn check_tokens(b: &Batch, max_positions: usize) -> Result<()> {
    let n = b.batch * b.seq;
    if b.tokens.len() != n || b.targets.len() != n {
        return Err(Error::Shape {
            op: "batch",
            expected: format!("{n} tokens and targets ({} x {})", b.batch, b.seq),
            got: format!("{} tokens, {} targets", b.tokens.len(), b.targets.len()),
        });
    }
    if b.seq > max_positions {
        return Err(Error::Invalid(format!(
            "sequence length {} exceeds the model's {max_positions} positions",
            b.seq
        )));
    }
    Ok(())
}

/// The scalar d(objective)/d(loss sum) from a loss unit's one-element `grad_output` (the
/// engine passes it in host memory, so reading it costs no device synchronisation).
pub(crate) fn loss_grad(grad_output: &Tensor) -> Result<f32> {
    match grad_output.to_vec_f32()?.as_slice() {
        [g] => Ok(*g),
        _ => Err(Error::Shape {
            op: "loss backward",
            expected: "a one-element grad_output".into(),
            got: format!("shape {:?}", grad_output.shape),
        }),
    }
}

/// Backward must see the batch forward saw: the saved input of `saved_len` elements must
/// hold `batch * seq` rows of `width`.
pub(crate) fn check_same_batch(
    unit: &str,
    saved_len: usize,
    b: &Batch,
    width: usize,
) -> Result<()> {
    if saved_len == b.batch * b.seq * width && b.targets.len() == b.batch * b.seq {
        return Ok(());
    }
    Err(Error::Invalid(format!(
        "{unit}: backward got a {}x{} batch but forward saved {} rows",
        b.batch,
        b.seq,
        saved_len / width.max(1)
    )))
}
