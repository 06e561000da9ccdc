//! `GPT2LMHeadModel` configs.

use super::keys::Keys;
use crate::nn::gpt2::Gpt2Config;
use crate::Result;

/// Reads a GPT-2 config.
pub(super) fn read(k: &mut Keys<'_>) -> Result<Gpt2Config> {
    // The tanh approximation is what GPT-2 was trained with; both names are that function.
    k.one_of(
        "activation_function",
        "gelu_new",
        &["gelu_new", "gelu_pytorch_tanh"],
    )?;
    let n_embd = k.usize("n_embd")?;
    if let Some(inner) = k.usize_opt("n_inner")? {
        if inner != 4 * n_embd {
            return Err(k.err(format!(
                "key `n_inner` = {inner} is not supported (the MLP is 4 x n_embd = {}; \
                 supported: null or {})",
                4 * n_embd,
                4 * n_embd
            )));
        }
    }
    k.require_bool(
        "scale_attn_weights",
        true,
        true,
        "attention is scaled by 1/sqrt(d)",
    )?;
    let why = "per-layer attention scaling is not implemented";
    k.require_bool("scale_attn_by_inverse_layer_idx", false, false, why)?;
    let why = "the LM head is the embedding table";
    k.require_bool("tie_word_embeddings", true, true, why)?;
    k.require_bool(
        "add_cross_attention",
        false,
        false,
        "GPT-2 here is decoder-only",
    )?;
    // Upcasting attention to f32 is what every backend does; `n_ctx` is an old alias of
    // `n_positions`; the summary_* keys configure a classification head this model lacks.
    k.accept(&[
        "reorder_and_upcast_attn",
        "n_ctx",
        "summary_activation",
        "summary_first_dropout",
        "summary_proj_to_labels",
        "summary_type",
        "summary_use_proj",
    ]);
    let cfg = Gpt2Config {
        n_layer: k.usize("n_layer")?,
        n_head: k.usize("n_head")?,
        n_embd,
        vocab_size: k.usize("vocab_size")?,
        n_positions: k.usize("n_positions")?,
        layer_norm_epsilon: k.f32_or("layer_norm_epsilon", 1e-5)?,
        resid_pdrop: k.f32_or("resid_pdrop", 0.1)?,
        embd_pdrop: k.f32_or("embd_pdrop", 0.1)?,
        attn_pdrop: k.f32_or("attn_pdrop", 0.1)?,
        initializer_range: k.f32_or("initializer_range", 0.02)?,
    };
    cfg.validate().map_err(|e| k.err(e))?;
    Ok(cfg)
}
