//! The per-tile loops, compiled for AVX-512, AVX2 and baseline x86-64 and picked at run time.
//!
//! Each loop is written so LLVM vectorizes it: slices re-sliced to one length (no bounds
//! checks), loop-invariant mode tests (if-converted to selects, which pick the same bits the
//! scalar branch would) and a branch-free bf16 rounding. Only IEEE-exact operations appear:
//! separate mul and add (Rust never contracts them into FMA), `sqrt` and division, so every
//! compiled version equals `reference` bit for bit.
//!
//! `multiversion` only takes the AVX-512 build on CPUs with the Ice Lake / Zen 4 feature set
//! (it adds those features to any avx512 target), so CPUs that downclock under AVX-512
//! (Skylake-X) run the AVX2 build.

use half::slice::HalfFloatSliceExt;
use multiversion::multiversion;

use super::tiles::{AdamTile, StateTile};
use super::{AdamHyper, LionHyper, LowPrecision, SgdHyper, WeightDecay};

/// f16 copies are converted per chunk right after the chunk's update, while it is in L1:
/// `half`'s slice conversion uses F16C when the CPU has it.
const F16_CHUNK: usize = 2048;

/// bf16 bits of `x`, rounded to nearest even, NaN kept quiet: the same bits as
/// `half::bf16::from_f32`, without its branches so it vectorizes.
#[inline(always)]
pub(crate) fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16;
    let quiet_nan = (b >> 16) | 0x40;
    let is_nan = b & 0x7fff_ffff > 0x7f80_0000;
    (if is_nan { quiet_nan } else { rounded }) as u16
}

/// Adam's per-step constants, computed once per call.
pub(super) struct AdamConsts {
    gs: f32,
    b1: f32,
    omb1: f32,
    b2: f32,
    omb2: f32,
    eps: f32,
    step_size: f32,
    bc2_sqrt: f32,
    l2: bool,
    wd: f32,
    lr_wd: f32,
}

impl AdamConsts {
    /// Constants for one step; `step_size` and `bc2_sqrt` come from `adam_terms`.
    pub(super) fn new(hp: &AdamHyper, gs: f32, step_size: f32, bc2_sqrt: f32) -> Self {
        AdamConsts {
            gs,
            b1: hp.beta1,
            omb1: 1.0 - hp.beta1,
            b2: hp.beta2,
            omb2: 1.0 - hp.beta2,
            eps: hp.eps,
            step_size,
            bc2_sqrt,
            l2: hp.decay == WeightDecay::L2,
            wd: hp.weight_decay,
            lr_wd: hp.lr * hp.weight_decay,
        }
    }
}

/// One element of Adam: returns (param, m, v). Mirrors `reference::adam_step` operation for
/// operation.
#[inline(always)]
fn adam_one(k: &AdamConsts, p: f32, g: f32, m: f32, v: f32) -> (f32, f32, f32) {
    let mut g = g * k.gs;
    let mut p = p;
    if k.l2 {
        g += k.wd * p;
    } else {
        p -= k.lr_wd * p;
    }
    let m = k.b1 * m + k.omb1 * g;
    let v = k.b2 * v + k.omb2 * g * g;
    let denom = v.sqrt() / k.bc2_sqrt + k.eps;
    p -= k.step_size * m / denom;
    (p, m, v)
}

#[multiversion(targets("x86_64+avx512f+avx512bw+avx512vl+avx2+avx", "x86_64+avx2+avx"))]
fn adam_loop(
    k: &AdamConsts,
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    lp: Option<&mut [u16]>,
) {
    let n = p.len();
    let (g, m, v) = (&g[..n], &mut m[..n], &mut v[..n]);
    match lp {
        None => {
            for i in 0..n {
                (p[i], m[i], v[i]) = adam_one(k, p[i], g[i], m[i], v[i]);
            }
        }
        Some(lp) => {
            let lp = &mut lp[..n];
            for i in 0..n {
                (p[i], m[i], v[i]) = adam_one(k, p[i], g[i], m[i], v[i]);
                lp[i] = bf16_bits(p[i]);
            }
        }
    }
}

/// Runs Adam over one tile.
pub(super) fn adam(k: &AdamConsts, t: AdamTile<'_>) {
    match t.lp {
        LowPrecision::None => adam_loop(k, t.p, t.g, t.m, t.v, None),
        LowPrecision::Bf16(b) => {
            adam_loop(k, t.p, t.g, t.m, t.v, Some(bytemuck::cast_slice_mut(b)))
        }
        LowPrecision::F16(h) => {
            let chunks =
                t.p.chunks_mut(F16_CHUNK)
                    .zip(t.g.chunks(F16_CHUNK))
                    .zip(t.m.chunks_mut(F16_CHUNK))
                    .zip(t.v.chunks_mut(F16_CHUNK))
                    .zip(h.chunks_mut(F16_CHUNK));
            for ((((p, g), m), v), h) in chunks {
                adam_loop(k, p, g, m, v, None);
                h.convert_from_f32_slice(p);
            }
        }
    }
}

/// Where SGD's momentum buffer stands.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Momentum {
    /// `momentum == 0`: the buffer is unused.
    Off,
    /// First step: the buffer becomes the gradient.
    First,
    /// Later steps: the buffer decays.
    Running,
}

/// SGD's per-step constants.
pub(super) struct SgdConsts {
    gs: f32,
    lr: f32,
    wd: f32,
    mom: f32,
    omd: f32,
    momentum: Momentum,
    nesterov: bool,
}

impl SgdConsts {
    /// Constants for one step.
    pub(super) fn new(hp: &SgdHyper, step: u64, gs: f32) -> Self {
        let momentum = match (hp.momentum != 0.0, step <= 1) {
            (false, _) => Momentum::Off,
            (true, true) => Momentum::First,
            (true, false) => Momentum::Running,
        };
        SgdConsts {
            gs,
            lr: hp.lr,
            wd: hp.weight_decay,
            mom: hp.momentum,
            omd: 1.0 - hp.dampening,
            momentum,
            nesterov: hp.nesterov,
        }
    }
}

/// An optimizer with one state buffer, element by element: SGD's momentum, Lion's moment.
pub(super) trait OneState: Sync {
    /// One element: returns (param, state).
    fn one(&self, p: f32, g: f32, s: f32) -> (f32, f32);
}

/// Mirrors `reference::sgd_step`.
impl OneState for SgdConsts {
    #[inline(always)]
    fn one(&self, p: f32, g: f32, b: f32) -> (f32, f32) {
        let mut g = g * self.gs + self.wd * p;
        let mut b = b;
        if self.momentum != Momentum::Off {
            b = if self.momentum == Momentum::First {
                g
            } else {
                self.mom * b + self.omd * g
            };
            g = if self.nesterov { g + self.mom * b } else { b };
        }
        (p - self.lr * g, b)
    }
}

/// Lion's per-step constants.
pub(super) struct LionConsts {
    gs: f32,
    lr: f32,
    lr_wd: f32,
    b1: f32,
    omb1: f32,
    b2: f32,
    omb2: f32,
}

impl LionConsts {
    /// Constants for one step.
    pub(super) fn new(hp: &LionHyper, gs: f32) -> Self {
        LionConsts {
            gs,
            lr: hp.lr,
            lr_wd: hp.lr * hp.weight_decay,
            b1: hp.beta1,
            omb1: 1.0 - hp.beta1,
            b2: hp.beta2,
            omb2: 1.0 - hp.beta2,
        }
    }
}

/// Lion's update direction: the sign of `c`, 0 for 0 and NaN (unlike `f32::signum`).
#[inline(always)]
pub(super) fn sign(c: f32) -> f32 {
    if c > 0.0 {
        1.0
    } else if c < 0.0 {
        -1.0
    } else {
        0.0
    }
}

/// Mirrors `reference::lion_step`.
impl OneState for LionConsts {
    #[inline(always)]
    fn one(&self, p: f32, g: f32, m: f32) -> (f32, f32) {
        let g = g * self.gs;
        let mut p = p;
        p -= self.lr_wd * p;
        let c = self.b1 * m + self.omb1 * g;
        p -= self.lr * sign(c);
        (p, self.b2 * m + self.omb2 * g)
    }
}

// Generic over the rule, so each optimizer's element is inlined into its own copy of the loop
// (per target, as before): one loop, the same code as one written per optimizer.
#[multiversion(targets("x86_64+avx512f+avx512bw+avx512vl+avx2+avx", "x86_64+avx2+avx"))]
fn one_state_loop<K: OneState>(
    k: &K,
    p: &mut [f32],
    g: &[f32],
    s: &mut [f32],
    lp: Option<&mut [u16]>,
) {
    let n = p.len();
    let (g, s) = (&g[..n], &mut s[..n]);
    match lp {
        None => {
            for i in 0..n {
                (p[i], s[i]) = k.one(p[i], g[i], s[i]);
            }
        }
        Some(lp) => {
            let lp = &mut lp[..n];
            for i in 0..n {
                (p[i], s[i]) = k.one(p[i], g[i], s[i]);
                lp[i] = bf16_bits(p[i]);
            }
        }
    }
}

/// Runs an optimizer with one state buffer over one tile.
pub(super) fn one_state<K: OneState>(k: &K, t: StateTile<'_>) {
    match t.lp {
        LowPrecision::None => one_state_loop(k, t.p, t.g, t.s, None),
        LowPrecision::Bf16(h) => {
            one_state_loop(k, t.p, t.g, t.s, Some(bytemuck::cast_slice_mut(h)))
        }
        LowPrecision::F16(h) => {
            let chunks =
                t.p.chunks_mut(F16_CHUNK)
                    .zip(t.g.chunks(F16_CHUNK))
                    .zip(t.s.chunks_mut(F16_CHUNK))
                    .zip(h.chunks_mut(F16_CHUNK));
            for (((p, g), s), h) in chunks {
                one_state_loop(k, p, g, s, None);
                h.convert_from_f32_slice(p);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::bf16_bits;
    use half::bf16;

    /// The branch-free bf16 rounding equals `half`'s on every class of input, NaNs included.
    #[test]
    fn bf16_rounding_matches_half() {
        let special = [
            0u32,
            0x8000_0000,
            0x7f80_0000,
            0xff80_0000,
            0x7fc0_0000,
            0x7f80_0001,
            0xffff_ffff,
            0x7f7f_ffff,
            0x3f80_8000,
            0x3f81_8000,
            0x0000_8001,
        ];
        let mut x = 0x1234_5678u32;
        let randoms = (0..2_000_000).map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x
        });
        for b in special.into_iter().chain(randoms) {
            let f = f32::from_bits(b);
            assert_eq!(bf16_bits(f), bf16::from_f32(f).to_bits(), "input {b:#x}");
        }
    }
}
