//! The fast optimizer kernels equal the scalar reference bit for bit, for random lengths,
//! offsets, hyper-parameter modes, low-precision copies and thread counts.
//!
//! NaN results are compared as "both NaN": LLVM may commute the operands of a vector add or
//! multiply, which picks the other input's NaN payload; every non-NaN bit must match.

use ferrozero_offload::optim::{
    self, reference, AdamHyper, LionHyper, LowPrecision, SgdHyper, WeightDecay,
};
use half::{bf16, f16};
use proptest::prelude::*;

/// Which low-precision copy a case writes.
#[derive(Debug, Clone, Copy)]
enum Lp {
    None,
    Bf16,
    F16,
}

/// Holds the low-precision outputs so both runs can borrow them.
struct LpBufs {
    bf: Vec<bf16>,
    hf: Vec<f16>,
}

impl LpBufs {
    fn new(n: usize) -> Self {
        LpBufs {
            bf: vec![bf16::ZERO; n],
            hf: vec![f16::ZERO; n],
        }
    }

    fn view(&mut self, lp: Lp, range: std::ops::Range<usize>) -> LowPrecision<'_> {
        match lp {
            Lp::None => LowPrecision::None,
            Lp::Bf16 => LowPrecision::Bf16(&mut self.bf[range]),
            Lp::F16 => LowPrecision::F16(&mut self.hf[range]),
        }
    }
}

fn same_f32(a: &[f32], b: &[f32]) -> bool {
    a.iter()
        .zip(b)
        .all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()))
        && a.len() == b.len()
}

fn same_lp(a: &LpBufs, b: &LpBufs) -> bool {
    let bf =
        a.bf.iter()
            .zip(&b.bf)
            .all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()));
    let hf =
        a.hf.iter()
            .zip(&b.hf)
            .all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()));
    bf && hf
}

/// Finite values spanning signs, zeros, subnormals and large magnitudes.
fn value() -> impl Strategy<Value = f32> {
    prop_oneof![
        4 => -1.0f32..1.0,
        1 => -1e4f32..1e4,
        1 => Just(0.0f32),
        1 => Just(-0.0f32),
        1 => proptest::num::f32::SUBNORMAL | proptest::num::f32::NORMAL,
    ]
}

fn buf(n: usize) -> impl Strategy<Value = Vec<f32>> {
    proptest::collection::vec(value(), n)
}

fn lp_mode() -> impl Strategy<Value = Lp> {
    prop_oneof![Just(Lp::None), Just(Lp::Bf16), Just(Lp::F16)]
}

fn pool(threads: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap()
}

/// Random buffers with an offset so the kernel sees unaligned slices.
fn case() -> impl Strategy<Value = (usize, Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>)> {
    (0usize..40, 0usize..3000).prop_flat_map(|(off, n)| {
        let t = off + n;
        (
            Just(off),
            buf(t),
            buf(t),
            buf(t),
            buf(t).prop_map(|v| v.into_iter().map(f32::abs).collect()),
        )
    })
}

fn adam_hyper() -> impl Strategy<Value = AdamHyper> {
    (
        1e-5f32..1e-1,
        0.0f32..0.999,
        0.0f32..0.9999,
        prop_oneof![Just(1e-8f32), Just(1e-6f32), Just(0.0f32)],
        prop_oneof![Just(0.0f32), 0.0f32..0.5],
        prop_oneof![Just(WeightDecay::L2), Just(WeightDecay::Decoupled)],
        any::<bool>(),
    )
        .prop_map(
            |(lr, beta1, beta2, eps, weight_decay, decay, bias_correction)| AdamHyper {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
                decay,
                bias_correction,
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(160))]

    #[test]
    fn adam_equals_reference(
        (off, p, g, m, v) in case(),
        hp in adam_hyper(),
        step in 1u64..5000,
        gs in prop_oneof![Just(1.0f32), 1e-4f32..4.0],
        lp in lp_mode(),
        threads in 1usize..4,
    ) {
        let n = p.len();
        let (mut p1, mut m1, mut v1, mut l1) = (p.clone(), m.clone(), v.clone(), LpBufs::new(n));
        let (mut p2, mut m2, mut v2, mut l2) = (p, m, v, LpBufs::new(n));
        let r = off..n;
        reference::adam_step(&hp, step, gs, &mut p1[r.clone()], &g[r.clone()], &mut m1[r.clone()], &mut v1[r.clone()], l1.view(lp, r.clone())).unwrap();
        pool(threads).install(|| {
            optim::adam_step(&hp, step, gs, &mut p2[r.clone()], &g[r.clone()], &mut m2[r.clone()], &mut v2[r.clone()], l2.view(lp, r.clone())).unwrap();
        });
        prop_assert!(same_f32(&p1, &p2) && same_f32(&m1, &m2) && same_f32(&v1, &v2));
        prop_assert!(same_lp(&l1, &l2));
    }

    #[test]
    fn sgd_equals_reference(
        (off, p, g, b, _) in case(),
        lr in 1e-4f32..1.0,
        momentum in prop_oneof![Just(0.0f32), 0.0f32..0.99],
        dampening in prop_oneof![Just(0.0f32), 0.0f32..0.5],
        weight_decay in prop_oneof![Just(0.0f32), 0.0f32..0.1],
        nesterov in any::<bool>(),
        step in 1u64..4,
        gs in 1e-3f32..2.0,
        lp in lp_mode(),
        threads in 1usize..4,
    ) {
        let hp = SgdHyper { lr, momentum, dampening, weight_decay, nesterov };
        let n = p.len();
        let (mut p1, mut b1, mut l1) = (p.clone(), b.clone(), LpBufs::new(n));
        let (mut p2, mut b2, mut l2) = (p, b, LpBufs::new(n));
        let r = off..n;
        reference::sgd_step(&hp, step, gs, &mut p1[r.clone()], &g[r.clone()], &mut b1[r.clone()], l1.view(lp, r.clone())).unwrap();
        pool(threads).install(|| {
            optim::sgd_step(&hp, step, gs, &mut p2[r.clone()], &g[r.clone()], &mut b2[r.clone()], l2.view(lp, r.clone())).unwrap();
        });
        prop_assert!(same_f32(&p1, &p2) && same_f32(&b1, &b2) && same_lp(&l1, &l2));
    }

    #[test]
    fn lion_equals_reference(
        (off, p, g, m, _) in case(),
        lr in 1e-5f32..1e-2,
        beta1 in 0.0f32..0.99,
        beta2 in 0.0f32..0.999,
        weight_decay in prop_oneof![Just(0.0f32), 0.0f32..1.0],
        gs in 1e-3f32..2.0,
        lp in lp_mode(),
        threads in 1usize..4,
    ) {
        let hp = LionHyper { lr, beta1, beta2, weight_decay };
        let n = p.len();
        let (mut p1, mut m1, mut l1) = (p.clone(), m.clone(), LpBufs::new(n));
        let (mut p2, mut m2, mut l2) = (p, m, LpBufs::new(n));
        let r = off..n;
        reference::lion_step(&hp, gs, &mut p1[r.clone()], &g[r.clone()], &mut m1[r.clone()], l1.view(lp, r.clone())).unwrap();
        pool(threads).install(|| {
            optim::lion_step(&hp, gs, &mut p2[r.clone()], &g[r.clone()], &mut m2[r.clone()], l2.view(lp, r.clone())).unwrap();
        });
        prop_assert!(same_f32(&p1, &p2) && same_f32(&m1, &m2) && same_lp(&l1, &l2));
    }
}

const HP: AdamHyper = AdamHyper {
    lr: 1e-3,
    beta1: 0.9,
    beta2: 0.999,
    eps: 1e-8,
    weight_decay: 0.01,
    decay: WeightDecay::Decoupled,
    bias_correction: true,
};

/// Deterministic pseudo-random values (no RNG dependency needed for bulk data).
fn fill(n: usize, seed: u32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(2_654_435_761).max(1);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x as f32 / u32::MAX as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Slices large enough to be split across threads (several tiles per thread) still equal the
/// reference, and a shard stepped alone equals the same elements stepped in the full buffer.
#[test]
fn large_multi_tile_and_shard_equal_reference() {
    let n = 300_001;
    let g = fill(n, 1);
    let start = (
        fill(n, 2),
        fill(n, 3),
        fill(n, 4).iter().map(|x| x.abs()).collect::<Vec<_>>(),
    );
    let run = |threads: usize, range: std::ops::Range<usize>| {
        let (mut p, mut m, mut v) = start.clone();
        let mut lp = vec![bf16::ZERO; n];
        pool(threads).install(|| {
            for step in 1..=3 {
                let r = range.clone();
                optim::adam_step(
                    &HP,
                    step,
                    0.5,
                    &mut p[r.clone()],
                    &g[r.clone()],
                    &mut m[r.clone()],
                    &mut v[r.clone()],
                    LowPrecision::Bf16(&mut lp[r]),
                )
                .unwrap();
            }
        });
        (p, m, v, lp)
    };
    let (mut p, mut m, mut v) = start.clone();
    let mut lp = vec![bf16::ZERO; n];
    for step in 1..=3 {
        reference::adam_step(
            &HP,
            step,
            0.5,
            &mut p,
            &g,
            &mut m,
            &mut v,
            LowPrecision::Bf16(&mut lp),
        )
        .unwrap();
    }
    for threads in [1, 2, 5] {
        let got = run(threads, 0..n);
        assert!(
            same_f32(&got.0, &p) && same_f32(&got.1, &m) && same_f32(&got.2, &v),
            "threads {threads}"
        );
        assert!(got
            .3
            .iter()
            .zip(&lp)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
    }
    let shard = 77_777..211_111;
    let got = run(2, shard.clone());
    assert!(same_f32(&got.0[shard.clone()], &p[shard.clone()]));
    assert!(same_f32(&got.2[shard.clone()], &v[shard]));
}

#[test]
fn mismatched_lengths_and_step_zero_are_errors() {
    let (mut p, g, mut m, mut v) = (
        vec![0.0f32; 8],
        vec![0.0f32; 7],
        vec![0.0f32; 8],
        vec![0.0f32; 8],
    );
    let e =
        optim::adam_step(&HP, 1, 1.0, &mut p, &g, &mut m, &mut v, LowPrecision::None).unwrap_err();
    assert!(e.to_string().contains("adam_step"), "{e}");
    let g = vec![0.0f32; 8];
    let mut short = vec![bf16::ZERO; 3];
    let e = optim::adam_step(
        &HP,
        1,
        1.0,
        &mut p,
        &g,
        &mut m,
        &mut v,
        LowPrecision::Bf16(&mut short),
    );
    assert!(e.is_err());
    let e =
        optim::adam_step(&HP, 0, 1.0, &mut p, &g, &mut m, &mut v, LowPrecision::None).unwrap_err();
    assert!(e.to_string().contains("step 0"), "{e}");
}

/// LAMB's first pass: the moments and the run's two sums of squares are the same bits on one
/// thread and on four (the sums' order is fixed by the run's length, not by threads), and
/// equal a plain loop that adds in that documented order.
#[test]
fn lamb_moments_do_not_depend_on_threads() {
    let hp = optim::LambHyper {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        eps_inside_sqrt: false,
        weight_decay: 0.01,
        max_coeff: 10.0,
        min_coeff: 0.01,
        bias_correction: true,
    };
    let n = 3 * optim::SUM_BLOCK + 12_345;
    let (p, g) = (fill(n, 7), fill(n, 8));
    let run = |threads: usize| {
        let mut m = fill(n, 9);
        let mut v: Vec<f32> = fill(n, 10).iter().map(|x| x.abs()).collect();
        let s = pool(threads).install(|| optim::lamb_moments(&hp, 0.5, &p, &g, &mut m, &mut v));
        (s.unwrap(), m, v)
    };
    let (one, four) = (run(1), run(4));
    assert_eq!(one.0 .0.to_bits(), four.0 .0.to_bits());
    assert_eq!(one.0 .1.to_bits(), four.0 .1.to_bits());
    assert!(same_f32(&one.1, &four.1) && same_f32(&one.2, &four.2));
    // The weights' sum by hand, in the documented order: blocks, eight lanes, a fixed tree.
    let by_hand = p.chunks(optim::SUM_BLOCK).fold(0.0f64, |acc, b| {
        let mut l = [0.0f64; 8];
        for (i, x) in b.iter().enumerate() {
            l[i % 8] += f64::from(*x) * f64::from(*x);
        }
        acc + (((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7])))
    });
    assert_eq!(one.0 .0.to_bits(), by_hand.to_bits());
}
