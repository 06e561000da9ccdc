//! ferrozero's CUDA kernels on the CPU emulator of the device: dtype casts (`reduce.cu`'s `cast_*`), bit-exact over every half pattern and a dense sample of f32 patterns.
//! Tolerances and the skip rule: `cuda_emu_common/mod.rs`.

#[macro_use]
mod cuda_emu_common;

use cuda_emu_common::*;

// ---- conversions ---------------------------------------------------------------------------

/// Runs `kernel` over `src` and returns the destination's raw elements.
fn cast<S: Pod, D: Pod>(emu: &Emu, kernel: &str, src: &[S]) -> Vec<D> {
    let s = Buf::from(src);
    let d = Buf::<D>::zeros(src.len());
    emu.run(
        kernel,
        blocks(src.len(), 256 * 8, 1024),
        256,
        &[s.ptr(), d.ptr(), Arg::I64(src.len() as i64)],
    );
    d.get()
}

#[test]
fn conversions_every_half_pattern_bit_exact() {
    let emu = emu_or_skip!();
    let all: Vec<u16> = (0..=u16::MAX).collect();
    let bfs: Vec<bf16> = all.iter().map(|&b| bf16::from_bits(b)).collect();
    let hs: Vec<f16> = all.iter().map(|&b| f16::from_bits(b)).collect();
    let from_bf: Vec<f32> = cast(emu, "cast_bf16_to_f32", &bfs);
    let from_h: Vec<f32> = cast(emu, "cast_f16_to_f32", &hs);
    let bf_to_h: Vec<f16> = cast(emu, "cast_bf16_to_f16", &bfs);
    let h_to_bf: Vec<bf16> = cast(emu, "cast_f16_to_bf16", &hs);
    for i in 0..all.len() {
        assert_eq!(
            from_bf[i].to_bits(),
            bfs[i].to_f32().to_bits(),
            "bf16 {:#06x}",
            all[i]
        );
        assert_eq!(
            from_h[i].to_bits(),
            hs[i].to_f32().to_bits(),
            "f16 {:#06x}",
            all[i]
        );
        let want_h = f16::from_f32(bfs[i].to_f32());
        assert_eq!(
            bf_to_h[i].to_bits(),
            want_h.to_bits(),
            "bf16->f16 {:#06x}",
            all[i]
        );
        let want_bf = bf16::from_f32(hs[i].to_f32());
        assert_eq!(
            h_to_bf[i].to_bits(),
            want_bf.to_bits(),
            "f16->bf16 {:#06x}",
            all[i]
        );
    }
}

/// f32 -> bf16/f16 over a dense sample of all 2^32 patterns (every 31st, so every exponent and
/// every residue of the low bits), plus the patterns around every rounding boundary: each
/// kept-bits prefix with the low bits at 0, 1, half-1, half, half+1 and all ones. Set
/// FERROZERO_EXHAUSTIVE=1 for all 2^32 patterns (minutes).
#[test]
fn conversions_from_f32_bit_exact_over_dense_patterns() {
    let emu = emu_or_skip!();
    let exhaustive = std::env::var("FERROZERO_EXHAUSTIVE").is_ok_and(|v| v == "1");
    let stride: u64 = if exhaustive { 1 } else { 31 };
    let check = |bits: &[u32]| {
        let src: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
        let got_bf: Vec<bf16> = cast(emu, "cast_f32_to_bf16", &src);
        let got_h: Vec<f16> = cast(emu, "cast_f32_to_f16", &src);
        for (i, &x) in src.iter().enumerate() {
            let (wb, wh) = (bf16::from_f32(x), f16::from_f32(x));
            assert!(
                got_bf[i].to_bits() == wb.to_bits() && got_h[i].to_bits() == wh.to_bits(),
                "f32 {:#010x}: bf16 {:#06x} (half: {:#06x}), f16 {:#06x} (half: {:#06x})",
                bits[i],
                got_bf[i].to_bits(),
                wb.to_bits(),
                got_h[i].to_bits(),
                wh.to_bits()
            );
        }
    };
    // Patterns are checked in batches of 4M, to keep memory small beside parallel tests.
    let mut batch = Vec::with_capacity(1 << 22);
    let mut tested = 0u64;
    let mut push = |b: u32| {
        batch.push(b);
        if batch.len() == 1 << 22 {
            check(&batch);
            tested += batch.len() as u64;
            batch.clear();
        }
    };
    // Boundaries: bf16 keeps the top 16 bits, f16 (normal range) the top 19.
    for hi in 0..=u16::MAX as u32 {
        for lo in [0u32, 1, 0x7fff, 0x8000, 0x8001, 0xffff] {
            push((hi << 16) | lo);
        }
    }
    for hi in 0..(1u32 << 19) {
        for lo in [0u32, 1, 0x0fff, 0x1000, 0x1001, 0x1fff] {
            push((hi << 13) | lo);
        }
    }
    // f16's subnormal range, where the rounding position moves with the exponent: every 7th
    // pattern of |x| in [2^-26, 2^-14), both signs.
    for sign in [0u32, 0x8000_0000] {
        let mut b = (127 - 26) << 23;
        while b < (127 - 14) << 23 {
            push(sign | b);
            b += 7;
        }
    }
    // Every stride-th pattern of all 2^32.
    let mut b = 0u64;
    while b < 1u64 << 32 {
        push(b as u32);
        b += stride;
    }
    check(&batch);
    tested += batch.len() as u64;
    eprintln!("checked {tested} f32 patterns against half (stride {stride})");
}
