//! Shared by the `cuda_emu_*` tests (ferrozero's CUDA kernels on the CPU emulator of the
//! device): the emulator harness, the CPU-backend adapter, dtypes, data and comparisons.
//!
//! Tolerances, per output dtype:
//! Tolerances, per output dtype:
//! - bit-exact where the kernels promise it: casts (every bf16/f16 pattern, a few hundred
//!   million f32 patterns), dropout masks and values, embedding forward/backward, RoPE,
//!   accumulate/scale/fill/add, unscale, optimizer steps, LayerNorm/RMSNorm parameter
//!   gradients with 32-row chunks, argmax.
//! - f32 pointwise with transcendental functions (GELU, SwiGLU): within 5e-7 (1 + |exact|) of
//!   an exact f64 evaluation (a few ulp), and |gpu - cpu| <= 5e-7 |cpu| + 3e-6 against the CPU
//!   backend, whose polynomial tanh/exp are off by up to 2.3e-6 in GELU's gradient.
//! - f32 reductions (norm outputs and input gradients, cross-entropy, column sums): 1e-5
//!   relative + 1e-6 absolute; the f64 sum of squares 1e-12 relative.
//! - bf16/f16 outputs: at most 1 ulp of the storage type from the CPU's f32 result rounded to
//!   it (or within the f32 tolerance), since both compute in f32 and round once.
//!
//! Without a C++ compiler every test prints "skipped: no C++ compiler" and passes, unless
//! `FERROZERO_REQUIRE_EMULATOR=1` (CI) makes that a failure.

#![allow(dead_code, unused_imports)]

pub mod cpu;
pub mod harness;

pub use std::fmt::Debug;

pub use bytemuck::{Pod, Zeroable};
pub use half::{bf16, f16};
pub use harness::{null, Arg, Buf, Emu};

// ---- dtypes -------------------------------------------------------------------------------

pub trait Elem: Pod + Debug + PartialEq {
    /// Kernel name suffix.
    const SUFFIX: &'static str;
    fn from_f32(x: f32) -> Self;
    fn to_f32(self) -> f32;
    /// Bits as an ordered integer (for ulp distances); f32 never needs it.
    fn ordered(self) -> i64;
    const IS_F32: bool;
}

impl Elem for f32 {
    const SUFFIX: &'static str = "f32";
    const IS_F32: bool = true;
    fn from_f32(x: f32) -> Self {
        x
    }
    fn to_f32(self) -> f32 {
        self
    }
    fn ordered(self) -> i64 {
        let b = self.to_bits();
        if b >> 31 == 1 {
            -i64::from(b & 0x7fff_ffff)
        } else {
            i64::from(b)
        }
    }
}

impl Elem for bf16 {
    const SUFFIX: &'static str = "bf16";
    const IS_F32: bool = false;
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn ordered(self) -> i64 {
        let b = self.to_bits();
        if b >> 15 == 1 {
            -i64::from(b & 0x7fff)
        } else {
            i64::from(b)
        }
    }
}

impl Elem for f16 {
    const SUFFIX: &'static str = "f16";
    const IS_F32: bool = false;
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn ordered(self) -> i64 {
        let b = self.to_bits();
        if b >> 15 == 1 {
            -i64::from(b & 0x7fff)
        } else {
            i64::from(b)
        }
    }
}

pub fn name<T: Elem>(kernel: &str) -> String {
    format!("{kernel}_{}", T::SUFFIX)
}

// ---- data and comparisons -----------------------------------------------------------------

/// (n, offset): a single element, odd counts, a misaligned start (offset 1), a large one.
pub const SIZES: &[(usize, usize)] = &[(1, 0), (37, 0), (4099, 0), (4099, 1), (70_001, 3)];

/// Deterministic pseudo-random values, uniform in [-scale, scale).
pub fn rand_vec(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut rng = fastrand::Rng::with_seed(seed);
    (0..n).map(|_| (rng.f32() * 2.0 - 1.0) * scale).collect()
}

/// A device buffer holding `vals` rounded to T after `off` leading zeros, and the rounded
/// values as f32 (what the CPU computes on).
pub fn dev<T: Elem>(vals: &[f32], off: usize) -> (Buf<T>, Vec<f32>) {
    let mut data = vec![T::from_f32(0.0); off];
    data.extend(vals.iter().map(|&v| T::from_f32(v)));
    let rounded = data[off..].iter().map(|v| v.to_f32()).collect();
    (Buf::from(&data), rounded)
}

/// Elements off .. off + n of a T buffer as f32.
pub fn host<T: Elem>(b: &Buf<T>, off: usize, n: usize) -> Vec<f32> {
    b.get()[off..off + n].iter().map(|v| v.to_f32()).collect()
}

#[derive(Clone, Copy)]
pub struct Tol {
    pub rel: f32,
    pub abs: f32,
}

/// Pointwise with transcendental functions.
pub const POINTWISE: Tol = Tol {
    rel: 5e-7,
    abs: 3e-6,
};
/// f32 pointwise against exact f64 evaluation: |gpu - exact| <= 5e-7 (1 + |exact|), i.e. a
/// few ulp (the CPU backend's approximations are further off, up to 2.3e-6 on this scale).
pub const EXACT_POINTWISE: f64 = 5e-7;
/// Reductions in f32.
pub const REDUCTION: Tol = Tol {
    rel: 1e-5,
    abs: 1e-6,
};

/// gpu (a T output, read as f32) against the CPU's f32 result: within `tol` in f32, and for
/// bf16/f16 within 1 ulp of the CPU's result rounded to T (or within `tol`).
pub fn assert_close<T: Elem>(what: &str, gpu: &[f32], cpu: &[f32], tol: Tol) {
    assert_eq!(gpu.len(), cpu.len(), "{what}: lengths");
    for (i, (&g, &c)) in gpu.iter().zip(cpu).enumerate() {
        let err = (g - c).abs();
        let ok_f32 = err <= tol.abs + tol.rel * c.abs() || (g.is_nan() && c.is_nan()) || g == c;
        let ok = if T::IS_F32 {
            ok_f32
        } else {
            let ulps = (T::from_f32(g).ordered() - T::from_f32(c).ordered()).abs();
            ok_f32 || ulps <= 1
        };
        assert!(
            ok,
            "{what} ({}): element {i}: gpu {g:e} cpu {c:e} (|diff| {err:e})",
            T::SUFFIX
        );
    }
}

pub fn assert_bits(what: &str, gpu: &[f32], cpu: &[f32]) {
    assert_eq!(gpu.len(), cpu.len(), "{what}: lengths");
    for (i, (g, c)) in gpu.iter().zip(cpu).enumerate() {
        assert!(
            g.to_bits() == c.to_bits(),
            "{what}: element {i}: gpu {g:e} ({:#010x}) cpu {c:e} ({:#010x})",
            g.to_bits(),
            c.to_bits()
        );
    }
}

/// `v` rounded to T and back (what a T output of an f32 computation holds).
pub fn round_to<T: Elem>(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| T::from_f32(x).to_f32()).collect()
}

pub fn blocks(n: usize, per_block: usize, max: usize) -> u32 {
    n.div_ceil(per_block).clamp(1, max) as u32
}

/// The emulator with every kernel, or return from the test (see the module doc on skipping).
#[macro_export]
macro_rules! emu_or_skip {
    () => {
        match $crate::cuda_emu_common::harness::kernels() {
            Some(e) => e,
            None => return,
        }
    };
}
