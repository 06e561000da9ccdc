//! Flash attention on the CPU emulator of the device beyond what `device_ops` covers: the f16
//! kernels (no `test_device!` device computes in f16) against the CPU backend, and the
//! prelude's tensor-core building blocks the kernels are written against (ldmatrix fragments,
//! cp.async groups, the f16 mma, 16-bit packing, ex2.approx), checked against PTX's documented
//! semantics.
//!
//! Without a C++ compiler every test prints "skipped: ..." and passes, unless
//! `FERROZERO_REQUIRE_EMULATOR=1` (CI) makes that a failure.
#![cfg(feature = "cuda")]

mod attention_common;
mod device_common;
#[allow(dead_code)]
#[path = "cuda_emu_common/harness.rs"]
mod harness;

use device_common::Dev;
use ferrozero_runtime::backend::cuda::kernels::KernelSource;
use ferrozero_runtime::backend::{self, Backend};
use ferrozero_runtime::tensor::DType;
use half::{bf16, f16};
use harness::{Arg, Buf};

const FRAGMENTS: &[KernelSource] = &[KernelSource {
    file: "fragments.cu",
    code: include_str!("cuda_attention_emu/fragments.cu"),
    kernels: &[
        "t_ldmatrix",
        "t_cp_async",
        "t_cp_async_misaligned",
        "t_mma_f16",
        "t_pack_exp2",
    ],
}];

macro_rules! fragments_or_skip {
    () => {
        match harness::custom(FRAGMENTS) {
            Some(e) => e,
            None => return,
        }
    };
}

#[test]
fn f16_attention_matches_cpu_and_repeats_bit_for_bit() {
    let be = match backend::cuda::emulated(DType::F16) {
        Ok(be) => be,
        Err(e) => {
            backend::cuda::emu::skip_unless_required(&e.to_string());
            return;
        }
    };
    let d = Dev {
        name: "cuda_emu_f16",
        be: be as std::sync::Arc<dyn Backend>,
    };
    let t = std::time::Instant::now();
    attention_common::check(&d);
    eprintln!("f16 attention cases: {:.1?}", t.elapsed());
}

#[test]
fn ldmatrix_gives_ptx_fragments() {
    let emu = fragments_or_skip!();
    let m: Vec<u16> = (0..256u16).map(|i| i.wrapping_mul(37) ^ 0x5a5a).collect();
    let (md, out) = (Buf::from(&m), Buf::<u32>::zeros(32 * 8));
    emu.try_launch(
        "t_ldmatrix",
        [1, 1, 1],
        [32, 1, 1],
        512,
        &[md.ptr(), out.ptr()],
    )
    .unwrap();
    let got = out.get();
    // Matrix i, row r, column c is m[(8i + r) * 8 + c].
    let at = |i: usize, r: usize, c: usize| u32::from(m[(8 * i + r) * 8 + c]);
    for lane in 0..32 {
        let (g, t) = (lane / 4, lane % 4);
        for i in 0..4 {
            let plain = at(i, g, 2 * t) | at(i, g, 2 * t + 1) << 16;
            let trans = at(i, 2 * t, g) | at(i, 2 * t + 1, g) << 16;
            assert_eq!(got[lane * 8 + i], plain, "x4 lane {lane} matrix {i}");
            assert_eq!(
                got[lane * 8 + 4 + i],
                trans,
                "x4.trans lane {lane} matrix {i}"
            );
        }
    }
}

#[test]
fn cp_async_lands_at_its_wait_and_zero_fills() {
    let emu = fragments_or_skip!();
    let src: Vec<f32> = (0..256).map(|i| i as f32 + 0.5).collect();
    let (sd, out) = (Buf::from(&src), Buf::<f32>::zeros(320));
    emu.try_launch(
        "t_cp_async",
        [1, 1, 1],
        [32, 1, 1],
        1024,
        &[sd.ptr(), out.ptr()],
    )
    .unwrap();
    let got = out.get();
    for i in 0..32 {
        // Before its wait a copy has not landed: fresh shared memory's poison.
        assert_eq!(got[i].to_bits(), u32::MAX, "slot {i} read before the wait");
        assert_eq!(
            got[32 + i].to_bits(),
            u32::MAX,
            "slot {} read while its group is the newest pending one",
            32 + i
        );
        let j = 31 - i;
        for k in 0..4 {
            let want = if j % 2 == 0 { src[4 * j + k] } else { 0.0 };
            assert_eq!(
                got[64 + 4 * i + k],
                want,
                "group 1, thread {j}, element {k}"
            );
            assert_eq!(
                got[192 + 4 * i + k],
                src[128 + 4 * j + k],
                "group 2, thread {j}, element {k}"
            );
        }
    }
    let err = emu
        .try_launch(
            "t_cp_async_misaligned",
            [1, 1, 1],
            [1, 1, 1],
            64,
            &[sd.ptr(), out.ptr()],
        )
        .unwrap_err();
    assert!(err.contains("aligned"), "{err}");
}

#[test]
fn f16_mma_follows_ptx_fragments() {
    let emu = fragments_or_skip!();
    let mut rng = fastrand::Rng::with_seed(5);
    // Small integers and halves: every product and sum is exact in f32.
    let a: Vec<f32> = (0..16 * 16).map(|_| rng.i32(-8..9) as f32 * 0.5).collect();
    let b: Vec<f32> = (0..16 * 8).map(|_| rng.i32(-8..9) as f32 * 0.5).collect();
    let c: Vec<f32> = (0..16 * 8).map(|_| rng.i32(-50..50) as f32).collect();
    let bits = |v: &[f32]| -> Vec<u16> { v.iter().map(|&x| f16::from_f32(x).to_bits()).collect() };
    let (ad, bd, cd) = (Buf::from(&bits(&a)), Buf::from(&bits(&b)), Buf::from(&c));
    let dd = Buf::<f32>::zeros(16 * 8);
    emu.run(
        "t_mma_f16",
        1,
        32,
        &[ad.ptr(), bd.ptr(), cd.ptr(), dd.ptr()],
    );
    let got = dd.get();
    for m in 0..16 {
        for n in 0..8 {
            let want = c[m * 8 + n] + (0..16).map(|k| a[m * 16 + k] * b[k * 8 + n]).sum::<f32>();
            assert_eq!(got[m * 8 + n], want, "D[{m}][{n}]");
        }
    }
}

#[test]
fn packing_rounds_like_half_and_exp2_flushes_subnormals() {
    let emu = fragments_or_skip!();
    let mut rng = fastrand::Rng::with_seed(9);
    let n = 4096;
    let mut x: Vec<f32> = (0..2 * n)
        .map(|_| (rng.f32() - 0.5) * 2f32.powi(rng.i32(-30..20)))
        .collect();
    // Ties, overflow and subnormal results of both formats.
    x[..8].copy_from_slice(&[
        1.0 + 2f32.powi(-8),
        1.0 + 3.0 * 2f32.powi(-8),
        70000.0,
        -1e-6,
        3e38,
        1e-40,
        -0.0,
        65519.0,
    ]);
    let y: Vec<f32> = (0..n)
        .map(|i| match i {
            0 => f32::NEG_INFINITY,
            1 => -126.5,
            2 => -140.0,
            3 => 0.0,
            _ => (rng.f32() - 0.5) * 60.0,
        })
        .collect();
    let (xd, yd) = (Buf::from(&x), Buf::from(&y));
    let (pb, ph, e) = (
        Buf::<u32>::zeros(n),
        Buf::<u32>::zeros(n),
        Buf::<f32>::zeros(n),
    );
    emu.run(
        "t_pack_exp2",
        1,
        128,
        &[
            xd.ptr(),
            pb.ptr(),
            ph.ptr(),
            yd.ptr(),
            e.ptr(),
            Arg::I32(n as i32),
        ],
    );
    let (pb, ph, e) = (pb.get(), ph.get(), e.get());
    for i in 0..n {
        let (lo, hi) = (x[2 * i], x[2 * i + 1]);
        let wb =
            u32::from(bf16::from_f32(lo).to_bits()) | u32::from(bf16::from_f32(hi).to_bits()) << 16;
        let wh =
            u32::from(f16::from_f32(lo).to_bits()) | u32::from(f16::from_f32(hi).to_bits()) << 16;
        assert_eq!(pb[i], wb, "bf16x2 of {lo}, {hi}");
        assert_eq!(ph[i], wh, "f16x2 of {lo}, {hi}");
        let exact = 2f64.powf(f64::from(y[i]));
        if exact < f64::from(f32::MIN_POSITIVE) {
            assert_eq!(e[i], 0.0, "2^{} flushes to zero", y[i]);
        } else {
            let rel = (f64::from(e[i]) - exact).abs() / exact;
            assert!(rel < 1e-6, "2^{}: {} vs {exact}", y[i], e[i]);
        }
    }
}
