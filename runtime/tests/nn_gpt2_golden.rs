//! A tiny GPT-2 against PyTorch (float64 reference): logits, summed loss and every
//! parameter gradient. Fixture and generator: `tests/fixtures/gen_gpt2_golden.py`.

mod nn_common;

use ferrozero_runtime::nn::gpt2::{self, Gpt2Config};
use ferrozero_runtime::nn::weights;
use ferrozero_runtime::nn::{Batch, BatchIds, Ctx, Params, Saved};
use ferrozero_runtime::tensor::{Tensor, View};
use nn_common::{assert_close, assert_golden_step, fixture, get, golden, Weights};

fn config() -> Gpt2Config {
    Gpt2Config::from_json(
        r#"{"n_layer": 2, "n_head": 3, "n_embd": 24, "vocab_size": 53, "n_positions": 16,
            "layer_norm_epsilon": 1e-5, "model_type": "gpt2", "activation_function": "gelu_new",
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}"#,
    )
    .expect("valid config")
}

fn load_model() -> (
    ferrozero_runtime::nn::Model,
    Weights,
    Batch,
    Vec<weights::NamedTensor>,
) {
    let f = fixture("gpt2_tiny_golden.safetensors");
    let model = gpt2::build(&config()).expect("model builds");
    let (w, batch) = golden(&model, &f, (2, 9));
    (model, w, batch, f)
}

#[test]
fn loss_and_every_gradient_match_pytorch() {
    let (model, w, batch, f) = load_model();
    assert_golden_step(&model, &w, &batch, &f);
}

#[test]
fn logits_match_pytorch() {
    let (model, w, batch, f) = load_model();
    let be = ferrozero_runtime::backend::cpu();
    let ids = BatchIds::new(&*be, &batch).unwrap();
    let mut x = Tensor::default();
    let last = model.units.len() - 1;
    for (u, unit) in model.units[..last].iter().enumerate() {
        let mut p: Vec<View<'_>> = w.units[u].iter().map(|v| v.as_slice().into()).collect();
        p.extend(
            unit.uses_shared
                .iter()
                .map(|&s| View::from(w.shared[s].as_slice())),
        );
        let mut saved: Saved = None;
        let mut ctx = Ctx {
            be: &*be,
            batch: &batch,
            ids: &ids,
            training: false,
            rng_seed: 0,
            rng_row: 0,
            saved: &mut saved,
        };
        x = unit
            .module
            .forward(&mut ctx, &Params::new(p), &x)
            .expect("forward");
        assert!(saved.is_none(), "evaluation mode must not save activations");
    }
    let head = gpt2::head(&config());
    let p = Params::new(vec![
        w.units[last][0].as_slice().into(),
        w.units[last][1].as_slice().into(),
        w.shared[0].as_slice().into(),
    ]);
    let logits = head.logits(&*be, &p, &x).expect("logits");
    assert_eq!(logits.shape, vec![18, 53]);
    assert_close(
        "logits",
        logits.host_f32().unwrap(),
        get(&f, "golden.logits"),
        1e-5,
    );
}
