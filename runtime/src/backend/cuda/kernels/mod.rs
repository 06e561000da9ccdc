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

/// Every kernel source.
pub const SOURCES: &[KernelSource] = &[
    KernelSource {
        file: "elementwise.cu",
        code: include_str!("elementwise.cu"),
        kernels: &[
            "gelu_forward_f32",
            "gelu_forward_bf16",
            "gelu_forward_f16",
            "gelu_backward_f32",
            "gelu_backward_bf16",
            "gelu_backward_f16",
            "swiglu_forward_f32",
            "swiglu_forward_bf16",
            "swiglu_forward_f16",
            "swiglu_backward_f32",
            "swiglu_backward_bf16",
            "swiglu_backward_f16",
            "add_assign_f32",
            "add_assign_bf16",
            "add_assign_f16",
            "dropout_f32",
            "dropout_bf16",
            "dropout_f16",
            "fill_f32",
            "fill_bf16",
            "fill_f16",
            "add_bias_rows_f32",
            "add_bias_rows_bf16",
            "add_bias_rows_f16",
        ],
    },
    KernelSource {
        file: "norm.cu",
        code: include_str!("norm.cu"),
        kernels: &[
            "layernorm_forward_f32",
            "layernorm_forward_bf16",
            "layernorm_forward_f16",
            "layernorm_backward_f32",
            "layernorm_backward_bf16",
            "layernorm_backward_f16",
            "rmsnorm_forward_f32",
            "rmsnorm_forward_bf16",
            "rmsnorm_forward_f16",
            "rmsnorm_backward_f32",
            "rmsnorm_backward_bf16",
            "rmsnorm_backward_f16",
            "residual_layernorm_forward_f32",
            "residual_rmsnorm_forward_f32",
            "layernorm_backward_residual_f32",
            "rmsnorm_backward_residual_f32",
            "residual_layernorm_forward_bf16",
            "residual_rmsnorm_forward_bf16",
            "layernorm_backward_residual_bf16",
            "rmsnorm_backward_residual_bf16",
            "residual_layernorm_forward_f16",
            "residual_rmsnorm_forward_f16",
            "layernorm_backward_residual_f16",
            "rmsnorm_backward_residual_f16",
            "norm_dparams_finalize",
        ],
    },
    KernelSource {
        file: "embed.cu",
        code: include_str!("embed.cu"),
        kernels: &[
            "embedding_forward_f32",
            "embedding_forward_bf16",
            "embedding_forward_f16",
            "position_forward_f32",
            "position_forward_bf16",
            "position_forward_f16",
            "embedding_backward_f32",
            "embedding_backward_bf16",
            "embedding_backward_f16",
            "position_backward_f32",
            "position_backward_bf16",
            "position_backward_f16",
        ],
    },
    KernelSource {
        file: "loss.cu",
        code: include_str!("loss.cu"),
        kernels: &[
            "cross_entropy_forward_f32",
            "cross_entropy_forward_bf16",
            "cross_entropy_forward_f16",
            "cross_entropy_backward_f32",
            "cross_entropy_backward_bf16",
            "cross_entropy_backward_f16",
            "cross_entropy_fused_f32",
            "cross_entropy_fused_bf16",
            "cross_entropy_fused_f16",
            "cross_entropy_loss_sum",
            "argmax_f32",
            "argmax_bf16",
            "argmax_f16",
        ],
    },
    KernelSource {
        file: "rope.cu",
        code: include_str!("rope.cu"),
        kernels: &[
            "rope_f32",
            "rope_bf16",
            "rope_f16",
            "rope_qk_f32",
            "rope_qk_bf16",
            "rope_qk_f16",
        ],
    },
    KernelSource {
        file: "reduce.cu",
        code: include_str!("reduce.cu"),
        kernels: &[
            "cast_f32_to_bf16",
            "cast_f32_to_f16",
            "cast_bf16_to_f32",
            "cast_f16_to_f32",
            "cast_bf16_to_f16",
            "cast_f16_to_bf16",
            "max_assign_f32",
            "div_f32",
            "unscale_f32",
            "unscale_bf16",
            "unscale_f16",
            "sum_squares_f32",
            "sum_squares_bf16",
            "sum_squares_f16",
            "sum_squares_f32_as_bf16",
            "sum_squares_f32_as_f16",
            "sum_squares_finalize",
            "colsum_partial_f32",
            "colsum_partial_bf16",
            "colsum_partial_f16",
            "colsum_finalize",
        ],
    },
    KernelSource {
        file: "optim.cu",
        code: include_str!("optim.cu"),
        kernels: &[
            "lamb_moments",
            "adam_multi_f32",
            "adam_multi_bf16",
            "adam_multi_f16",
            "sgd_multi_f32",
            "sgd_multi_bf16",
            "sgd_multi_f16",
            "lion_multi_f32",
            "lion_multi_bf16",
            "lion_multi_f16",
            "adam_bf16_state",
            "sgd_bf16_state",
            "lion_bf16_state",
            "lamb_apply_f32",
            "lamb_apply_bf16",
            "lamb_apply_f16",
            "clip_grad_scale",
        ],
    },
    KernelSource {
        file: "attention.cu",
        code: include_str!("attention.cu"),
        kernels: &[
            "attention_forward_d32_f32",
            "attention_forward_d32_bf16",
            "attention_forward_d32_f16",
            "attention_forward_d64_f32",
            "attention_forward_d64_bf16",
            "attention_forward_d64_f16",
            "attention_forward_d96_f32",
            "attention_forward_d96_bf16",
            "attention_forward_d96_f16",
            "attention_forward_d128_f32",
            "attention_forward_d128_bf16",
            "attention_forward_d128_f16",
            "attention_bwd_dot_f32",
            "attention_bwd_dot_bf16",
            "attention_bwd_dot_f16",
            "attention_bwd_dkdv_d32_f32",
            "attention_bwd_dkdv_d32_bf16",
            "attention_bwd_dkdv_d32_f16",
            "attention_bwd_dkdv_d64_f32",
            "attention_bwd_dkdv_d64_bf16",
            "attention_bwd_dkdv_d64_f16",
            "attention_bwd_dkdv_d96_f32",
            "attention_bwd_dkdv_d96_bf16",
            "attention_bwd_dkdv_d96_f16",
            "attention_bwd_dkdv_d128_f32",
            "attention_bwd_dkdv_d128_bf16",
            "attention_bwd_dkdv_d128_f16",
            "attention_bwd_dq_d32_f32",
            "attention_bwd_dq_d32_bf16",
            "attention_bwd_dq_d32_f16",
            "attention_bwd_dq_d64_f32",
            "attention_bwd_dq_d64_bf16",
            "attention_bwd_dq_d64_f16",
            "attention_bwd_dq_d96_f32",
            "attention_bwd_dq_d96_bf16",
            "attention_bwd_dq_d96_f16",
            "attention_bwd_dq_d128_f32",
            "attention_bwd_dq_d128_bf16",
            "attention_bwd_dq_d128_f16",
        ],
    },
    KernelSource {
        file: "quant.cu",
        code: include_str!("quant.cu"),
        kernels: &[
            "quantize_f32",
            "quantize_bf16",
            "quantize_f16",
            "dequantize_f32",
            "dequantize_bf16",
            "dequantize_f16",
        ],
    },
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
