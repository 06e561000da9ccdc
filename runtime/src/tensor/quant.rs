//! Block quantization of flat buffers: ZeRO++'s wire format (qwZ's weights, qgZ's gradients).
//!
//! DeepSpeed's symmetric quantizer (`csrc/includes/quantization_utils.h`,
//! `Params<Symmetric, bits>`), per block of a flat buffer: `amax = max |x|` in f32 (a NaN
//! element is skipped, as CUDA's `fmaxf` skips it), `scale = 2^bits / (2 amax)` (1 when `amax`
//! is 0), `q = clamp(rn(x * scale), -2^(bits-1), 2^(bits-1) - 1)` (`__float2int_rn`: nearest,
//! ties to even), stored with `inv = 1 / scale`; dequantized `q * inv`, rounded once to the
//! output dtype. The block's `amax` maps to `2^(bits-1)` and is clamped one code lower, so
//! the largest positive element loses up to one step (`inv`); every other element at most
//! half a step. DeepSpeed converts its input to f16 first (its kernel reads `__half`); here
//! the storage dtype is widened to f32 exactly, so bf16 and f32 values keep their range.
//!
//! The quantized form of `len` values (a [`Packed`] layout): the blocks' `inv` as f32, then
//! the codes (one byte each at 8 bits; at 4 bits two per byte, the first in the low nibble),
//! padded to a multiple of 4 bytes. It travels as 16-bit words in a buffer of
//! [`WIRE_DTYPE`], which every communicator's all-gather copies without reading.

use half::bf16;

use super::{BufMut, BufRef, DType, FlatBuf};

/// The dtype of a buffer of packed quantized words (a carrier: its elements are never read
/// as numbers, only copied).
pub const WIRE_DTYPE: DType = DType::Bf16;

/// DeepSpeed's `CUDAQuantizer.target_group_size`: qwZ's blocks are near this length.
pub const TARGET_BLOCK: usize = 8000;

/// qgZ's block: DeepSpeed quantizes a gradient tensor in `max(rows, cols, world)` groups,
/// one row of its smaller dimension each (768 elements for GPT-2 small's weights); a unit's
/// flat buffer has no rows at its reduction, so blocks of a fixed 512 elements (even, as
/// 4-bit packing needs) bound each scale's range as a row would.
pub const GRAD_BLOCK: usize = 512;

/// How a flat buffer is cut and coded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuantFormat {
    /// Bits per code: 8 or 4.
    pub bits: u32,
    /// Elements per block (the last block may be shorter); even at 4 bits, so no byte holds
    /// codes of two blocks.
    pub block: usize,
}

/// The packed form of `len` elements in a [`QuantFormat`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Packed {
    /// The format.
    pub fmt: QuantFormat,
    /// Elements.
    pub len: usize,
}

impl QuantFormat {
    /// qwZ's format for a shard of `len` elements: 8 bits, in DeepSpeed's `CUDAQuantizer`
    /// group count: `ceil(len / 8000)` groups, raised until `len` is a multiple of
    /// `8 * groups`, then doubled while `len` is a multiple of `16 * groups` and groups stay
    /// over 8000 elements. DeepSpeed refuses a length that is not a multiple of 8; here such a
    /// shard is cut into `ceil(len / 8000)` equal blocks with a shorter last one.
    pub fn weights(len: usize) -> QuantFormat {
        let block = match deepspeed_groups(len) {
            Some(g) => len / g,
            None => len.div_ceil(len.div_ceil(TARGET_BLOCK).max(1)).max(1),
        };
        QuantFormat { bits: 8, block }
    }

    /// qgZ's format for the part of a gradient one rank owns: 4 bits, DeepSpeed's default
    /// width for its intra-node all-to-all, in blocks of [`GRAD_BLOCK`].
    pub fn gradients(len: usize) -> QuantFormat {
        QuantFormat {
            bits: 4,
            block: GRAD_BLOCK.min(len.next_multiple_of(2)).max(2),
        }
    }

    /// Whether `bits` and `block` are a format the kernels implement.
    pub fn check(&self) -> crate::Result<()> {
        let ok = matches!(self.bits, 4 | 8)
            && self.block > 0
            && (self.bits == 8 || self.block.is_multiple_of(2));
        if ok {
            return Ok(());
        }
        Err(crate::Error::Invalid(format!(
            "quantization: {} bits in blocks of {} (8 bits, or 4 bits in even blocks)",
            self.bits, self.block
        )))
    }

    /// The smallest and largest code.
    pub fn code_range(&self) -> (i32, i32) {
        (-(1 << (self.bits - 1)), (1 << (self.bits - 1)) - 1)
    }
}

/// DeepSpeed's adaptive group count for `n` elements, or `None` where its assertions fail.
fn deepspeed_groups(n: usize) -> Option<usize> {
    if n == 0 || !n.is_multiple_of(8) {
        return None;
    }
    let mut g = n.div_ceil(TARGET_BLOCK);
    while g < n && !n.is_multiple_of(8 * g) {
        g += 1;
    }
    while n.is_multiple_of(16 * g) && n / g > TARGET_BLOCK {
        g *= 2;
    }
    (n.is_multiple_of(8 * g) && n / g < 16000 && n > g).then_some(g)
}

impl Packed {
    /// Blocks (and scales).
    pub fn blocks(&self) -> usize {
        self.len.div_ceil(self.fmt.block)
    }
    /// Bytes of codes.
    pub fn code_bytes(&self) -> usize {
        (self.len * self.fmt.bits as usize).div_ceil(8)
    }
    /// Bytes on the wire: scales and codes, padded to a multiple of 4.
    pub fn bytes(&self) -> usize {
        (4 * self.blocks() + self.code_bytes()).next_multiple_of(4)
    }
    /// 16-bit words of [`WIRE_DTYPE`] holding [`Packed::bytes`].
    pub fn words(&self) -> usize {
        self.bytes() / 2
    }
}

/// The block's scale and stored inverse for its largest magnitude `amax`.
pub fn block_scale(amax: f32, bits: u32) -> (f32, f32) {
    let scale = if amax == 0.0 {
        1.0
    } else {
        (1u32 << bits) as f32 / (2.0 * amax)
    };
    (scale, 1.0 / scale)
}

/// Quantizes `x` (the packed layout's `len` elements) into `out` ([`Packed::bytes`] bytes).
pub fn quantize_f32(x: &[f32], fmt: QuantFormat, out: &mut [u8]) {
    let p = Packed { fmt, len: x.len() };
    let (scales, codes) = out[..p.bytes()].split_at_mut(4 * p.blocks());
    codes.fill(0);
    let (lo, hi) = fmt.code_range();
    for (b, xs) in x.chunks(fmt.block).enumerate() {
        let amax = xs.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let (scale, inv) = block_scale(amax, fmt.bits);
        scales[4 * b..4 * b + 4].copy_from_slice(&inv.to_le_bytes());
        for (j, &v) in xs.iter().enumerate() {
            let q = ((v * scale).round_ties_even() as i32).clamp(lo, hi);
            put_code(codes, b * fmt.block + j, q, fmt.bits);
        }
    }
}

/// Dequantizes `len` elements from `src` ([`Packed::bytes`] bytes) into `y` as f32.
pub fn dequantize_f32(src: &[u8], fmt: QuantFormat, y: &mut [f32]) {
    let p = Packed { fmt, len: y.len() };
    let (scales, codes) = src[..p.bytes()].split_at(4 * p.blocks());
    for (i, v) in y.iter_mut().enumerate() {
        let b = i / fmt.block;
        let inv = f32::from_le_bytes(scales[4 * b..4 * b + 4].try_into().expect("4 bytes"));
        *v = get_code(codes, i, fmt.bits) as f32 * inv;
    }
}

fn put_code(codes: &mut [u8], i: usize, q: i32, bits: u32) {
    if bits == 8 {
        codes[i] = q as i8 as u8;
    } else {
        let nib = (q as u8) & 0xf;
        codes[i / 2] |= if i.is_multiple_of(2) { nib } else { nib << 4 };
    }
}

fn get_code(codes: &[u8], i: usize, bits: u32) -> i32 {
    if bits == 8 {
        return codes[i] as i8 as i32;
    }
    let byte = codes[i / 2];
    let nib = if i.is_multiple_of(2) {
        byte & 0xf
    } else {
        byte >> 4
    };
    // Sign-extend the nibble.
    ((nib << 4) as i8 >> 4) as i32
}

/// The bytes of a buffer of [`WIRE_DTYPE`] words (little-endian, as they lie in memory).
pub fn wire_bytes(words: &[bf16]) -> Vec<u8> {
    words
        .iter()
        .flat_map(|w| w.to_bits().to_le_bytes())
        .collect()
}

/// Writes `bytes` (an even number) into `words`.
pub fn set_wire_bytes(words: &mut [bf16], bytes: &[u8]) {
    for (w, b) in words.iter_mut().zip(bytes.chunks_exact(2)) {
        *w = bf16::from_bits(u16::from_le_bytes([b[0], b[1]]));
    }
}

/// Quantizes host `x` into the packed words `out` (CPU arm of `Storage::quantize_into`).
pub(super) fn quantize_host(x: BufRef<'_>, fmt: QuantFormat, out: BufMut<'_>) -> crate::Result<()> {
    let p = Packed { fmt, len: x.len() };
    let mut v = vec![0.0f32; x.len()];
    FlatBuf::widen_into(x, &mut v);
    let mut bytes = vec![0u8; p.bytes()];
    quantize_f32(&v, fmt, &mut bytes);
    match out {
        BufMut::Bf16(w) => set_wire_bytes(w, &bytes),
        other => return Err(wire_dtype_error(other.dtype())),
    }
    Ok(())
}

/// Dequantizes host packed words into `y` (CPU arm of `Storage::dequantize_into`).
pub(super) fn dequantize_host(
    src: BufRef<'_>,
    fmt: QuantFormat,
    y: &mut FlatBuf,
    offset: usize,
    len: usize,
) -> crate::Result<()> {
    let BufRef::Bf16(w) = src else {
        return Err(wire_dtype_error(src.dtype()));
    };
    let mut v = vec![0.0f32; len];
    dequantize_f32(&wire_bytes(w), fmt, &mut v);
    y.store_f32(offset, &v);
    Ok(())
}

/// A packed buffer of another dtype than [`WIRE_DTYPE`].
pub fn wire_dtype_error(got: DType) -> crate::Error {
    crate::Error::Invalid(format!(
        "quantized words travel as {WIRE_DTYPE:?}, got a {got:?} buffer"
    ))
}
