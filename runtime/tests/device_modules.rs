//! The built-in models' units on every device: a forward and backward of a small GPT-2 (with
//! dropout, whose masks every device draws alike) and of a small Llama (GQA, RoPE, tied and
//! untied heads) against the CPU backend on the same (device-rounded) weights, and every
//! unit's backward against finite differences on f32 devices.

mod device_common;
mod nn_common;

use device_common::{assert_close, Dev, Tol};
use ferrozero_runtime::nn::gpt2::{self, Gpt2Config};
use ferrozero_runtime::nn::gradcheck::{self, Options};
use ferrozero_runtime::nn::llama::{self, LlamaConfig};
use ferrozero_runtime::nn::Model;
use ferrozero_runtime::tensor::{DType, Tensor};
use nn_common::{batch, random, step_on, Weights};

fn gpt2_cfg(dropout: f32) -> Gpt2Config {
    let mut c = Gpt2Config::preset("tiny").unwrap();
    (c.n_layer, c.n_head, c.n_embd, c.vocab_size, c.n_positions) = (2, 3, 24, 37, 16);
    (c.resid_pdrop, c.embd_pdrop) = (dropout, dropout);
    c
}

fn llama_cfg(tied: bool) -> LlamaConfig {
    let mut c = LlamaConfig::preset("tiny").unwrap();
    (c.hidden_size, c.intermediate_size, c.num_hidden_layers) = (24, 40, 2);
    (c.num_attention_heads, c.num_key_value_heads, c.vocab_size) = (6, Some(2), 29);
    c.max_position_embeddings = 16;
    c.tie_word_embeddings = tied;
    c
}

/// Weights with more spread than the initialiser's, rounded to the device's dtype (so the
/// CPU reference computes on exactly the values the device holds).
fn weights(d: &Dev, model: &Model, seed: u64) -> Weights {
    let mut w = Weights::init(model, seed);
    for (i, v) in w
        .units
        .iter_mut()
        .flatten()
        .chain(w.shared.iter_mut())
        .enumerate()
    {
        let noise = device_common::rand(v.len(), seed ^ i as u64);
        for (x, n) in v.iter_mut().zip(noise) {
            *x += 0.2 * n;
        }
        *v = d.round(v);
    }
    w
}

/// Loss and every gradient of one micro-step on `d` against the CPU.
fn model_matches_cpu(d: &Dev, model: &Model, vocab: usize) {
    let w = weights(d, model, 5);
    let b = batch(2, 11, vocab, 3);
    let got = step_on(&*d.be, model, &w, &b, 7, 0.5).unwrap();
    let want = step_on(&*device_common::cpu().be, model, &w, &b, 7, 0.5).unwrap();
    let t = d.tol();
    assert_close(
        &format!("{} loss", d.name),
        &[got.loss],
        &[want.loss],
        Tol {
            abs: 1e-3,
            rel: t.rel,
        },
    );
    // Gradients sum over the batch's 22 tokens and the layers' widths: scale the absolute
    // tolerance with the gradient's own magnitude.
    for ((name, g), (_, c)) in got
        .grads
        .named(model)
        .into_iter()
        .zip(want.grads.named(model))
    {
        let scale = c.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
        let tol = Tol {
            abs: t.abs.max(t.rel) * scale.max(1e-3) * 2.0,
            rel: t.rel,
        };
        assert_close(&format!("{} {name}", d.name), g, c, tol);
    }
}

fn gpt2_matches_cpu(d: &Dev) {
    model_matches_cpu(d, &gpt2::build(&gpt2_cfg(0.2)).unwrap(), 37);
}
test_device!(gpt2_matches_cpu);

fn llama_matches_cpu(d: &Dev) {
    for tied in [false, true] {
        model_matches_cpu(d, &llama::build(&llama_cfg(tied)).unwrap(), 29);
    }
}
test_device!(llama_matches_cpu);

/// Every unit's backward against central differences, computed on the device (f32 only:
/// finite differences need the precision).
fn units_pass_gradcheck(d: &Dev) {
    if d.act() != DType::F32 {
        eprintln!(
            "{}: gradcheck needs f32 activations; covered by the f32 devices",
            d.name
        );
        return;
    }
    for (model, width, vocab) in [
        (gpt2::build(&gpt2_cfg(0.3)).unwrap(), 24, 37),
        (llama::build(&llama_cfg(false)).unwrap(), 24, 29),
    ] {
        let w = weights(d, &model, 9);
        let b = batch(2, 7, vocab, 11);
        for (u, unit) in model.units.iter().enumerate() {
            let input = if u == 0 {
                Tensor::default()
            } else {
                random(vec![2, 7, width], 13 + u as u64)
            };
            let mut params = w.unit_vecs(&model, u);
            let opts = Options {
                max_per_tensor: 16,
                ..Options::default()
            };
            let r =
                gradcheck::check_on(&*d.be, unit.module.as_ref(), &b, &mut params, &input, &opts)
                    .unwrap();
            assert!(r.passed(), "{} unit {}:\n{r}", d.name, unit.name);
        }
    }
}
test_device!(units_pass_gradcheck);
