//! A tiny Llama (GQA, RoPE, SwiGLU, untied head) against PyTorch (float64 reference): summed
//! loss and every parameter gradient. Fixture and generator: `tests/fixtures/gen_llama_golden.py`.

mod nn_common;

use std::path::Path;

use ferrozero_runtime::nn::llama::{self, LlamaConfig};
use ferrozero_runtime::nn::weights::{self, Naming};
use nn_common::{golden, step};

fn get<'a>(f: &'a [weights::NamedTensor], name: &str) -> &'a [f32] {
    &f.iter()
        .find(|t| t.name == name)
        .unwrap_or_else(|| panic!("fixture lacks {name}"))
        .data
}

#[test]
fn llama_loss_and_every_gradient_match_pytorch() {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama_tiny_golden.safetensors");
    let f = weights::load(&path, Naming::Exact).expect("fixture loads");
    let cfg = LlamaConfig::from_json(
        r#"{"hidden_size": 24, "intermediate_size": 40, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 45,
            "max_position_embeddings": 16, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "tie_word_embeddings": false, "hidden_act": "silu"}"#,
    )
    .expect("valid config");
    let model = llama::build(&cfg).expect("model builds");
    let (w, batch) = golden(&model, &f, (2, 7));
    let out = step(&model, &w, &batch, 0, 1.0).expect("step runs");
    let want = get(&f, "golden.loss")[0];
    assert!(
        (out.loss - want).abs() <= 1e-4 * want.abs(),
        "loss {} vs {want}",
        out.loss
    );
    for (name, g) in out.grads.named(&model) {
        let want = get(&f, &format!("grad.{name}"));
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-3);
        for (i, (a, b)) in g.iter().zip(want).enumerate() {
            assert!(
                (a - b).abs() <= 2e-4 * scale,
                "{name}[{i}]: got {a}, want {b} (scale {scale})"
            );
        }
    }
}
