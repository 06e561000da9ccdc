//! The device's stated peak, for model FLOPs utilisation (`mfu`): datasheet dense figures
//! for known GPUs by the name the driver reports, in the dtype the matrix products run in.
//! The CPU has no figure: one computed from cores × FMA width × clock would be a guess
//! (turbo, AVX frequency offsets, shared cores), so without `flops_profiler.peak_tflops` or
//! `--peak-tflops` the CPU reports `mfu: null` rather than a made-up number.

use crate::tensor::DType;

/// Dense TFLOP/s per GPU: (a name fragment, bf16/f16 tensor cores, f32 without TF32). The
/// first fragment found in the device name wins, so the more specific ones come first.
const GPUS: &[(&str, f64, f64)] = &[
    ("GH200", 989.0, 67.0),
    ("H200", 989.0, 67.0),
    ("H100 PCIe", 756.0, 51.0),
    ("H100 NVL", 835.0, 60.0),
    ("H100", 989.0, 67.0),
    ("H800", 989.0, 67.0),
    ("B200", 2250.0, 80.0),
    ("A100", 312.0, 19.5),
    ("A800", 312.0, 19.5),
    ("L40S", 362.0, 91.6),
    ("L40", 181.0, 90.5),
    ("L4", 121.0, 30.3),
    ("A10G", 70.0, 31.2),
    ("A10", 125.0, 31.2),
    ("RTX 4090", 165.2, 82.6),
    ("RTX 3090", 71.0, 35.6),
    ("V100", 125.0, 15.7),
];

/// The stated dense peak of the device `backend_name` names (the backend's
/// [`crate::backend::Backend::name`], which carries the driver's device name) for products
/// whose operands are `dtype`; `None` for the CPU, the emulator and unknown GPUs. The
/// CUDA backend accumulates f32 products without TF32, so f32 gets the plain f32 figure.
pub fn stated_peak_tflops(backend_name: &str, dtype: DType) -> Option<f64> {
    let (_, half, single) = GPUS.iter().find(|(n, ..)| backend_name.contains(n))?;
    Some(match dtype {
        DType::Bf16 | DType::F16 => *half,
        DType::F32 => *single,
    })
}

/// Model FLOPs utilisation: the model FLOPs one device achieved per second over its peak;
/// `None` without a peak.
pub fn mfu(flops_per_second: f64, peak_tflops: Option<f64>) -> Option<f64> {
    let peak = peak_tflops.filter(|p| *p > 0.0)?;
    Some(flops_per_second / (peak * 1e12))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_gpus_by_driver_name_and_none_elsewhere() {
        let h100 = "cuda:0 (NVIDIA H100 80GB HBM3)";
        assert_eq!(stated_peak_tflops(h100, DType::Bf16), Some(989.0));
        assert_eq!(stated_peak_tflops(h100, DType::F32), Some(67.0));
        assert_eq!(
            stated_peak_tflops("cuda:1 (NVIDIA H100 PCIe)", DType::Bf16),
            Some(756.0)
        );
        assert_eq!(
            stated_peak_tflops("cuda:0 (NVIDIA H200)", DType::Bf16),
            Some(989.0)
        );
        assert_eq!(
            stated_peak_tflops("cuda:0 (NVIDIA A100-SXM4-80GB)", DType::F16),
            Some(312.0)
        );
        assert_eq!(stated_peak_tflops("cpu", DType::F32), None);
        assert_eq!(stated_peak_tflops("cuda:emulated", DType::Bf16), None);
        assert_eq!(
            stated_peak_tflops("cuda:0 (Some Future GPU)", DType::Bf16),
            None
        );
    }

    #[test]
    fn mfu_is_achieved_over_peak_and_absent_without_a_peak() {
        // The figure: 192k tokens/s of GPT-2 124M (6N + 6LCT at T = 1024) on an H100.
        let per_token = 6 * 124_439_808u64 + 6 * 12 * 768 * 1024;
        let m = mfu(192_000.0 * per_token as f64, Some(989.0)).unwrap();
        assert!((m - 0.16).abs() < 0.01, "{m}");
        assert_eq!(mfu(1e12, None), None);
        assert_eq!(mfu(1e12, Some(2.0)), Some(0.5));
    }
}
