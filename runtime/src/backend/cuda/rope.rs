//! Rotary embeddings (`rope.cu`): the cos/sin table built once per shape on the host exactly as
//! the CPU builds it; queries and keys rotated in one launch when a caller has both.

use super::backend::{expect_dtype, CudaBackend};
use super::device::BLOCK;
use super::driver::LaunchConfig;
use super::launch::Args;
use super::storage::by_dtype;
use crate::backend::attention_ops::check_rope;
use crate::backend::{Rope, Rotation};
use crate::tensor::ViewMut;
use crate::Result;

/// The `[seq][head_dim / 2][2]` cos/sin table for `+θ`: [`Rope::angles`], the table
/// `backend/cpu/rope.rs` rotates by, flattened.
fn rope_table(seq: usize, head_dim: usize, rope: &Rope) -> Vec<f32> {
    rope.angles(seq, head_dim)
        .into_iter()
        .flat_map(|(c, s)| [c, s])
        .collect()
}

impl CudaBackend {
    /// Rotates `x`'s heads, and `k`'s when given (the same rows), in one launch.
    pub(super) fn rope_launch(
        &self,
        (x, heads): (ViewMut<'_>, usize),
        k: Option<(ViewMut<'_>, usize)>,
        rows: (usize, usize, usize),
        rope: &Rope,
        dir: Rotation,
    ) -> Result<()> {
        let (batch, seq, head_dim) = rows;
        let what = if k.is_some() { "q" } else { "x" };
        let x = self.dev_out("rope", what, x)?;
        check_rope(what, x.len(), rows, heads)?;
        let (k_ptr, k_heads) = match k {
            Some((k, k_heads)) => {
                let k = self.dev_out("rope", "k", k)?;
                check_rope("k", k.len(), rows, k_heads)?;
                expect_dtype("rope", x.dtype(), &[("k", k.dtype())])?;
                (Some(k.ptr()), k_heads)
            }
            None => (None, 0),
        };
        if batch * seq == 0 {
            return Ok(());
        }
        let table = self.dev.rope_table((seq, head_dim, rope.key()), || {
            rope_table(seq, head_dim, rope)
        })?;
        let mut args = Args::new().ptr(x.ptr());
        if let Some(k) = k_ptr {
            args = args.ptr(k);
        }
        args = args.ptr(table.ptr()).len(batch * seq).i32(seq as i32);
        args = match k_ptr {
            Some(_) => args.i32(heads as i32).i32(k_heads as i32),
            None => args.i32(heads as i32),
        };
        let mut args = args
            .i32(head_dim as i32)
            .i32(i32::from(dir == Rotation::Inverse));
        let name = match k_ptr {
            Some(_) => by_dtype!("rope_qk", x.dtype()),
            None => by_dtype!("rope", x.dtype()),
        };
        self.dev.launch(name, grid(batch * seq), &mut args)
    }
}

/// Threads over a row's pairs, a warp's width, and rows over the block's other dimension.
fn grid(rows: usize) -> LaunchConfig {
    let rows_per_block = (BLOCK / 32) as usize;
    LaunchConfig {
        grid: [rows.div_ceil(rows_per_block).clamp(1, 65535) as u32, 1, 1],
        block: [32, rows_per_block as u32, 1],
        dyn_smem: 0,
    }
}
