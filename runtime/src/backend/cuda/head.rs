//! The language-model head on the device: logits a chunk of rows at a time through cuBLASLt,
//! `loss.cu`'s cross-entropy between the products.
//!
//! Full-vocabulary logits never exist for the batch. Forward keeps one log-sum-exp per row and
//! backward recomputes each chunk's logits; the fused head (training, with the loss gradient
//! known before forward) runs per chunk the logits product, the loss and dlogits kernel (in
//! place), then the dX and dW products: three products per chunk, nothing kept.
//!
//! The chunk's rows lie [`crate::backend::MemoryModel::head_ld`] elements apart (the
//! vocabulary rounded up to 128), so every head product has 16-byte aligned leading
//! dimensions. Only the vocabulary's columns are computed, read or in the loss; the padding
//! lives in this transient buffer alone, never in parameters, gradients, checkpoints or
//! exports.
//!
//! Aligned strides are not enough: cuBLASLt also looks at the vocabulary's extent, and for an
//! odd one (GPT-2's 50257) it picks its one-element-aligned Turing kernels, about a sixth of
//! the H200's matrix throughput (measured: 26 of a GPT-2 step's 62 ms of kernel time). So each
//! product runs over the vocabulary in two parts, the largest multiple of eight and the rest
//! (at most seven columns, a negligible product of its own).

use std::ops::Range;

use super::backend::{expect_len, CudaBackend};
use super::device::STREAM;
use super::driver::{DevPtr, LaunchConfig};
use super::launch::Args;
use super::matmul::RowStrides;
use super::storage::CudaIds;
use super::storage::{by_dtype, CudaBuf, CudaView, CudaViewMut};
use super::token::block_rows;
use crate::backend::{HeadShape, MatmulShape, MemoryOps, Transpose};
use crate::tensor::DType;
use crate::{Error, Result};

/// One call's chunking: rows per chunk and the logits' row stride.
#[derive(Debug, Clone, Copy)]
struct Plan {
    s: HeadShape,
    ld: usize,
    chunk: usize,
}

/// The vocabulary's columns a product covers at once: a multiple of this, then the rest.
const VOCAB_PART: usize = 8;

impl Plan {
    /// The vocabulary's column ranges, each a product of its own: the aligned bulk, then the
    /// remainder (absent when the vocabulary is a multiple of [`VOCAB_PART`]).
    fn parts(&self) -> impl Iterator<Item = Range<usize>> {
        let (v, bulk) = (self.s.vocab, self.s.vocab / VOCAB_PART * VOCAB_PART);
        [0..bulk, bulk..v].into_iter().filter(|r| !r.is_empty())
    }

    /// The chunks' row ranges, in order.
    fn chunks(&self) -> impl Iterator<Item = Range<usize>> + '_ {
        (0..self.s.rows)
            .step_by(self.chunk.max(1))
            .map(|r0| r0..(r0 + self.chunk).min(self.s.rows))
    }
}

/// A head call's operands on this device, their lengths checked against the shape.
pub(super) struct HeadIn<'a> {
    /// The targets (one per row).
    pub t: &'a CudaIds,
    /// The hidden states `[rows, dim]`.
    pub x: CudaView<'a>,
    /// The weight `[vocab, dim]`.
    pub w: CudaView<'a>,
}

impl CudaBackend {
    /// The memory model's chunk and row stride for `s`, the chunk capped where a test asked.
    fn head_plan(&self, s: HeadShape) -> Result<Plan> {
        if s.vocab == 0 || s.dim == 0 || s.vocab > i32::MAX as usize {
            return Err(Error::Invalid(format!(
                "head loss: a vocabulary of {} and a width of {} (both must be in 1..2^31)",
                s.vocab, s.dim
            )));
        }
        let m = self.memory_model();
        let chunk = m.head_chunk_rows(s);
        Ok(Plan {
            s,
            ld: m.head_ld(s),
            chunk: self.head_chunk_cap().map_or(chunk, |c| chunk.min(c.max(1))),
        })
    }

    /// A zeroed device `int` the kernels may set; the host checks ids itself and never reads it.
    pub(super) fn scratch_flag(&self) -> Result<super::driver::DeviceBuffer> {
        let f = self.dev.alloc(4)?;
        self.dev.driver().memset_zero(f.ptr(), 4, STREAM)?;
        Ok(f)
    }

    /// `logits[.., :vocab] = x[rows] · wᵀ` into the chunk buffer (row stride `ld`), one
    /// product per part of the vocabulary.
    fn chunk_logits(
        &self,
        p: &Plan,
        h: &HeadIn<'_>,
        rows: Range<usize>,
        logits: &mut CudaBuf,
    ) -> Result<()> {
        let s = p.s;
        let xc = h.x.range(rows.start * s.dim..rows.end * s.dim)?;
        let ld = RowStrides {
            a: s.dim,
            b: s.dim,
            c: p.ld,
        };
        let len = logits.len();
        for cols in p.parts() {
            let shape = MatmulShape {
                m: rows.len(),
                n: cols.len(),
                k: s.dim,
                ta: Transpose::No,
                tb: Transpose::Yes,
            };
            let w = h.w.range(cols.start * s.dim..cols.end * s.dim)?;
            let c = logits.view_mut().range(cols.start..len)?;
            self.matmul_strided(shape, (xc, w, c), ld, false)?;
        }
        Ok(())
    }

    /// `dx[rows] = dlogits · W`, then `dW += dlogitsᵀ · x[rows]`, from the chunk's gradients,
    /// one product per part of the vocabulary (dX sums the parts: the first overwrites).
    fn chunk_grads(
        &self,
        p: &Plan,
        h: &HeadIn<'_>,
        rows: Range<usize>,
        dlogits: CudaView<'_>,
        dx: &mut CudaViewMut<'_>,
        dw: &mut Option<CudaViewMut<'_>>,
    ) -> Result<()> {
        let (s, n) = (p.s, rows.len());
        let span = rows.start * s.dim..rows.end * s.dim;
        let xc = h.x.range(span.clone())?;
        let ld = RowStrides {
            a: p.ld,
            b: s.dim,
            c: s.dim,
        };
        for (i, cols) in p.parts().enumerate() {
            let part = dlogits.range(cols.start..dlogits.len())?;
            let weights = cols.start * s.dim..cols.end * s.dim;
            let dxs = MatmulShape {
                m: n,
                n: s.dim,
                k: cols.len(),
                ta: Transpose::No,
                tb: Transpose::No,
            };
            let (w, dxc) = (
                h.w.range(weights.clone())?,
                dx.reborrow().range(span.clone())?,
            );
            self.matmul_strided(dxs, (part, w, dxc), ld, i > 0)?;
            let dws = MatmulShape {
                m: cols.len(),
                n: s.dim,
                k: n,
                ta: Transpose::Yes,
                tb: Transpose::No,
            };
            // A frozen table's gradient is not wanted: its product is skipped.
            if let Some(dw) = dw {
                let dwc = dw.reborrow().range(weights)?;
                self.matmul_strided(dws, (part, xc, dwc), ld, true)?;
            }
        }
        Ok(())
    }

    /// The loss sum of `rows` per-row losses into a fresh one-element f32 buffer. One block of
    /// a fixed size: the summation order never changes.
    fn head_loss_sum(&self, losses: &CudaBuf, rows: usize) -> Result<CudaBuf> {
        let loss = CudaBuf::uninit(&self.dev, DType::F32, 1)?;
        let mut args = Args::new()
            .ptr(losses.view().ptr())
            .len(rows)
            .ptr(loss.view().ptr())
            .ptr(DevPtr::NULL);
        let cfg = LaunchConfig::linear(1, 1024);
        self.dev.launch("cross_entropy_loss_sum", cfg, &mut args)?;
        Ok(loss)
    }

    /// Forward: the loss sum and, with `keep`, the per-row log-sum-exp backward reads.
    pub(super) fn head_forward(
        &self,
        s: HeadShape,
        h: HeadIn<'_>,
        keep: bool,
    ) -> Result<(CudaBuf, Option<CudaBuf>)> {
        let p = self.head_plan(s)?;
        let act = h.x.dtype();
        let lse = CudaBuf::uninit(&self.dev, DType::F32, s.rows)?;
        let losses = CudaBuf::uninit(&self.dev, DType::F32, s.rows)?;
        let mut logits = CudaBuf::uninit(&self.dev, act, p.chunk * p.ld)?;
        let bad = self.scratch_flag()?;
        for r in p.chunks() {
            self.chunk_logits(&p, &h, r.clone(), &mut logits)?;
            let mut args = Args::new()
                .ptr(logits.view().ptr())
                .ptr(h.t.ptr().offset((r.start * 4) as u64))
                .ptr(lse.view().range(r.clone())?.ptr())
                .ptr(losses.view().range(r.clone())?.ptr())
                .len(r.len())
                .i32(s.vocab as i32)
                .i32(p.ld as i32)
                .ptr(bad.ptr());
            let name = by_dtype!("cross_entropy_forward", act);
            self.dev
                .launch(name, block_rows(r.len(), s.vocab), &mut args)?;
        }
        let loss = self.head_loss_sum(&losses, s.rows)?;
        Ok((loss, keep.then_some(lse)))
    }

    /// Backward from forward's log-sum-exp: each chunk's logits recomputed, turned into
    /// gradients in place and multiplied out.
    pub(super) fn head_backward(
        &self,
        s: HeadShape,
        h: HeadIn<'_>,
        lse: &CudaBuf,
        g: f32,
        (mut dx, mut dw): (CudaViewMut<'_>, Option<CudaViewMut<'_>>),
    ) -> Result<()> {
        expect_len("head loss backward", "saved log-sum-exp", lse.len(), s.rows)?;
        let p = self.head_plan(s)?;
        let act = h.x.dtype();
        let mut logits = CudaBuf::uninit(&self.dev, act, p.chunk * p.ld)?;
        for r in p.chunks() {
            self.chunk_logits(&p, &h, r.clone(), &mut logits)?;
            let lv = logits.view();
            let mut args = Args::new()
                .ptr(lv.ptr())
                .ptr(h.t.ptr().offset((r.start * 4) as u64))
                .ptr(lse.view().range(r.clone())?.ptr())
                .ptr(lv.ptr())
                .len(r.len())
                .i32(s.vocab as i32)
                .i32(p.ld as i32)
                .f32(g);
            let name = by_dtype!("cross_entropy_backward", act);
            self.dev
                .launch(name, block_rows(r.len(), s.vocab), &mut args)?;
            self.chunk_grads(&p, &h, r, logits.view(), &mut dx, &mut dw)?;
        }
        Ok(())
    }

    /// Forward and backward at once: per chunk the logits, the loss and dlogits in place,
    /// dX and dW; returns the loss sum.
    pub(super) fn head_fused(
        &self,
        s: HeadShape,
        h: HeadIn<'_>,
        g: f32,
        (mut dx, mut dw): (CudaViewMut<'_>, Option<CudaViewMut<'_>>),
    ) -> Result<CudaBuf> {
        let p = self.head_plan(s)?;
        crate::backend::check::target_ids(h.t.host(), s.vocab)?;
        let act = h.x.dtype();
        let losses = CudaBuf::uninit(&self.dev, DType::F32, s.rows)?;
        let mut logits = CudaBuf::uninit(&self.dev, act, p.chunk * p.ld)?;
        let bad = self.scratch_flag()?;
        for r in p.chunks() {
            self.chunk_logits(&p, &h, r.clone(), &mut logits)?;
            let mut args = Args::new()
                .ptr(logits.view().ptr())
                .ptr(h.t.ptr().offset((r.start * 4) as u64))
                .ptr(losses.view().range(r.clone())?.ptr())
                .len(r.len())
                .i32(s.vocab as i32)
                .i32(p.ld as i32)
                .f32(g)
                .ptr(bad.ptr());
            let name = by_dtype!("cross_entropy_fused", act);
            self.dev
                .launch(name, block_rows(r.len(), s.vocab), &mut args)?;
            self.chunk_grads(&p, &h, r, logits.view(), &mut dx, &mut dw)?;
        }
        self.head_loss_sum(&losses, s.rows)
    }
}
