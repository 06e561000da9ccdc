//! `LlamaForCausalLM`, `MistralForCausalLM` and `Qwen2ForCausalLM` configs: one decoder
//! ([`crate::nn::llama`]) whose differences are a few keys.

use super::keys::Keys;
use super::{rope, Architecture};
use crate::nn::llama::LlamaConfig;
use crate::Result;

/// Reads a Llama-family config for `arch`.
pub(super) fn read(k: &mut Keys<'_>, arch: Architecture) -> Result<LlamaConfig> {
    let hidden_size = k.usize("hidden_size")?;
    let num_attention_heads = k.usize("num_attention_heads")?;
    k.one_of("hidden_act", "silu", &["silu", "swish"])?;
    // Tensor-parallel pretraining splits the same products into slices: the math is unchanged.
    k.accept(&["pretraining_tp"]);
    let (qkv_bias, sliding_window) = match arch {
        Architecture::Llama => {
            let why = "o_proj biases are not implemented";
            k.require_bool("attention_bias", false, false, why)?;
            k.require_bool("mlp_bias", false, false, "MLP biases are not implemented")?;
            (false, None)
        }
        Architecture::Mistral => (false, mistral_window(k)?),
        Architecture::Qwen2 => (true, qwen2_window(k)?),
        Architecture::Gpt2 => unreachable!("GPT-2 is read by hf::gpt2"),
    };
    let cfg = LlamaConfig {
        hidden_size,
        intermediate_size: k.usize("intermediate_size")?,
        num_hidden_layers: k.usize("num_hidden_layers")?,
        num_attention_heads,
        num_key_value_heads: k.usize_opt("num_key_value_heads")?,
        head_dim: k.usize_opt("head_dim")?,
        rms_norm_eps: k.f32_or("rms_norm_eps", 1e-6)?,
        rope: rope::read(k, 10000.0)?,
        vocab_size: k.usize("vocab_size")?,
        max_position_embeddings: k.usize("max_position_embeddings")?,
        tie_word_embeddings: k.bool_or("tie_word_embeddings", false)?,
        initializer_range: k.f32_or("initializer_range", 0.02)?,
        qkv_bias,
        sliding_window,
        attention_dropout: k.f32_or("attention_dropout", 0.0)?,
    };
    cfg.validate().map_err(|e| k.err(e))?;
    Ok(cfg)
}

/// Mistral's `sliding_window`: absent means transformers' default 4096, `null` none.
fn mistral_window(k: &mut Keys<'_>) -> Result<Option<usize>> {
    let present = k.has("sliding_window");
    let w = k.usize_opt("sliding_window")?;
    Ok(if present { w } else { Some(4096) })
}

/// Qwen2 applies `sliding_window` only with `use_sliding_window` (to the layers from
/// `max_window_layers` on), or to the layers `layer_types` marks `sliding_attention`.
fn qwen2_window(k: &mut Keys<'_>) -> Result<Option<usize>> {
    let mut on = k.bool_or("use_sliding_window", false)?;
    k.accept(&["max_window_layers"]);
    if let Some(types) = k.raw("layer_types") {
        let list = types
            .as_array()
            .map(|a| a.iter().map(|v| v.as_str()).collect::<Vec<_>>());
        let Some(list) = list else {
            return Err(k.err(format!(
                "key `layer_types` = {types} is not a list of strings"
            )));
        };
        for t in list {
            match t {
                Some("full_attention") => {}
                Some("sliding_attention") => on = true,
                other => {
                    return Err(k.err(format!(
                        "key `layer_types` holds {other:?}, which is not supported \
                         (supported: full_attention, sliding_attention)"
                    )))
                }
            }
        }
    }
    let w = k.usize_opt("sliding_window")?;
    Ok(if on { Some(w.unwrap_or(4096)) } else { None })
}
