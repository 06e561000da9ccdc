//! Rotary embeddings (`rope.cu`, the table built once per shape on the host exactly as the CPU
//! builds it) and attention.

use super::backend::CudaBackend;
use super::device::BLOCK;
use super::driver::LaunchConfig;
use super::launch::Args;
use super::storage::by_dtype;
use crate::backend::{AttentionGrads, AttentionOps, AttentionShape, Rotation, RowView};
use crate::tensor::{Storage, View, ViewMut};
use crate::{Error, Result};

/// The `[seq][head_dim / 2][2]` cos/sin table for `+θ`, computed in f64 and rounded, as
/// `backend/cpu/rope.rs` computes its own.
fn rope_table(seq: usize, head_dim: usize, theta: f32) -> Vec<f32> {
    let half = head_dim / 2;
    let mut t = Vec::with_capacity(seq * half * 2);
    for pos in 0..seq {
        for i in 0..half {
            let inv = (theta as f64).powf(-((2 * i) as f64) / head_dim as f64);
            let a = pos as f64 * inv;
            t.push(a.cos() as f32);
            t.push(a.sin() as f32);
        }
    }
    t
}

fn not_built() -> Error {
    Error::Unavailable {
        what: "CUDA attention",
        why: "the flash-attention kernels are not in this build yet".into(),
    }
}

impl AttentionOps for CudaBackend {
    fn attention_forward(
        &self,
        _shape: AttentionShape,
        _q: (View<'_>, RowView),
        _k: (View<'_>, RowView),
        _v: (View<'_>, RowView),
        _out: ViewMut<'_>,
    ) -> Result<Storage> {
        Err(not_built())
    }

    fn attention_backward(
        &self,
        _shape: AttentionShape,
        _q: (View<'_>, RowView),
        _k: (View<'_>, RowView),
        _v: (View<'_>, RowView),
        _out: View<'_>,
        _saved: &Storage,
        _dout: View<'_>,
        _dqkv: AttentionGrads<'_>,
    ) -> Result<()> {
        Err(not_built())
    }

    fn rope(
        &self,
        x: ViewMut<'_>,
        batch: usize,
        seq: usize,
        heads: usize,
        head_dim: usize,
        theta: f32,
        dir: Rotation,
    ) -> Result<()> {
        let x = self.dev_out("rope", "x", x)?;
        if !head_dim.is_multiple_of(2) || x.len() != batch * seq * heads * head_dim {
            return Err(Error::Shape {
                op: "rope",
                expected: format!(
                    "{batch}x{seq} rows of {heads} heads of an even head_dim {head_dim}"
                ),
                got: format!("{} elements", x.len()),
            });
        }
        let rows = batch * seq;
        if rows == 0 {
            return Ok(());
        }
        let table = self.dev.rope_table((seq, head_dim, theta.to_bits()), || {
            rope_table(seq, head_dim, theta)
        })?;
        let mut args = Args::new()
            .ptr(x.ptr())
            .ptr(table.ptr())
            .len(rows)
            .i32(seq as i32)
            .i32(heads as i32)
            .i32(head_dim as i32)
            .i32(i32::from(dir == Rotation::Inverse));
        let rows_per_block = (BLOCK / 32) as usize;
        let cfg = LaunchConfig {
            grid: [rows.div_ceil(rows_per_block).clamp(1, 65535) as u32, 1, 1],
            block: [32, rows_per_block as u32, 1],
            dyn_smem: 0,
        };
        self.dev
            .launch(by_dtype!("rope", x.dtype()), cfg, &mut args)
    }
}
