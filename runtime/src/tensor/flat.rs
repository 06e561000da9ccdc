//! Flat buffers in a storage dtype (f32, bf16 or f16) and their conversions: the engine's
//! parameter and gradient storage and the communication worker's owned buffers.
//!
//! Parameters and gradients live in the precision's storage dtype; compute always reads f32.
//! Rounding goes through `half`'s slice conversions (round to nearest even), which are fast
//! and identical on every code path, so a value rounds the same way in every stage.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use rayon::prelude::*;

use super::{BufMut, BufRef, DType};

/// Buffers at least this long are filled, added and scanned on the rayon pool (elementwise
/// work, so the result never depends on how it is split).
const PAR_MIN: usize = 1 << 18;
/// Elements per parallel task: large enough that a task outweighs its hand-off.
const PAR_CHUNK: usize = 1 << 16;

/// An owned flat buffer in one storage dtype.
#[derive(Debug, Clone, PartialEq)]
pub enum FlatBuf {
    /// f32 storage.
    F32(Vec<f32>),
    /// bf16 storage.
    Bf16(Vec<bf16>),
    /// f16 storage.
    F16(Vec<f16>),
}

/// `src` widened into `dst` (same length), on this thread.
fn widen(src: BufRef<'_>, dst: &mut [f32]) {
    match src {
        BufRef::F32(s) => dst.copy_from_slice(s),
        BufRef::Bf16(s) => s.convert_to_f32_slice(dst),
        BufRef::F16(s) => s.convert_to_f32_slice(dst),
    }
}

/// `d += s` over half-precision elements, each widened to f32, added and rounded once, in
/// cache-sized runs on the rayon pool (element by element, so the split changes no bit).
fn add_rounded<T: Send + Sync>(d: &mut [T], s: &[T])
where
    [T]: HalfFloatSliceExt,
{
    const RUN: usize = 1 << 14;
    d.par_chunks_mut(RUN).zip(s.par_chunks(RUN)).for_each_init(
        || vec![0.0f32; 2 * RUN],
        |buf, (d, s)| {
            let (acc, add) = buf.split_at_mut(RUN);
            let (acc, add) = (&mut acc[..d.len()], &mut add[..d.len()]);
            d.convert_to_f32_slice(acc);
            s.convert_to_f32_slice(add);
            acc.iter_mut().zip(add.iter()).for_each(|(a, b)| *a += *b);
            d.convert_from_f32_slice(acc);
        },
    );
}

impl FlatBuf {
    /// A zero-filled buffer (a large one may be a reused buffer from [`super::spare`]).
    pub fn zeros(dtype: DType, len: usize) -> Self {
        if let Some(mut b) = super::spare::reuse(dtype, len) {
            b.fill_zero();
            return b;
        }
        use ferrozero_offload::huge::{advise_huge_pages, filled_vec};
        // Large buffers ask for transparent huge pages before their first write: the
        // optimizer and the reductions stream through them, and 4 KiB pages stop the
        // hardware prefetchers at every page boundary.
        match dtype {
            DType::F32 => {
                // calloc maps fresh zero pages without writing them: advise, stay lazy.
                let v = vec![0.0f32; len];
                advise_huge_pages(v.as_ptr().cast(), len * 4);
                FlatBuf::F32(v)
            }
            DType::Bf16 => FlatBuf::Bf16(filled_vec(len, bf16::ZERO)),
            DType::F16 => FlatBuf::F16(filled_vec(len, f16::ZERO)),
        }
    }

    /// An owned copy of borrowed host elements.
    pub fn from_ref(b: BufRef<'_>) -> Self {
        match b {
            BufRef::F32(s) => FlatBuf::F32(s.to_vec()),
            BufRef::Bf16(s) => FlatBuf::Bf16(s.to_vec()),
            BufRef::F16(s) => FlatBuf::F16(s.to_vec()),
        }
    }

    /// Element count.
    pub fn len(&self) -> usize {
        match self {
            FlatBuf::F32(v) => v.len(),
            FlatBuf::Bf16(v) => v.len(),
            FlatBuf::F16(v) => v.len(),
        }
    }

    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The dtype.
    pub fn dtype(&self) -> DType {
        match self {
            FlatBuf::F32(_) => DType::F32,
            FlatBuf::Bf16(_) => DType::Bf16,
            FlatBuf::F16(_) => DType::F16,
        }
    }

    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        (self.len() * self.dtype().size()) as u64
    }

    /// A read-only communication view of the whole buffer.
    pub fn as_ref(&self) -> BufRef<'_> {
        self.as_ref_range(0..self.len())
    }

    /// A mutable communication view of the whole buffer.
    pub fn as_mut(&mut self) -> BufMut<'_> {
        let n = self.len();
        self.as_mut_range(0..n)
    }

    /// A read-only communication view of `range`.
    pub fn as_ref_range(&self, range: std::ops::Range<usize>) -> BufRef<'_> {
        match self {
            FlatBuf::F32(v) => BufRef::F32(&v[range]),
            FlatBuf::Bf16(v) => BufRef::Bf16(&v[range]),
            FlatBuf::F16(v) => BufRef::F16(&v[range]),
        }
    }

    /// A mutable communication view of `range`.
    pub fn as_mut_range(&mut self, range: std::ops::Range<usize>) -> BufMut<'_> {
        match self {
            FlatBuf::F32(v) => BufMut::F32(&mut v[range]),
            FlatBuf::Bf16(v) => BufMut::Bf16(&mut v[range]),
            FlatBuf::F16(v) => BufMut::F16(&mut v[range]),
        }
    }

    /// Writes `src` (f32) into `self[offset..]`, rounding to the storage dtype.
    pub fn store_f32(&mut self, offset: usize, src: &[f32]) {
        let r = offset..offset + src.len();
        match self {
            FlatBuf::F32(v) => v[r].copy_from_slice(src),
            FlatBuf::Bf16(v) => v[r].convert_from_f32_slice(src),
            FlatBuf::F16(v) => v[r].convert_from_f32_slice(src),
        }
    }

    /// Reads `self[offset..offset + dst.len()]` into `dst` as f32.
    pub fn load_f32(&self, offset: usize, dst: &mut [f32]) {
        widen(self.as_ref().range(offset..offset + dst.len()), dst);
    }

    /// Widens all of `src` into `dst` (same length), in parallel for long runs (widening is
    /// exact, so the split changes no value).
    pub fn widen_into(src: BufRef<'_>, dst: &mut [f32]) {
        if src.len() < PAR_MIN {
            return widen(src, dst);
        }
        dst.par_chunks_mut(PAR_CHUNK)
            .enumerate()
            .for_each(|(i, d)| widen(src.range(i * PAR_CHUNK..i * PAR_CHUNK + d.len()), d));
    }

    /// `dst = src` byte for byte (same length), on every core past a few megabytes: one core
    /// copies a fraction of what the memory system moves, and a speculative step's snapshot
    /// is gigabytes (GPT-2 124M's optimizer state is 1.5 GB).
    pub fn copy_bytes(dst: &mut [u8], src: &[u8]) {
        const RUN: usize = 1 << 22;
        assert_eq!(dst.len(), src.len(), "copy_bytes: lengths differ");
        if src.len() < 2 * RUN {
            return dst.copy_from_slice(src);
        }
        dst.par_chunks_mut(RUN)
            .zip(src.par_chunks(RUN))
            .for_each(|(d, s)| d.copy_from_slice(s));
    }

    /// Adds the first `n` elements of `src` (same dtype) into `self[offset..offset + n]`, in
    /// f32 and rounded once per element.
    pub fn accumulate(&mut self, offset: usize, src: &FlatBuf, n: usize, scratch: &mut Vec<f32>) {
        self.accumulate_ref(offset, src.as_ref().range(0..n), scratch)
    }

    /// Adds all of `src` (same dtype) into `self[offset..offset + src.len()]`, in f32 and
    /// rounded once per element.
    pub fn accumulate_ref(&mut self, offset: usize, src: BufRef<'_>, scratch: &mut Vec<f32>) {
        let n = src.len();
        match (self, src) {
            (FlatBuf::F32(d), BufRef::F32(s)) => {
                let add = |(d, s): (&mut [f32], &[f32])| {
                    d.iter_mut().zip(s).for_each(|(a, b)| *a += *b);
                };
                let (d, s) = (&mut d[offset..offset + n], &s[..n]);
                if n >= PAR_MIN {
                    d.par_chunks_mut(PAR_CHUNK)
                        .zip(s.par_chunks(PAR_CHUNK))
                        .for_each(add);
                } else {
                    add((d, s));
                }
            }
            // A gradient coming down from the device: a pass over gigabytes, so in parallel.
            (FlatBuf::Bf16(d), BufRef::Bf16(s)) if n >= PAR_MIN => {
                add_rounded(&mut d[offset..offset + n], s)
            }
            (FlatBuf::F16(d), BufRef::F16(s)) if n >= PAR_MIN => {
                add_rounded(&mut d[offset..offset + n], s)
            }
            (d, s) => {
                // In cache-sized chunks: no buffer as large as the gradient, one pass over it.
                const CHUNK: usize = 1 << 14;
                scratch.resize(2 * CHUNK.min(n), 0.0);
                let mut start = 0;
                while start < n {
                    let k = CHUNK.min(n - start);
                    let (acc, add) = scratch.split_at_mut(CHUNK.min(n));
                    let (acc, add) = (&mut acc[..k], &mut add[..k]);
                    d.load_f32(offset + start, acc);
                    widen(s.range(start..start + k), add);
                    for (a, b) in acc.iter_mut().zip(add.iter()) {
                        *a += *b;
                    }
                    d.store_f32(offset + start, acc);
                    start += k;
                }
            }
        }
    }

    /// Sets every element to zero.
    pub fn fill_zero(&mut self) {
        fn fill<T: Copy + Send + Sync>(v: &mut [T], zero: T) {
            if v.len() >= PAR_MIN {
                v.par_chunks_mut(PAR_CHUNK).for_each(|c| c.fill(zero));
            } else {
                v.fill(zero);
            }
        }
        match self {
            FlatBuf::F32(v) => fill(v, 0.0),
            FlatBuf::Bf16(v) => fill(v, bf16::ZERO),
            FlatBuf::F16(v) => fill(v, f16::ZERO),
        }
    }

    /// Whether any element of `range` is infinite or NaN.
    pub fn has_non_finite(&self, range: std::ops::Range<usize>) -> bool {
        // Exponent bits all ones means Inf or NaN. Each chunk is an OR over every element (no
        // early exit), which the compiler vectorises; chunks run in parallel and stop early.
        fn any_exp_ones<T: Copy + Sync>(v: &[T], bits: impl Fn(T) -> u32 + Sync, exp: u32) -> bool {
            let chunk = |c: &[T]| {
                c.iter()
                    .fold(0u32, |a, &x| a | u32::from(bits(x) & exp == exp))
                    != 0
            };
            if v.len() >= PAR_MIN {
                v.par_chunks(PAR_CHUNK).any(chunk)
            } else {
                v.chunks(PAR_CHUNK).any(chunk)
            }
        }
        match self {
            FlatBuf::F32(v) => any_exp_ones(&v[range], f32::to_bits, 0x7f80_0000),
            FlatBuf::Bf16(v) => any_exp_ones(&v[range], |x| u32::from(x.to_bits()), 0x7f80),
            FlatBuf::F16(v) => any_exp_ones(&v[range], |x| u32::from(x.to_bits()), 0x7c00),
        }
    }

    /// Sum of squares of `range` in f64, in an order fixed by the range's length alone (see
    /// [`sum_squares_blocked`]), so the result is the same whatever the thread count. Every
    /// square is exact in f64 and the sum cannot overflow, so the result is finite exactly
    /// when every element is.
    pub fn sum_squares(&self, range: std::ops::Range<usize>) -> f64 {
        match self {
            FlatBuf::F32(v) => sum_squares_blocked(&v[range], |x| x),
            FlatBuf::Bf16(v) => sum_squares_blocked(&v[range], bf16::to_f32),
            FlatBuf::F16(v) => sum_squares_blocked(&v[range], f16::to_f32),
        }
    }
}

impl BufRef<'_> {
    /// Sum of squares of every element in f64, in the order [`FlatBuf::sum_squares`] uses.
    pub fn sum_squares(&self) -> f64 {
        match self {
            BufRef::F32(v) => sum_squares_blocked(v, |x| x),
            BufRef::Bf16(v) => sum_squares_blocked(v, bf16::to_f32),
            BufRef::F16(v) => sum_squares_blocked(v, f16::to_f32),
        }
    }
}

impl BufRef<'_> {
    /// Sum of squares of the elements as an accumulator of `dtype` holds them (f32 values
    /// rounded to it; others as they are), in the order [`FlatBuf::sum_squares`] uses: the
    /// bits of the sum over that accumulator.
    pub fn sum_squares_as(&self, dtype: DType) -> f64 {
        match (self, dtype) {
            (BufRef::F32(v), DType::Bf16) => sum_squares_blocked(v, |x| bf16::from_f32(x).to_f32()),
            (BufRef::F32(v), DType::F16) => sum_squares_blocked(v, |x| f16::from_f32(x).to_f32()),
            _ => self.sum_squares(),
        }
    }
}

/// Each element as an accumulator of `dtype` holds it once added into zeros: rounded to
/// `dtype` (to nearest even; f16 overflows to infinity), then `+ 0.0` (so -0.0 is +0.0).
pub fn round_as_accumulated(v: &mut [f32], dtype: DType) {
    let round = |c: &mut [f32]| match dtype {
        DType::F32 => c.iter_mut().for_each(|x| *x += 0.0),
        DType::Bf16 => c
            .iter_mut()
            .for_each(|x| *x = bf16::from_f32(*x).to_f32() + 0.0),
        DType::F16 => c
            .iter_mut()
            .for_each(|x| *x = f16::from_f32(*x).to_f32() + 0.0),
    };
    if v.len() >= PAR_MIN {
        v.par_chunks_mut(PAR_CHUNK).for_each(round);
    } else {
        round(v);
    }
}

/// Lanes of one chunk's sum: element `i` goes to lane `i % LANES`, so the lanes are
/// independent chains the compiler vectorises instead of one latency-bound chain.
const LANES: usize = 8;

/// Sum of squares in f64: [`PAR_CHUNK`]-element chunks from the start of `v`, each summed in
/// [`LANES`] lanes combined pairwise ((0+1)+(2+3))+((4+5)+(6+7)), the chunk sums added in
/// chunk order from -0.0. Chunks run on the rayon pool; the order of every addition depends
/// only on `v.len()`.
fn sum_squares_blocked<T: Copy + Sync>(v: &[T], f32_of: impl Fn(T) -> f32 + Sync) -> f64 {
    let chunk = |c: &[T]| {
        let mut lanes = [0.0f64; LANES];
        let mut blocks = c.chunks_exact(LANES);
        for b in &mut blocks {
            for (l, &x) in lanes.iter_mut().zip(b) {
                let x = f64::from(f32_of(x));
                *l += x * x;
            }
        }
        for (l, &x) in lanes.iter_mut().zip(blocks.remainder()) {
            let x = f64::from(f32_of(x));
            *l += x * x;
        }
        let [a, b, c, d, e, f, g, h] = lanes;
        ((a + b) + (c + d)) + ((e + f) + (g + h))
    };
    let sums: Vec<f64> = if v.len() >= PAR_MIN {
        v.par_chunks(PAR_CHUNK).map(chunk).collect()
    } else {
        v.chunks(PAR_CHUNK).map(chunk).collect()
    };
    sums.into_iter().fold(-0.0, |acc, s| acc + s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_round_trip_and_accumulate() {
        let mut b = FlatBuf::zeros(DType::Bf16, 4);
        b.store_f32(0, &[1.0, 2.5, -3.0, 1e-3]);
        let mut out = [0.0; 4];
        b.load_f32(0, &mut out);
        assert_eq!(out[..3], [1.0, 2.5, -3.0]);
        let add = FlatBuf::Bf16(vec![bf16::from_f32(1.0); 2]);
        let mut scratch = Vec::new();
        b.accumulate(1, &add, 2, &mut scratch);
        b.load_f32(0, &mut out);
        assert_eq!(out[..3], [1.0, 3.5, -2.0]);
    }

    /// A long half-precision accumulate (the parallel runs) gives every element the bits of
    /// one widen-add-round, at an offset that is no multiple of the run length.
    #[test]
    fn parallel_half_accumulate_rounds_each_element_once() {
        let n = PAR_MIN + 12_345;
        let vals = |k: usize| -> Vec<f32> {
            (0..n)
                .map(|i| ((i * k) % 2039) as f32 * 0.0137 - 13.0)
                .collect()
        };
        for dt in [DType::Bf16, DType::F16] {
            let (mut d, mut s) = (FlatBuf::zeros(dt, n + 7), FlatBuf::zeros(dt, n));
            d.store_f32(0, &vals(7919)[..7]);
            d.store_f32(7, &vals(7919));
            s.store_f32(0, &vals(104_729));
            let mut want = d.clone();
            let (mut a, mut b) = (vec![0.0; 1], vec![0.0; 1]);
            for i in 0..n {
                want.load_f32(7 + i, &mut a);
                s.load_f32(i, &mut b);
                want.store_f32(7 + i, &[a[0] + b[0]]);
            }
            d.accumulate(7, &s, n, &mut Vec::new());
            assert_eq!(d, want, "{dt:?}");
        }
    }

    #[test]
    fn parallel_passes_match_the_sequential_ones() {
        let n = PAR_MIN + PAR_CHUNK / 3;
        let src: Vec<f32> = (0..n)
            .map(|i| ((i * 7919) % 1013) as f32 * 0.37 - 150.0)
            .collect();
        let mut d = FlatBuf::F32((0..n).map(|i| i as f32 * 1e-3).collect());
        let want: Vec<f32> = match &d {
            FlatBuf::F32(v) => v.iter().zip(&src).map(|(a, b)| a + b).collect(),
            _ => unreachable!(),
        };
        d.accumulate(0, &FlatBuf::F32(src.clone()), n, &mut Vec::new());
        assert_eq!(d, FlatBuf::F32(want.clone()));
        let seq: f64 = want[5..n - 9]
            .iter()
            .map(|&x| (x as f64) * (x as f64))
            .sum();
        let blocked = d.sum_squares(5..n - 9);
        assert!((blocked - seq).abs() <= 1e-12 * seq, "{blocked} vs {seq}");
        // The order is the length's alone: the same bits on one thread as on the pool.
        let one = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        assert_eq!(
            one.install(|| d.sum_squares(5..n - 9)).to_bits(),
            blocked.to_bits()
        );
        for dt in [DType::F32, DType::Bf16, DType::F16] {
            let mut b = FlatBuf::zeros(dt, n);
            b.store_f32(0, &src);
            assert!(!b.has_non_finite(0..n), "{dt:?}");
            assert!(b.sum_squares(0..n).is_finite(), "{dt:?}");
            for (at, bad) in [
                (n - 1, f32::NAN),
                (PAR_CHUNK + 3, f32::INFINITY),
                (0, f32::NEG_INFINITY),
            ] {
                let mut c = b.clone();
                c.store_f32(at, &[bad]);
                assert!(c.has_non_finite(0..n), "{dt:?} {bad} at {at}");
                assert!(!c.has_non_finite(at + 1..n), "{dt:?} past {at}");
                // The engine's overflow check: a non-finite sum of squares.
                assert!(!c.sum_squares(0..n).is_finite(), "{dt:?} {bad} at {at}");
            }
            b.fill_zero();
            assert_eq!(b, FlatBuf::zeros(dt, n), "{dt:?}");
            b.store_f32(0, &src);
            let (mut seq, mut par) = (vec![0.0; n], vec![1.0; n]);
            b.load_f32(0, &mut seq);
            FlatBuf::widen_into(b.as_ref(), &mut par);
            assert_eq!(seq, par, "{dt:?} widened");
        }
    }

    #[test]
    fn detects_non_finite_in_every_dtype() {
        for dt in [DType::F32, DType::Bf16, DType::F16] {
            let mut b = FlatBuf::zeros(dt, 3);
            assert!(!b.has_non_finite(0..3));
            b.store_f32(1, &[f32::INFINITY]);
            assert!(b.has_non_finite(0..3), "{dt:?}");
            assert!(!b.has_non_finite(2..3));
            b.store_f32(2, &[f32::NAN]);
            assert!(b.has_non_finite(2..3), "{dt:?}");
        }
        // f16 overflows to Inf above 65504, which is what fp16 loss scaling must catch.
        let mut h = FlatBuf::zeros(DType::F16, 1);
        h.store_f32(0, &[1e6]);
        assert!(h.has_non_finite(0..1));
    }
}
