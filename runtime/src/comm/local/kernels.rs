//! The element loops of the shared-memory collectives: rank-ordered reduction in f32 over
//! cache-sized blocks, and the dtype conversions around it.
//!
//! Every reduced element is `((x0 + x1) + x2) + ...` in f32, divided by the world size for
//! `Avg`, rounded once to the buffer's dtype. `Max` propagates NaN so that an overflow on any
//! rank stays visible after the reduction.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use crate::comm::ReduceOp;

/// Elements per block: two f32 blocks of this size stay in L1 while every rank's slice of
/// the block is folded in.
pub(crate) const BLOCK: usize = 2048;

/// A communicable element type.
pub(crate) trait Elem: Copy + Send + Sync + 'static {
    /// Widens `src` into `dst` (same length).
    fn load(src: &[Self], dst: &mut [f32]);
    /// Rounds `src` into `dst` (same length), round-to-nearest-even.
    fn store(src: &[f32], dst: &mut [Self]);
    /// Folds `src` into `acc` with `op`, widening through `tmp` where needed.
    fn combine(acc: &mut [f32], src: &[Self], tmp: &mut [f32], op: ReduceOp) {
        let tmp = &mut tmp[..src.len()];
        Self::load(src, tmp);
        combine_f32(acc, tmp, op);
    }
}

impl Elem for f32 {
    fn load(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    fn store(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    fn combine(acc: &mut [f32], src: &[f32], _tmp: &mut [f32], op: ReduceOp) {
        combine_f32(acc, src, op);
    }
}

impl Elem for bf16 {
    fn load(src: &[bf16], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
    fn store(src: &[f32], dst: &mut [bf16]) {
        dst.convert_from_f32_slice(src);
    }
}

impl Elem for f16 {
    fn load(src: &[f16], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
    fn store(src: &[f32], dst: &mut [f16]) {
        dst.convert_from_f32_slice(src);
    }
}

/// `acc[i] = acc[i] op src[i]`; written as plain zipped loops so that they vectorize.
pub(crate) fn combine_f32(acc: &mut [f32], src: &[f32], op: ReduceOp) {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => {
            for (a, b) in acc.iter_mut().zip(src) {
                *a += *b;
            }
        }
        ReduceOp::Max => {
            for (a, b) in acc.iter_mut().zip(src) {
                *a = max_nan(*a, *b);
            }
        }
    }
}

/// Maximum that returns NaN when either side is NaN (`f32::max` would hide it).
#[inline]
pub(crate) fn max_nan(a: f32, b: f32) -> f32 {
    if b > a || b.is_nan() {
        b
    } else {
        a
    }
}

/// Applies the final step of `op` (the division of `Avg`) to a block of sums.
pub(crate) fn finish(acc: &mut [f32], op: ReduceOp, world_size: usize) {
    if op == ReduceOp::Avg {
        let n = world_size as f32;
        for a in acc.iter_mut() {
            *a /= n;
        }
    }
}

/// Reduces `srcs[k][lo..hi]` over k in rank order and writes the result to every
/// `dsts[j][lo..hi]`, one block at a time.
///
/// # Safety
/// Every pointer must be valid for reads (`srcs`) or writes (`dsts`) of `hi` elements, and
/// no other thread may access `lo..hi` of them during the call. A source may equal a
/// destination (in-place all-reduce): each block is read completely before it is written.
pub(crate) unsafe fn reduce_range<T: Elem>(
    srcs: &[*const T],
    dsts: &[*mut T],
    lo: usize,
    hi: usize,
    op: ReduceOp,
) {
    let mut acc = [0f32; BLOCK];
    let mut tmp = [0f32; BLOCK];
    let n = srcs.len();
    let mut start = lo;
    while start < hi {
        let m = BLOCK.min(hi - start);
        let acc = &mut acc[..m];
        // SAFETY: the caller guarantees `start + m <= hi` elements are readable.
        T::load(
            unsafe { std::slice::from_raw_parts(srcs[0].add(start), m) },
            acc,
        );
        for src in &srcs[1..] {
            // SAFETY: as above.
            let s = unsafe { std::slice::from_raw_parts(src.add(start), m) };
            T::combine(acc, s, &mut tmp, op);
        }
        finish(acc, op, n);
        for dst in dsts {
            // SAFETY: the caller guarantees exclusive access to this range of every destination.
            T::store(acc, unsafe {
                std::slice::from_raw_parts_mut(dst.add(start), m)
            });
        }
        start += m;
    }
}

/// Splits `len` elements into `parts` contiguous ranges of whole 64-element units (so that
/// two ranks rarely write the same cache line) and returns range `i`.
pub(crate) fn chunk(len: usize, parts: usize, i: usize) -> (usize, usize) {
    const UNIT: usize = 64;
    let units = len.div_ceil(UNIT);
    let per = units / parts;
    let extra = units % parts;
    let start = i * per + i.min(extra);
    let count = per + usize::from(i < extra);
    ((start * UNIT).min(len), ((start + count) * UNIT).min(len))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_the_range_exactly_once() {
        for len in [0, 1, 63, 64, 65, 1000, 4096, 100_003] {
            for parts in 1..=8 {
                let mut next = 0;
                for i in 0..parts {
                    let (lo, hi) = chunk(len, parts, i);
                    assert_eq!(lo, next, "len {len} parts {parts} chunk {i}");
                    assert!(hi >= lo);
                    next = hi;
                }
                assert_eq!(next, len);
            }
        }
    }

    #[test]
    fn max_propagates_nan_from_either_side() {
        assert!(max_nan(f32::NAN, 1.0).is_nan());
        assert!(max_nan(1.0, f32::NAN).is_nan());
        assert_eq!(max_nan(1.0, 2.0), 2.0);
        assert_eq!(max_nan(-1.0, -2.0), -1.0);
    }

    #[test]
    fn half_slice_conversions_round_like_scalar_ones() {
        let xs: Vec<f32> = (0..5000).map(|i| (i as f32 * 0.7311).sin() * 1e3).collect();
        let mut h = vec![f16::ZERO; xs.len()];
        f16::store(&xs, &mut h);
        let mut b = vec![bf16::ZERO; xs.len()];
        bf16::store(&xs, &mut b);
        for (i, x) in xs.iter().enumerate() {
            assert_eq!(h[i].to_bits(), f16::from_f32(*x).to_bits());
            assert_eq!(b[i].to_bits(), bf16::from_f32(*x).to_bits());
        }
    }
}
