//! Hot pointwise loops compiled for several x86-64 levels, one picked at run time.
//!
//! The default build targets baseline x86-64 (SSE2: four f32 lanes, no AVX), so LLVM's
//! vectorised loops ran at half the width the machine has. [`simd_kernel!`] compiles a kernel
//! again for AVX2 and for AVX-512 (with the Ice Lake / Zen 4 feature set, as the optimizer's
//! loops do) and `multiversion` dispatches once per process. The kernels use only operations
//! Rust never reassociates or contracts (separate mul and add, division, sqrt, min/max
//! clamps), so every version gives the same bits as the baseline one: ordered sums stay
//! ordered, only the element-wise work gets wider.

/// Marks a free function as a kernel compiled per x86-64 level (see the module docs).
macro_rules! simd_kernel {
    ($(#[$m:meta])* $vis:vis fn $($rest:tt)*) => {
        $(#[$m])*
        #[multiversion::multiversion(targets(
            "x86_64+avx512f+avx512bw+avx512vl+avx2+avx",
            "x86_64+avx2+avx"
        ))]
        $vis fn $($rest)*
    };
}
pub(super) use simd_kernel;
