//! The device's sum of squares of a gradient in host memory (an offloaded optimizer's
//! accumulator) against the same values in device memory: the bits of the kernels' order, so
//! the norm, clipping and every bit after them do not depend on where the gradient
//! accumulated. Values with full f32 mantissas make every order of additions round
//! differently; lengths cross the kernel's block sizes and its cap of 1024 blocks, and
//! unaligned starts take its element-by-element path.
#![cfg(feature = "cuda")]

use ferrozero_runtime::backend::{cuda, Backend, CpuBackend, MemoryOps};
use ferrozero_runtime::tensor::{DType, FlatBuf, Storage, View};

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            // Magnitudes over several binades: the squares' sums round at every step.
            let m = (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            m * (1u64 << (s % 7)) as f32
        })
        .collect()
}

fn sum(be: &dyn Backend, v: View<'_>) -> f64 {
    be.step_status(&[], &[v.into()])
        .expect("step status")
        .sum_squares[0]
}

#[test]
fn host_gradients_sum_in_the_kernels_order() {
    let be = cuda::emulated(DType::Bf16).expect("the emulated device");
    let mut differs_from_cpu = false;
    for dtype in [DType::F32, DType::Bf16, DType::F16] {
        for (n, start) in [
            (0, 0),
            (1, 0),
            (37, 0),
            (4096, 0),
            (4097, 3),
            (70_001, 0),
            (70_001, 1),
            (4_300_000, 0),
        ] {
            let data = values(n + start, n as u64);
            let mut dev = be.buffer(dtype, n + start).expect("device buffer");
            dev.write_f32(0, &data).expect("upload");
            let mut host = Storage::Host(FlatBuf::zeros(dtype, n + start));
            host.write_f32(0, &data).expect("host write");
            let r = start..start + n;
            let want = sum(&*be, dev.range(r.clone()).unwrap());
            let got = sum(&*be, host.range(r.clone()).unwrap());
            assert_eq!(
                got.to_bits(),
                want.to_bits(),
                "{dtype:?}, {n} elements from {start}: host {got} vs device {want}"
            );
            let cpu = sum(&CpuBackend, host.range(r).unwrap());
            differs_from_cpu |= cpu.to_bits() != want.to_bits();
        }
    }
    // Otherwise the values would not tell one order from another.
    assert!(differs_from_cpu, "every order gave the same bits");
}
