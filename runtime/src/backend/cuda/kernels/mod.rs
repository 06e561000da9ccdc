//! ferrozero's own CUDA kernels: CUDA C sources compiled at run time with NVRTC (on a GPU) or
//! as C++ by the CPU emulator ([`super::emu`]), one file per family of operations.
//!
//! Each file's header comment is its contract: what every kernel computes, its arguments, which
//! outputs are overwritten and which accumulated, scratch sizes and the launch shape. Every
//! kernel is `extern "C"` with a globally unique name; variants over the activation/parameter
//! dtype carry the suffixes `_f32`, `_bf16`, `_f16`.

pub mod params;

/// One CUDA C source file of ferrozero's kernels.
pub struct KernelSource {
    /// File name, e.g. `norm.cu` (the NVRTC program name).
    pub file: &'static str,
    /// The file's text, without the prelude (`include_str!`).
    pub code: &'static str,
    /// Every `extern "C" __global__` function it defines, in file order.
    pub kernels: &'static [&'static str],
}

/// The common prelude (`include_str!("prelude.cuh")`).
pub const PRELUDE: &str = include_str!("prelude.cuh");

/// A kernel list: `"base" *` stands for the base's `_f32`, `_bf16`, `_f16` variants, `["a", "b"] *`
/// for every base's `_f32` variant, then every `_bf16`, then every `_f16` (the order the files
/// define them in), and a plain `"name"` for itself.
macro_rules! kernel_list {
    (@out [$($out:expr,)*]) => { &[$($out),*] };
    (@out [$($out:expr,)*] $base:literal * $(, $($rest:tt)*)?) => {
        kernel_list!(@out [$($out,)* concat!($base, "_f32"), concat!($base, "_bf16"),
            concat!($base, "_f16"),] $($($rest)*)?)
    };
    (@out [$($out:expr,)*] [$($base:literal),+] * $(, $($rest:tt)*)?) => {
        kernel_list!(@out [$($out,)* $(concat!($base, "_f32"),)+ $(concat!($base, "_bf16"),)+
            $(concat!($base, "_f16"),)+] $($($rest)*)?)
    };
    (@out [$($out:expr,)*] $name:literal $(, $($rest:tt)*)?) => {
        kernel_list!(@out [$($out,)* $name,] $($($rest)*)?)
    };
    ($($items:tt)*) => { kernel_list!(@out [] $($items)*) };
}

/// One registry entry: the file, its text and its kernels.
macro_rules! source {
    ($file:literal: $($kernels:tt)*) => {
        KernelSource { file: $file, code: include_str!($file), kernels: kernel_list!($($kernels)*) }
    };
}

/// Every kernel source.
pub const SOURCES: &[KernelSource] = &[
    source!("elementwise.cu":
        "gelu_forward" *, "gelu_backward" *, "swiglu_forward" *, "swiglu_backward" *,
        "add_assign" *, "dropout" *, "fill" *, "add_bias_rows" *),
    source!("norm.cu":
        "layernorm_forward" *, "layernorm_backward" *, "rmsnorm_forward" *, "rmsnorm_backward" *,
        ["residual_layernorm_forward", "residual_rmsnorm_forward",
            "layernorm_backward_residual", "rmsnorm_backward_residual"] *,
        "norm_dparams_finalize"),
    source!("embed.cu":
        "embedding_forward" *, "position_forward" *, "embedding_backward" *,
        "position_backward" *),
    source!("loss.cu":
        "cross_entropy_forward" *, "cross_entropy_backward" *, "cross_entropy_fused" *,
        "cross_entropy_loss_sum", "argmax" *),
    source!("rope.cu": "rope" *, "rope_qk" *),
    source!("reduce.cu":
        "cast_f32_to_bf16", "cast_f32_to_f16", "cast_bf16_to_f32", "cast_f16_to_f32",
        "cast_bf16_to_f16", "cast_f16_to_bf16", "max_assign_f32", "div_f32", "unscale" *,
        "sum_squares" *, "sum_squares_f32_as_bf16", "sum_squares_f32_as_f16",
        "sum_squares_finalize", "colsum_partial" *, "colsum_finalize"),
    source!("optim.cu":
        "lamb_moments", "adam_multi" *, "sgd_multi" *, "lion_multi" *, "adam_bf16_state",
        "sgd_bf16_state", "lion_bf16_state", "lamb_apply" *, "clip_grad_scale"),
    source!("attention.cu":
        "attention_forward_d32" *, "attention_forward_d64" *, "attention_forward_d96" *,
        "attention_forward_d128" *, "attention_bwd_dot" *, "attention_bwd_dkdv_d32" *,
        "attention_bwd_dkdv_d64" *, "attention_bwd_dkdv_d96" *, "attention_bwd_dkdv_d128" *,
        "attention_bwd_dq_d32" *, "attention_bwd_dq_d64" *, "attention_bwd_dq_d96" *,
        "attention_bwd_dq_d128" *),
    source!("quant.cu": "quantize" *, "dequantize" *),
];

/// The text handed to NVRTC or to the emulator's compiler: the prelude, a `#line 1 "<file>"`, the code.
pub fn program_text(src: &KernelSource) -> String {
    let mut text = String::with_capacity(PRELUDE.len() + src.code.len() + 64);
    text.push_str(PRELUDE);
    if !PRELUDE.ends_with('\n') {
        text.push('\n');
    }
    text.push_str(&format!("#line 1 \"{}\"\n", src.file));
    text.push_str(src.code);
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    /// Names of the `extern "C" __global__` functions defined in `code`, in order.
    fn global_names(code: &str) -> Vec<String> {
        params::parse::signatures(code)
            .into_iter()
            .map(|s| s.name)
            .collect()
    }

    #[test]
    fn registry_lists_every_global_of_every_file_in_order() {
        for src in SOURCES {
            let found = global_names(src.code);
            assert_eq!(
                found, src.kernels,
                "{}: the registry's kernel list differs from the file",
                src.file
            );
        }
    }

    #[test]
    fn kernel_and_file_names_are_unique() {
        let mut kernels = HashSet::new();
        let mut files = HashSet::new();
        for src in SOURCES {
            assert!(files.insert(src.file), "{} listed twice", src.file);
            for k in src.kernels {
                assert!(
                    kernels.insert(*k),
                    "kernel {k} defined twice ({})",
                    src.file
                );
            }
        }
    }

    #[test]
    fn program_text_is_prelude_line_directive_code() {
        let src = &SOURCES[0];
        let text = program_text(src);
        assert!(text.starts_with(PRELUDE));
        assert!(text.contains(&format!("\n#line 1 \"{}\"\n", src.file)));
        assert!(text.ends_with(src.code));
    }

    #[test]
    fn parser_skips_comments_and_launch_bounds() {
        let code = "// extern \"C\" __global__ void ghost(\n\
                    extern \"C\" __global__ __launch_bounds__(256, 2) void real_one(int x) {}\n\
                    /* extern \"C\" __global__ void ghost2( */\n\
                    extern \"C\" __global__ void real_two() {}";
        assert_eq!(global_names(code), ["real_one", "real_two"]);
    }
}
