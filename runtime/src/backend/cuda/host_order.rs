//! The device's sum of squares computed in host memory: the `sum_squares` and
//! `sum_squares_finalize` kernels' order of additions, replayed element for element, so a
//! gradient accumulated in host memory (offloaded optimizer state) gives the norm's bits the
//! same gradient gives on the device. Each block's segment, each thread's strided run of
//! 16-byte packs (or elements, when the view is not 16-byte aligned), the warps' butterfly
//! sums, the block's sum of warp sums and the partials in block order are the kernels' own.
//! Every square is exact in f64, so only the order of additions matters.

use half::{bf16, f16};
use rayon::prelude::*;

use crate::tensor::{BufRef, DType};

/// Threads per block of the `sum_squares` launch (`status.rs`).
const THREADS: usize = 256;
/// Lanes of a warp.
const WARP: usize = 32;

/// The sum of squares of `v` in the order the device's kernels add them.
pub(crate) fn sum_squares(v: BufRef<'_>) -> f64 {
    match v {
        BufRef::F32(s) => in_device_order(s, 4, |x| x),
        BufRef::Bf16(s) => in_device_order(s, 8, bf16::to_f32),
        BufRef::F16(s) => in_device_order(s, 8, f16::to_f32),
    }
}

/// The sum of squares of `v` as an accumulator of `dtype` holds it (f32 values rounded), in
/// the order of that accumulator's kernel (`sum_squares_f32_as_bf16`, `_as_f16`).
pub(crate) fn sum_squares_as(v: BufRef<'_>, dtype: DType) -> f64 {
    match (v, dtype) {
        (BufRef::F32(s), DType::Bf16) => in_device_order(s, 8, |x| bf16::from_f32(x).to_f32()),
        (BufRef::F32(s), DType::F16) => in_device_order(s, 8, |x| f16::from_f32(x).to_f32()),
        _ => sum_squares(v),
    }
}

/// The kernels' order over `x` taken `pack` elements at a time (16 bytes of the dtype the
/// values stand for): the packed path needs the base aligned to `pack` stored elements.
fn in_device_order<T: Copy + Sync>(x: &[T], pack: usize, to_f32: impl Fn(T) -> f32 + Sync) -> f64 {
    let n = x.len();
    if n == 0 {
        return 0.0;
    }
    let aligned = (x.as_ptr() as usize).is_multiple_of(pack * std::mem::size_of::<T>());
    let blocks = n.div_ceil(4096).clamp(1, 1024);
    let seg = n.div_ceil(blocks).div_ceil(pack) * pack;
    let sq = |e: T| {
        let d = f64::from(to_f32(e));
        d * d
    };
    let partials: Vec<f64> = (0..blocks)
        .into_par_iter()
        .map(|b| {
            let lo = (b * seg).min(n);
            let xs = &x[lo..(lo + seg).min(n)];
            let mut acc = [0.0f64; THREADS];
            let done = match aligned {
                true => xs.len() / pack * pack,
                false => 0,
            };
            // Thread t takes packs t, t + THREADS, ...: pack p is thread p % THREADS's next.
            for (p, run) in xs[..done].chunks_exact(pack).enumerate() {
                let a = &mut acc[p % THREADS];
                run.iter().for_each(|&e| *a += sq(e));
            }
            for (i, &e) in xs[done..].iter().enumerate() {
                acc[i % THREADS] += sq(e);
            }
            block_sum(&acc)
        })
        .collect();
    partials.iter().fold(0.0, |s, &p| s + p)
}

/// `fz_block_sum`: each warp's butterfly sum, then the butterfly sum of the warp sums (lanes
/// past the warp count add zeros); every lane ends with the same value, lane 0's is kept.
fn block_sum(acc: &[f64; THREADS]) -> f64 {
    let mut lanes = [0.0f64; WARP];
    for (w, warp) in acc.chunks_exact(WARP).enumerate() {
        lanes[w] = warp_sum(warp.try_into().expect("a warp of lanes"));
    }
    warp_sum(lanes)
}

/// `fz_warp_sum`: `v += shfl_xor(v, o)` for o = 16, 8, 4, 2, 1; lane 0's result.
fn warp_sum(mut v: [f64; WARP]) -> f64 {
    let mut o = WARP / 2;
    while o > 0 {
        let before = v;
        for (l, x) in v.iter_mut().enumerate() {
            *x += before[l ^ o];
        }
        o /= 2;
    }
    v[0]
}
