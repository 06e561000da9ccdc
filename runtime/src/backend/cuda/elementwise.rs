//! Pointwise kernels (`elementwise.cu`) and bias-gradient column sums (`reduce.cu`).

use super::backend::{expect_dtype, expect_len, CudaBackend};
use super::driver::{DevPtr, LaunchConfig};
use super::launch::Args;
use super::storage::by_dtype;
use crate::backend::{check, ElementwiseOps};
use crate::tensor::{DType, View, ViewMut};
use crate::Result;

/// Rows per partial sum of a column reduction: fixed, so the summation order (and the result)
/// depends only on the shape.
const ROWS_PER_CHUNK: usize = 32;

impl CudaBackend {
    /// A pointwise kernel over `n` elements: its pointers, then the count.
    fn pointwise(&self, name: &'static str, ptrs: &[DevPtr], n: usize) -> Result<()> {
        let mut args = ptrs.iter().fold(Args::new(), |a, &p| a.ptr(p)).len(n);
        self.dev.launch(name, self.dev.grid_for(n), &mut args)
    }
}

impl ElementwiseOps for CudaBackend {
    fn gelu_forward(&self, x: View<'_>, y: ViewMut<'_>) -> Result<()> {
        let (x, y) = (self.dev_in("gelu", "x", x)?, self.dev_out("gelu", "y", y)?);
        expect_len("gelu", "y", y.len(), x.len())?;
        expect_dtype("gelu", x.dtype(), &[("y", y.dtype())])?;
        let name = by_dtype!("gelu_forward", x.dtype());
        self.pointwise(name, &[x.ptr(), y.ptr()], x.len())
    }

    fn gelu_backward(&self, x: View<'_>, dy: View<'_>, dx: ViewMut<'_>) -> Result<()> {
        const OP: &str = "gelu backward";
        let (x, dy, dx) = (
            self.dev_in(OP, "x", x)?,
            self.dev_in(OP, "dy", dy)?,
            self.dev_out(OP, "dx", dx)?,
        );
        check::same_len(OP, x.len(), &[("dy", dy.len()), ("dx", dx.len())])?;
        expect_dtype(OP, x.dtype(), &[("dy", dy.dtype()), ("dx", dx.dtype())])?;
        let name = by_dtype!("gelu_backward", x.dtype());
        self.pointwise(name, &[x.ptr(), dy.ptr(), dx.ptr()], x.len())
    }

    fn swiglu_forward(&self, gate: View<'_>, up: View<'_>, y: ViewMut<'_>) -> Result<()> {
        const OP: &str = "swiglu";
        let (g, u, y) = (
            self.dev_in(OP, "gate", gate)?,
            self.dev_in(OP, "up", up)?,
            self.dev_out(OP, "y", y)?,
        );
        check::same_len(OP, g.len(), &[("up", u.len()), ("y", y.len())])?;
        expect_dtype(OP, g.dtype(), &[("up", u.dtype()), ("y", y.dtype())])?;
        let name = by_dtype!("swiglu_forward", g.dtype());
        self.pointwise(name, &[g.ptr(), u.ptr(), y.ptr()], g.len())
    }

    fn swiglu_backward(
        &self,
        gate: View<'_>,
        up: View<'_>,
        dy: View<'_>,
        dgate: ViewMut<'_>,
        dup: ViewMut<'_>,
    ) -> Result<()> {
        const OP: &str = "swiglu backward";
        let (g, u, dy) = (
            self.dev_in(OP, "gate", gate)?,
            self.dev_in(OP, "up", up)?,
            self.dev_in(OP, "dy", dy)?,
        );
        let (dg, du) = (
            self.dev_out(OP, "dgate", dgate)?,
            self.dev_out(OP, "dup", dup)?,
        );
        let lens = [
            ("up", u.len()),
            ("dy", dy.len()),
            ("dgate", dg.len()),
            ("dup", du.len()),
        ];
        check::same_len(OP, g.len(), &lens)?;
        expect_dtype(
            OP,
            g.dtype(),
            &[
                ("up", u.dtype()),
                ("dy", dy.dtype()),
                ("dgate", dg.dtype()),
                ("dup", du.dtype()),
            ],
        )?;
        let ptrs = [g.ptr(), u.ptr(), dy.ptr(), dg.ptr(), du.ptr()];
        self.pointwise(by_dtype!("swiglu_backward", g.dtype()), &ptrs, g.len())
    }

    fn add_assign(&self, dst: ViewMut<'_>, src: View<'_>) -> Result<()> {
        let (d, s) = (
            self.dev_out("add", "dst", dst)?,
            self.dev_in("add", "src", src)?,
        );
        expect_len("add", "src", s.len(), d.len())?;
        expect_dtype("add", d.dtype(), &[("src", s.dtype())])?;
        let name = by_dtype!("add_assign", d.dtype());
        self.pointwise(name, &[d.ptr(), s.ptr()], d.len())
    }

    fn dropout(&self, seed: u64, offset: u64, p: f32, x: ViewMut<'_>) -> Result<()> {
        let x = self.dev_out("dropout", "x", x)?;
        if p <= 0.0 || x.is_empty() {
            return Ok(());
        }
        let mut args = Args::new()
            .ptr(x.ptr())
            .len(x.len())
            .u64(seed)
            .u64(offset)
            .f32(p);
        let cfg = self.dev.grid_for(x.len());
        self.dev
            .launch(by_dtype!("dropout", x.dtype()), cfg, &mut args)
    }

    fn sum_rows(&self, m: View<'_>, cols: usize, acc: ViewMut<'_>) -> Result<()> {
        const OP: &str = "sum_rows";
        let (m, acc) = (self.dev_in(OP, "m", m)?, self.dev_out(OP, "acc", acc)?);
        expect_len(OP, "acc", acc.len(), cols)?;
        expect_dtype(OP, DType::F32, &[("acc", acc.dtype())])?;
        check::whole_rows(OP, m.len(), cols)?;
        let rows = m.len() / cols;
        if rows == 0 {
            return Ok(());
        }
        let chunks = rows.div_ceil(ROWS_PER_CHUNK);
        let partial = self.dev.alloc(chunks * cols * 4)?;
        let pack = 16 / m.dtype().size();
        let threads = chunks * cols.div_ceil(pack);
        let mut args = Args::new()
            .ptr(m.ptr())
            .ptr(partial.ptr())
            .len(rows)
            .i32(cols as i32)
            .i32(ROWS_PER_CHUNK as i32);
        self.dev.launch(
            by_dtype!("colsum_partial", m.dtype()),
            self.dev.grid_for(threads),
            &mut args,
        )?;
        let mut args = Args::new()
            .ptr(partial.ptr())
            .ptr(acc.ptr())
            .len(chunks)
            .i32(cols as i32);
        let cfg = LaunchConfig::for_elements(cols as u64, super::device::BLOCK, u32::MAX);
        self.dev.launch("colsum_finalize", cfg, &mut args)
    }
}
