//! ZeRO++'s block quantizer (`tensor::quant`): DeepSpeed's symmetric formula checked element
//! by element (the round trip within half a step, the clamped top within one step, zeros, a
//! block with one huge value, a tail block), its group sizes, and on every device the
//! packed words and the dequantized values equal the CPU's bit for bit (`quant.cu` on the
//! emulator).

mod device_common;

use device_common::Dev;
use ferrozero_runtime::tensor::quant::{
    block_scale, dequantize_f32, quantize_f32, Packed, QuantFormat, WIRE_DTYPE,
};
use ferrozero_runtime::tensor::{DType, FlatBuf, Storage};

fn round_trip(x: &[f32], fmt: QuantFormat) -> (Vec<u8>, Vec<f32>) {
    let p = Packed { fmt, len: x.len() };
    let mut bytes = vec![0xAAu8; p.bytes()];
    quantize_f32(x, fmt, &mut bytes);
    let mut y = vec![0.0; x.len()];
    dequantize_f32(&bytes, fmt, &mut y);
    (bytes, y)
}

/// Every element within half a step (`inv`) of its value, but the clamped top of a block
/// (`x * scale >= 2^(bits-1) - 1/2`), within one step (each up to f32 rounding); the stored
/// inverse is `1 / scale`.
fn check_bound(x: &[f32], fmt: QuantFormat) {
    let (bytes, y) = round_trip(x, fmt);
    for (b, (xs, ys)) in x.chunks(fmt.block).zip(y.chunks(fmt.block)).enumerate() {
        let amax = xs.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let (scale, inv) = block_scale(amax, fmt.bits);
        let stored = f32::from_le_bytes(bytes[4 * b..4 * b + 4].try_into().unwrap());
        assert_eq!(stored.to_bits(), inv.to_bits(), "block {b}: stored inverse");
        let top = (1u32 << (fmt.bits - 1)) as f32 - 0.5;
        for (i, (&v, &d)) in xs.iter().zip(ys).enumerate() {
            let err = (f64::from(v) - f64::from(d)).abs();
            let clamped = v * scale >= top;
            // Plus the f32 roundings of `inv` and of the product (a few ulp of the value).
            let slack = 4.0 * f64::from(v.abs()) * f64::EPSILON.max(f64::from(f32::EPSILON));
            let bound = f64::from(inv) * if clamped { 1.0 } else { 0.5 } + slack;
            assert!(
                err <= bound,
                "block {b}[{i}]: {v} -> {d}, error {err} over {bound} (clamped {clamped})"
            );
        }
    }
}

fn values(n: usize, seed: u64) -> Vec<f32> {
    device_common::rand(n, seed)
        .into_iter()
        .enumerate()
        .map(|(i, v)| v * (1.0 + (i % 7) as f32))
        .collect()
}

#[test]
fn round_trip_is_within_half_a_step_per_block() {
    for bits in [8, 4] {
        let fmt = QuantFormat { bits, block: 64 };
        check_bound(&values(1000, 3), fmt);
    }
}

#[test]
fn only_the_clamped_top_loses_a_whole_step() {
    // DeepSpeed's scale maps amax to 2^(bits-1), one past the largest code: the maximum
    // comes back as 127/128 of itself; its negative is exact.
    let fmt = QuantFormat { bits: 8, block: 4 };
    let (_, y) = round_trip(&[2.0, -2.0, 1.0, 0.0], fmt);
    assert_eq!(y, [2.0 * 127.0 / 128.0, -2.0, 1.0, 0.0]);
}

#[test]
fn zeros_stay_zero_with_a_unit_scale() {
    let fmt = QuantFormat { bits: 8, block: 16 };
    let (bytes, y) = round_trip(&[0.0; 40], fmt);
    assert!(y.iter().all(|v| v.to_bits() == 0));
    assert_eq!(f32::from_le_bytes(bytes[0..4].try_into().unwrap()), 1.0);
}

#[test]
fn one_huge_value_flushes_its_block_only() {
    let fmt = QuantFormat { bits: 8, block: 8 };
    let mut x = vec![0.001f32; 24];
    x[9] = 1e6;
    let (_, y) = round_trip(&x, fmt);
    // Its block's small values round to zero; the other blocks keep theirs.
    assert!(y[8..16]
        .iter()
        .enumerate()
        .all(|(i, &v)| i == 1 || v == 0.0));
    assert!((y[9] - 1e6).abs() <= 1e6 / 128.0);
    assert!(y[..8]
        .iter()
        .chain(&y[16..])
        .all(|&v| (v - 0.001).abs() < 1e-5));
    check_bound(&x, fmt);
}

#[test]
fn a_tail_block_shorter_than_the_others() {
    for (bits, n) in [(8, 1001), (4, 1001), (4, 7)] {
        let fmt = QuantFormat { bits, block: 100 };
        let x = values(n, 9);
        check_bound(&x, fmt);
        let p = Packed { fmt, len: n };
        assert_eq!(p.blocks(), n.div_ceil(100));
        assert_eq!(p.bytes() % 4, 0);
    }
}

#[test]
fn weight_groups_follow_deepspeed() {
    // CUDAQuantizer: ceil(n / 8000) groups, raised to divide n by 8 groups, doubled while
    // groups stay over 8000 elements.
    assert_eq!(QuantFormat::weights(4096).block, 4096);
    assert_eq!(QuantFormat::weights(16000).block, 8000);
    assert_eq!(QuantFormat::weights(24576).block, 6144);
    assert_eq!(QuantFormat::weights(1 << 20).block, 4096);
    // Not a multiple of 8 (DeepSpeed asserts): equal blocks and a shorter last one.
    assert_eq!(QuantFormat::weights(8003).block, 4002);
    assert_eq!(QuantFormat::weights(5).block, 5);
    assert!(QuantFormat { bits: 4, block: 3 }.check().is_err());
    assert!(QuantFormat { bits: 3, block: 4 }.check().is_err());
}

/// `vals` in `dtype` on `d`'s device, and on the host.
fn both(d: &Dev, vals: &[f32], dtype: DType) -> (Storage, Storage) {
    let mut b = FlatBuf::zeros(dtype, vals.len());
    b.store_f32(0, vals);
    let dev = d.be.upload(b.as_ref()).expect("upload");
    (dev, Storage::Host(b))
}

fn words(s: &Storage) -> Vec<u16> {
    match s.to_host().expect("download") {
        FlatBuf::Bf16(w) => w.iter().map(|x| x.to_bits()).collect(),
        other => panic!("packed words as {:?}", other.dtype()),
    }
}

fn raw(s: &Storage) -> Vec<u32> {
    s.to_vec_f32()
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect()
}

/// The device's packed words and dequantized values equal the CPU's, bit for bit, for every
/// storage dtype, both widths, a tail block, a huge value, zeros and a NaN.
fn kernel_equals_cpu(d: &Dev) {
    let mut x = values(3001, 5);
    x[17] = 3e4;
    x[300..400].fill(0.0);
    x[2000] = f32::NAN;
    for dtype in [DType::F32, DType::Bf16, DType::F16] {
        for fmt in [
            QuantFormat {
                bits: 8,
                block: 256,
            },
            QuantFormat {
                bits: 4,
                block: 100,
            },
            QuantFormat::weights(3001),
        ] {
            let (dev, host) = both(d, &x, dtype);
            let w = Packed { fmt, len: 2999 }.words();
            let mut qd = d.be.zeros(WIRE_DTYPE, w + 2).unwrap();
            let mut qh = Storage::Host(FlatBuf::zeros(WIRE_DTYPE, w + 2));
            dev.quantize_into(2..3001, fmt, &mut qd, 2).unwrap();
            host.quantize_into(2..3001, fmt, &mut qh, 2).unwrap();
            let what = format!("{}: {dtype:?} {fmt:?}", d.name);
            assert_eq!(words(&qd), words(&qh), "{what}: packed words");
            let mut yd = d.be.zeros(dtype, 3000).unwrap();
            let mut yh = Storage::Host(FlatBuf::zeros(dtype, 3000));
            qd.dequantize_into(2, fmt, &mut yd, 1, 2999).unwrap();
            qh.dequantize_into(2, fmt, &mut yh, 1, 2999).unwrap();
            assert_eq!(raw(&yd), raw(&yh), "{what}: dequantized");
        }
    }
}
test_device!(kernel_equals_cpu);
