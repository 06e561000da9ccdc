//! Tiny GPT-2 and Llama models of real architecture (2 heads / grouped-query heads, 16 wide),
//! small enough for the emulated device to train in a test: the shapes the device tests count
//! launches, syncs and bytes on.

#![allow(dead_code)]

use ferrozero_runtime::nn::{gpt2, llama, Model};

/// Vocabulary of both: odd, so the head's padding is exercised.
pub const VOCAB: usize = 61;

/// A GPT-2 of `layers` blocks, dropout off.
pub fn gpt2_model(layers: usize) -> Model {
    let cfg = gpt2::Gpt2Config::from_json(&format!(
        r#"{{"n_layer": {layers}, "n_head": 2, "n_embd": 16, "vocab_size": {VOCAB},
            "n_positions": 16, "layer_norm_epsilon": 1e-5, "model_type": "gpt2",
            "activation_function": "gelu_new", "resid_pdrop": 0.0, "embd_pdrop": 0.0,
            "attn_pdrop": 0.0}}"#
    ))
    .expect("valid GPT-2 config");
    gpt2::build(&cfg).expect("GPT-2 builds")
}

/// A Llama of `layers` blocks, 4 query heads over 2 key/value heads, untied head.
pub fn llama_model(layers: usize) -> Model {
    llama_with_head(layers, false)
}

/// As [`llama_model`] with the head tied to the embedding table (Llama-3.2-1B's layout): the
/// embedding unit then has no gradient of its own.
pub fn llama_tied_model(layers: usize) -> Model {
    llama_with_head(layers, true)
}

fn llama_with_head(layers: usize, tied: bool) -> Model {
    let cfg = llama::LlamaConfig::from_json(&format!(
        r#"{{"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": {layers},
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": {VOCAB},
            "max_position_embeddings": 16, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "tie_word_embeddings": {tied}, "hidden_act": "silu"}}"#
    ))
    .expect("valid Llama config");
    llama::build(&cfg).expect("Llama builds")
}

/// The 2-block GPT-2 of [`gpt2_model`] with PEFT's LoRA (r 4, alpha 8, dropout 0.1) on the
/// layers `targets` names (a JSON value: a list of names or `"all-linear"`) and, beside them,
/// `modules_to_save`; every other parameter frozen, as PEFT freezes them.
pub fn gpt2_lora(targets: &str, modules_to_save: &str) -> Model {
    let cfg = gpt2::Gpt2Config::from_json(&format!(
        r#"{{"n_layer": 2, "n_head": 2, "n_embd": 16, "vocab_size": {VOCAB}, "n_positions": 16,
            "model_type": "gpt2", "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}}"#
    ))
    .expect("valid GPT-2 config");
    let lora = ferrozero_runtime::nn::peft::LoraConfig::from_json(
        &format!(
            r#"{{"peft_type": "LORA", "r": 4, "lora_alpha": 8, "lora_dropout": 0.1,
                "target_modules": {targets}, "modules_to_save": {modules_to_save}}}"#
        ),
        "test",
    )
    .expect("valid LoRA config");
    let sites = gpt2::linear_sites(&cfg);
    let (adapters, frozen) =
        ferrozero_runtime::nn::peft::plan(&lora, &sites, "GPT2LMHeadModel").expect("adapters");
    let model = gpt2::build_with(&cfg, &adapters).expect("GPT-2 builds");
    model.freeze(frozen).expect("PEFT's rules match")
}

/// A 2-block Llama 16 wide (2 heads, inner width 24, head tied to the table), initialised at
/// 0.3 so a few steps move every parameter: the device tests' model of vocabulary `vocab`
/// and context `seq`.
pub fn small_llama(vocab: usize, seq: usize) -> Model {
    llama::build(&llama::LlamaConfig {
        hidden_size: 16,
        intermediate_size: 24,
        num_hidden_layers: 2,
        num_attention_heads: 2,
        num_key_value_heads: None,
        head_dim: None,
        rms_norm_eps: 1e-6,
        rope: ferrozero_runtime::backend::Rope::plain(10000.0),
        vocab_size: vocab,
        max_position_embeddings: seq,
        tie_word_embeddings: true,
        initializer_range: 0.3,
        qkv_bias: false,
        sliding_window: None,
        attention_dropout: 0.0,
    })
    .expect("a valid Llama")
}

/// GPT-2 with every attention block's weights, the tied table and the positions frozen:
/// units mixed (attention frozen, the MLP and norms train) and a frozen shared group.
pub fn gpt2_part_frozen() -> Model {
    let f = ferrozero_runtime::nn::freeze::Freeze::new(&["*.attn.*", "transformer.w?e.weight"]);
    gpt2_model(2).freeze(f.unwrap()).unwrap()
}
