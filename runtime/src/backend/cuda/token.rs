//! Embeddings (`embed.cu`), the language-model head (its chunks in `head.rs`) and argmax.
//!
//! Token ids and targets are checked on the host (their values came from there), so no flag
//! is read back.

use std::collections::BTreeMap;

use super::backend::{expect_dtype, expect_len, CudaBackend};
use super::device::{warp_rows, BLOCK, STREAM};
use super::driver::LaunchConfig;
use super::head::HeadIn;
use super::launch::Args;
use super::storage::{by_dtype, CudaViewMut};
use crate::backend::{check, Accumulate, HeadLoss, HeadShape, TokenOps};
use crate::tensor::{DType, Ids, Storage, View, ViewMut};
use crate::{Error, Result};

/// A block per row, wide for wide rows.
pub(super) fn block_rows(rows: usize, cols: usize) -> LaunchConfig {
    let threads = if cols >= 8192 { 1024 } else { 256 };
    LaunchConfig::linear(rows.clamp(1, 65535) as u32, threads)
}

impl TokenOps for CudaBackend {
    fn embedding_forward(
        &self,
        tokens: Ids<'_>,
        table: View<'_>,
        dim: usize,
        out: ViewMut<'_>,
        acc: Accumulate,
    ) -> Result<()> {
        const OP: &str = "embedding";
        let ids = self.dev_ids(OP, tokens)?;
        let (table, out) = (
            self.dev_in(OP, "table", table)?,
            self.dev_out(OP, "out", out)?,
        );
        expect_len(OP, "out", out.len(), ids.len() * dim)?;
        expect_dtype(OP, table.dtype(), &[("out", out.dtype())])?;
        let vocab = table.len() / dim.max(1);
        check::token_ids(ids.host(), vocab)?;
        if ids.is_empty() {
            return Ok(());
        }
        let bad = self.scratch_flag()?;
        let mut args = Args::new()
            .ptr(ids.ptr())
            .ptr(table.ptr())
            .ptr(out.ptr())
            .len(ids.len())
            .i32(dim as i32)
            .len(vocab)
            .i32(i32::from(acc == Accumulate::Add))
            .ptr(bad.ptr());
        self.dev.launch(
            by_dtype!("embedding_forward", out.dtype()),
            warp_rows(ids.len()),
            &mut args,
        )
    }

    fn embedding_backward(
        &self,
        tokens: Ids<'_>,
        dout: View<'_>,
        dim: usize,
        dtable: ViewMut<'_>,
    ) -> Result<()> {
        const OP: &str = "embedding backward";
        let ids = self.dev_ids(OP, tokens)?;
        let (dout, dtable) = (
            self.dev_in(OP, "dout", dout)?,
            self.dev_out(OP, "dtable", dtable)?,
        );
        expect_len(OP, "dout", dout.len(), ids.len() * dim)?;
        expect_dtype(OP, DType::F32, &[("dtable", dtable.dtype())])?;
        let vocab = dtable.len() / dim.max(1);
        check::token_ids(ids.host(), vocab)?;
        if ids.is_empty() {
            return Ok(());
        }
        // Positions grouped by token, each group in increasing position: the CPU's serial
        // scatter order per table row, with one block per distinct token.
        let mut groups: BTreeMap<i32, Vec<i32>> = BTreeMap::new();
        for (p, &t) in ids.host().iter().enumerate() {
            groups.entry(t).or_default().push(p as i32);
        }
        let uniq: Vec<i32> = groups.keys().copied().collect();
        let mut offsets = Vec::with_capacity(uniq.len() + 1);
        let mut positions = Vec::with_capacity(ids.len());
        for g in groups.values() {
            offsets.push(positions.len() as i32);
            positions.extend_from_slice(g);
        }
        offsets.push(positions.len() as i32);
        let upload = |v: &[i32]| self.dev.upload_async(bytemuck::cast_slice(v));
        let (u, o, p) = (upload(&uniq)?, upload(&offsets)?, upload(&positions)?);
        let bad = self.scratch_flag()?;
        let mut args = Args::new()
            .ptr(dout.ptr())
            .ptr(u.ptr())
            .ptr(o.ptr())
            .ptr(p.ptr())
            .ptr(dtable.ptr())
            .i32(uniq.len() as i32)
            .i32(dim as i32)
            .len(vocab)
            .ptr(bad.ptr());
        let cfg = LaunchConfig::linear(uniq.len().min(65535) as u32, 128);
        self.dev.launch(
            by_dtype!("embedding_backward", dout.dtype()),
            cfg,
            &mut args,
        )
    }

    fn position_forward(
        &self,
        table: View<'_>,
        batch: usize,
        seq: usize,
        out: ViewMut<'_>,
    ) -> Result<()> {
        const OP: &str = "position embedding";
        let (table, out) = (
            self.dev_in(OP, "table", table)?,
            self.dev_out(OP, "out", out)?,
        );
        let rows = batch * seq;
        if rows == 0 {
            return Ok(());
        }
        let dim = out.len() / rows;
        expect_len(OP, "out", out.len(), rows * dim)?;
        expect_dtype(OP, table.dtype(), &[("out", out.dtype())])?;
        check::positions(OP, table.len(), seq, dim)?;
        let mut args = Args::new()
            .ptr(table.ptr())
            .ptr(out.ptr())
            .len(rows)
            .i32(seq as i32)
            .i32(dim as i32);
        self.dev.launch(
            by_dtype!("position_forward", out.dtype()),
            warp_rows(rows),
            &mut args,
        )
    }

    fn position_backward(
        &self,
        dout: View<'_>,
        batch: usize,
        seq: usize,
        dtable: ViewMut<'_>,
    ) -> Result<()> {
        const OP: &str = "position embedding backward";
        let (dout, dtable) = (
            self.dev_in(OP, "dout", dout)?,
            self.dev_out(OP, "dtable", dtable)?,
        );
        let rows = batch * seq;
        if rows == 0 {
            return Ok(());
        }
        let dim = dout.len() / rows;
        expect_len(OP, "dout", dout.len(), rows * dim)?;
        expect_dtype(OP, DType::F32, &[("dtable", dtable.dtype())])?;
        check::positions(OP, dtable.len(), seq, dim)?;
        let pack = 16 / dout.dtype().size();
        let threads = seq * dim.div_ceil(pack);
        let mut args = Args::new()
            .ptr(dout.ptr())
            .ptr(dtable.ptr())
            .len(batch)
            .i32(seq as i32)
            .i32(dim as i32);
        let cfg = LaunchConfig::for_elements(threads as u64, BLOCK, u32::MAX >> 1);
        self.dev
            .launch(by_dtype!("position_backward", dout.dtype()), cfg, &mut args)
    }

    fn head_loss_forward(
        &self,
        s: HeadShape,
        x: View<'_>,
        w: View<'_>,
        targets: Ids<'_>,
        keep: bool,
    ) -> Result<HeadLoss> {
        let h = self.head_in("head loss", s, targets, x, w)?;
        check::target_ids(h.t.host(), s.vocab)?;
        let (loss, lse) = self.head_forward(s, h, keep)?;
        Ok(HeadLoss {
            loss: Storage::Cuda(loss),
            saved: lse.map(Storage::Cuda),
        })
    }

    fn head_loss_backward(
        &self,
        s: HeadShape,
        x: View<'_>,
        w: View<'_>,
        targets: Ids<'_>,
        saved: Storage,
        g: f32,
        dx: ViewMut<'_>,
        dw: Option<ViewMut<'_>>,
    ) -> Result<()> {
        const OP: &str = "head loss backward";
        let h = self.head_in(OP, s, targets, x, w)?;
        let grads = self.head_grads(OP, s, dx, dw)?;
        let Storage::Cuda(lse) = saved else {
            return Err(Error::Invalid(format!(
                "{OP}: the saved state is not this device's per-row log-sum-exp"
            )));
        };
        self.head_backward(s, h, &lse, g, grads)
    }

    fn head_loss_fused(
        &self,
        s: HeadShape,
        x: View<'_>,
        w: View<'_>,
        targets: Ids<'_>,
        g: f32,
        dx: ViewMut<'_>,
        dw: Option<ViewMut<'_>>,
    ) -> Result<Storage> {
        const OP: &str = "head loss fused";
        let h = self.head_in(OP, s, targets, x, w)?;
        let grads = self.head_grads(OP, s, dx, dw)?;
        Ok(Storage::Cuda(self.head_fused(s, h, g, grads)?))
    }

    fn argmax_rows(&self, x: View<'_>, width: usize) -> Result<Vec<u32>> {
        let x = self.dev_in("argmax", "x", x)?;
        if width == 0 || x.is_empty() {
            return Ok(Vec::new());
        }
        let rows = x.len() / width;
        let out = self.dev.alloc(rows * 4)?;
        let mut args = Args::new()
            .ptr(x.ptr())
            .ptr(out.ptr())
            .len(rows)
            .i32(width as i32);
        self.dev.launch(
            by_dtype!("argmax", x.dtype()),
            block_rows(rows, width),
            &mut args,
        )?;
        let mut host = vec![0i32; rows];
        out.copy_to_host(bytemuck::cast_slice_mut(&mut host), STREAM)?;
        Ok(host.into_iter().map(|v| v as u32).collect())
    }
}

impl CudaBackend {
    /// A head call's targets and inputs on this device, lengths checked against `s`.
    fn head_in<'a>(
        &self,
        op: &'static str,
        s: HeadShape,
        targets: Ids<'a>,
        x: View<'a>,
        w: View<'a>,
    ) -> Result<HeadIn<'a>> {
        let t = self.dev_ids(op, targets)?;
        let (x, w) = (self.dev_in(op, "x", x)?, self.dev_in(op, "weight", w)?);
        expect_len(op, "targets", t.len(), s.rows)?;
        expect_len(op, "x", x.len(), s.rows * s.dim)?;
        expect_len(op, "weight", w.len(), s.vocab * s.dim)?;
        expect_dtype(op, x.dtype(), &[("weight", w.dtype())])?;
        Ok(HeadIn { t, x, w })
    }

    /// A head's gradient outputs on this device: `dx` like `x`, `dw` f32 like the weight.
    fn head_grads<'a>(
        &self,
        op: &'static str,
        s: HeadShape,
        dx: ViewMut<'a>,
        dw: Option<ViewMut<'a>>,
    ) -> Result<(CudaViewMut<'a>, Option<CudaViewMut<'a>>)> {
        let dx = self.dev_out(op, "dx", dx)?;
        let dw = dw.map(|d| self.dev_out(op, "dweight", d)).transpose()?;
        check::head_grads(op, s, dx.len(), dw.as_ref().map(|d| d.len()))?;
        Ok((dx, dw))
    }
}
