//! The block quantizer on the device (`kernels/quant.cu`): `tensor::quant`'s CPU arithmetic,
//! bit for bit, over device buffers. The packed words are a buffer of
//! [`WIRE_DTYPE`](crate::tensor::quant::WIRE_DTYPE) whose bytes the kernels address directly.

use std::ops::Range;

use super::driver::{DevPtr, LaunchConfig};
use super::launch::Args;
use super::storage::{by_dtype, CudaBuf};
use crate::tensor::quant::{Packed, QuantFormat};
use crate::Result;

/// Threads per block of `quantize_T` (its shared maximum is sized for it).
const QUANT_THREADS: u32 = 256;

impl CudaBuf {
    /// `self[range]` quantized in `fmt` into the words of `out` from `word_offset` (both on
    /// one device).
    pub fn quantize_into(
        &self,
        range: Range<usize>,
        fmt: QuantFormat,
        out: &mut CudaBuf,
        word_offset: usize,
    ) -> Result<()> {
        let n = range.len();
        if n == 0 {
            return Ok(());
        }
        let blocks = Packed { fmt, len: n }.blocks();
        let x = self.view().range(range)?.ptr();
        let end = out.len();
        let y = out.view_mut().range(word_offset..end)?.ptr();
        let dev = self.device().clone();
        let mut args = args(x, n, fmt, y)?;
        let cfg = LaunchConfig::linear(blocks as u32, QUANT_THREADS);
        dev.launch(by_dtype!("quantize", self.dtype()), cfg, &mut args)
    }

    /// `len` elements dequantized from the packed words of `self` at `word_offset` into
    /// `dst[offset..offset + len]`, rounded once to `dst`'s dtype.
    pub fn dequantize_into(
        &self,
        word_offset: usize,
        fmt: QuantFormat,
        dst: &mut CudaBuf,
        offset: usize,
        len: usize,
    ) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let src = self.view().range(word_offset..self.len())?.ptr();
        let y = dst.view_mut().range(offset..offset + len)?.ptr();
        let dev = self.device().clone();
        let mut args = args(src, len, fmt, y)?;
        let name = by_dtype!("dequantize", dst.dtype());
        dev.launch(name, dev.grid_for(len), &mut args)
    }
}

/// Both kernels' parameters: the source, its element count, the format (the block length as
/// the kernels' `int`) and the destination.
fn args(src: DevPtr, n: usize, fmt: QuantFormat, dst: DevPtr) -> Result<Args> {
    let block = i32::try_from(fmt.block).map_err(|_| {
        crate::Error::Invalid(format!("quantization block of {} elements", fmt.block))
    })?;
    Ok(Args::new()
        .ptr(src)
        .len(n)
        .i32(block)
        .i32(fmt.bits as i32)
        .ptr(dst))
}
