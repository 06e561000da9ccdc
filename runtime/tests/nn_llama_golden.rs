//! A tiny Llama (GQA, RoPE, SwiGLU, untied head) against PyTorch (float64 reference): summed
//! loss and every parameter gradient. Fixture and generator: `tests/fixtures/gen_llama_golden.py`.

mod nn_common;

use ferrozero_runtime::nn::llama::{self, LlamaConfig};
use nn_common::{assert_golden_step, fixture, golden};

#[test]
fn llama_loss_and_every_gradient_match_pytorch() {
    let f = fixture("llama_tiny_golden.safetensors");
    let cfg = LlamaConfig::from_json(
        r#"{"hidden_size": 24, "intermediate_size": 40, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 45,
            "max_position_embeddings": 16, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "tie_word_embeddings": false, "hidden_act": "silu"}"#,
    )
    .expect("valid config");
    let model = llama::build(&cfg).expect("model builds");
    let (w, batch) = golden(&model, &f, (2, 7));
    assert_golden_step(&model, &w, &batch, &f);
}
