//! Embeddings (`embed.cu`), the language-model head's chunked cross-entropy (`loss.cu` between
//! cuBLASLt products) and argmax.
//!
//! The head never materialises full-vocabulary logits for the batch: forward computes them a
//! chunk of rows at a time and keeps one log-sum-exp per row; backward recomputes each chunk's
//! logits, turns them into gradients in place and multiplies them out. Token ids and targets
//! are checked on the host (their values came from there), so no flag is read back.

use std::collections::BTreeMap;

use super::backend::{expect_dtype, expect_len, CudaBackend};
use super::device::{BLOCK, STREAM};
use super::driver::LaunchConfig;
use super::launch::Args;
use super::storage::{by_dtype, CudaBuf, CudaView};
use crate::backend::{
    Accumulate, Epilogue, HeadLoss, HeadShape, MatmulOps, MatmulShape, TokenOps, Transpose,
};
use crate::nn::IGNORE_INDEX;
use crate::tensor::{DType, Ids, Storage, View, ViewMut};
use crate::{Error, Result};

fn check_tokens(tokens: &[i32], rows: usize) -> Result<()> {
    match tokens
        .iter()
        .enumerate()
        .find(|(_, &t)| t < 0 || t as usize >= rows)
    {
        Some((pos, &t)) => Err(Error::Invalid(format!(
            "token id {t} at position {pos} is outside the embedding table of {rows} rows"
        ))),
        None => Ok(()),
    }
}

fn check_targets(targets: &[i32], vocab: usize) -> Result<()> {
    match targets
        .iter()
        .find(|&&t| t != IGNORE_INDEX && (t < 0 || t as usize >= vocab))
    {
        Some(&t) => Err(Error::Invalid(format!(
            "target id {t} is outside the vocabulary of {vocab} (use {IGNORE_INDEX} to ignore a position)"
        ))),
        None => Ok(()),
    }
}

/// A warp per row.
fn warp_rows(rows: usize) -> LaunchConfig {
    let warps = (BLOCK / 32) as usize;
    LaunchConfig::linear(
        rows.div_ceil(warps).clamp(1, i32::MAX as usize) as u32,
        BLOCK,
    )
}

/// A block per row, wide for wide rows.
fn block_rows(rows: usize, cols: usize) -> LaunchConfig {
    let threads = if cols >= 8192 { 1024 } else { 256 };
    LaunchConfig::linear(rows.clamp(1, 65535) as u32, threads)
}

impl CudaBackend {
    /// A zeroed device `int` the kernels may set; the host checks ids itself and never reads it.
    fn scratch_flag(&self) -> Result<super::driver::DeviceBuffer> {
        let f = self.dev.alloc(4)?;
        self.dev.driver().memset_zero(f.ptr(), 4, STREAM)?;
        Ok(f)
    }

    /// `logits[rows of chunk] = x[chunk] · wᵀ`.
    fn chunk_logits(
        &self,
        s: HeadShape,
        x: CudaView<'_>,
        w: CudaView<'_>,
        rows: std::ops::Range<usize>,
        logits: &mut CudaBuf,
    ) -> Result<()> {
        let n = rows.len();
        let xc = x.range(rows.start * s.dim..rows.end * s.dim)?;
        let mut out = logits.view_mut().range(0..n * s.vocab)?;
        let shape = MatmulShape {
            m: n,
            n: s.vocab,
            k: s.dim,
            ta: Transpose::No,
            tb: Transpose::Yes,
        };
        self.matmul(
            shape,
            View::Cuda(xc),
            View::Cuda(w),
            ViewMut::Cuda(out.reborrow()),
            Epilogue::Store,
        )
    }

    /// Rows per chunk of the head for this shape (the memory model's rule, which the
    /// estimator prices).
    fn head_chunk(&self, s: HeadShape) -> usize {
        crate::backend::MemoryOps::memory_model(self).head_chunk_rows(s)
    }
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
        check_tokens(ids.host(), vocab)?;
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
        check_tokens(ids.host(), vocab)?;
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
        if table.len() < seq * dim {
            return Err(Error::Invalid(format!(
                "{OP}: sequence length {seq} exceeds the table's {} positions",
                table.len() / dim.max(1)
            )));
        }
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
        if dtable.len() < seq * dim {
            return Err(Error::Invalid(format!(
                "{OP}: sequence length {seq} exceeds the table's {} positions",
                dtable.len() / dim.max(1)
            )));
        }
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
        const OP: &str = "head loss";
        let t = self.dev_ids(OP, targets)?;
        let (x, w) = (self.dev_in(OP, "x", x)?, self.dev_in(OP, "weight", w)?);
        expect_len(OP, "targets", t.len(), s.rows)?;
        expect_len(OP, "x", x.len(), s.rows * s.dim)?;
        expect_len(OP, "weight", w.len(), s.vocab * s.dim)?;
        check_targets(t.host(), s.vocab)?;
        let act = x.dtype();
        let lse = CudaBuf::uninit(&self.dev, DType::F32, s.rows)?;
        let losses = CudaBuf::uninit(&self.dev, DType::F32, s.rows)?;
        let chunk = self.head_chunk(s);
        let mut logits = CudaBuf::uninit(&self.dev, act, chunk * s.vocab)?;
        let bad = self.scratch_flag()?;
        for r0 in (0..s.rows).step_by(chunk) {
            let r = r0..(r0 + chunk).min(s.rows);
            self.chunk_logits(s, x, w, r.clone(), &mut logits)?;
            let mut args = Args::new()
                .ptr(logits.view().ptr())
                .ptr(t.ptr().offset((r.start * 4) as u64))
                .ptr(lse.view().range(r.clone())?.ptr())
                .ptr(losses.view().range(r.clone())?.ptr())
                .len(r.len())
                .i32(s.vocab as i32)
                .ptr(bad.ptr());
            self.dev.launch(
                by_dtype!("cross_entropy_forward", act),
                block_rows(r.len(), s.vocab),
                &mut args,
            )?;
        }
        let loss = CudaBuf::uninit(&self.dev, DType::F32, 1)?;
        let mut args = Args::new()
            .ptr(losses.view().ptr())
            .len(s.rows)
            .ptr(loss.view().ptr())
            .ptr(super::driver::DevPtr::NULL);
        // One block of a fixed size: the summation order never changes.
        self.dev.launch(
            "cross_entropy_loss_sum",
            LaunchConfig::linear(1, 1024),
            &mut args,
        )?;
        Ok(HeadLoss {
            loss: Storage::Cuda(loss),
            saved: keep.then_some(Storage::Cuda(lse)),
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
        dw: ViewMut<'_>,
    ) -> Result<()> {
        const OP: &str = "head loss backward";
        let t = self.dev_ids(OP, targets)?;
        let (x, w) = (self.dev_in(OP, "x", x)?, self.dev_in(OP, "weight", w)?);
        let (mut dx, mut dw) = (
            self.dev_out(OP, "dx", dx)?,
            self.dev_out(OP, "dweight", dw)?,
        );
        let Storage::Cuda(lse) = saved else {
            return Err(Error::Invalid(format!(
                "{OP}: the saved state is not this device's per-row log-sum-exp"
            )));
        };
        expect_len(OP, "saved log-sum-exp", lse.len(), s.rows)?;
        expect_len(OP, "targets", t.len(), s.rows)?;
        expect_len(OP, "dx", dx.len(), s.rows * s.dim)?;
        expect_len(OP, "dweight", dw.len(), s.vocab * s.dim)?;
        let act = x.dtype();
        let chunk = self.head_chunk(s);
        let mut logits = CudaBuf::uninit(&self.dev, act, chunk * s.vocab)?;
        for r0 in (0..s.rows).step_by(chunk) {
            let r = r0..(r0 + chunk).min(s.rows);
            let n = r.len();
            self.chunk_logits(s, x, w, r.clone(), &mut logits)?;
            let lv = logits.view().range(0..n * s.vocab)?;
            let mut args = Args::new()
                .ptr(lv.ptr())
                .ptr(t.ptr().offset((r.start * 4) as u64))
                .ptr(lse.view().range(r.clone())?.ptr())
                .ptr(lv.ptr())
                .len(n)
                .i32(s.vocab as i32)
                .f32(g);
            self.dev.launch(
                by_dtype!("cross_entropy_backward", act),
                block_rows(n, s.vocab),
                &mut args,
            )?;
            // dx[chunk] = dlogits · W, then dW += dlogitsᵀ · x[chunk], chunk by chunk.
            let dxs = MatmulShape {
                m: n,
                n: s.dim,
                k: s.vocab,
                ta: Transpose::No,
                tb: Transpose::No,
            };
            let dxc = dx.reborrow().range(r.start * s.dim..r.end * s.dim)?;
            self.matmul(
                dxs,
                View::Cuda(lv),
                View::Cuda(w),
                ViewMut::Cuda(dxc),
                Epilogue::Store,
            )?;
            let dws = MatmulShape {
                m: s.vocab,
                n: s.dim,
                k: n,
                ta: Transpose::Yes,
                tb: Transpose::No,
            };
            let xc = x.range(r.start * s.dim..r.end * s.dim)?;
            self.matmul(
                dws,
                View::Cuda(lv),
                View::Cuda(xc),
                ViewMut::Cuda(dw.reborrow()),
                Epilogue::Accumulate,
            )?;
        }
        Ok(())
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
