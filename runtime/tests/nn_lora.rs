//! A LoRA adapter's branch (`nn::layers::Lora`) on a linear layer in GPT-2's Conv1D layout,
//! on every device: its forward against a naive `x·W + b + scale·(x·Aᵀ)·Bᵀ`, and the input's,
//! the base weight's and both adapter matrices' gradients against finite differences, with
//! and without the adapter's input dropout (whose mask backward redraws).

mod device_common;
mod nn_common;

use std::any::Any;

use device_common::{assert_close, get, Dev, Tol};
use ferrozero_runtime::backend::{self, Accumulate};
use ferrozero_runtime::nn::gpt2::{self, Gpt2Config};
use ferrozero_runtime::nn::gradcheck::{self, Options};
use ferrozero_runtime::nn::layers::{AdapterSpec, Adapters, Dense, Draw, Lora};
use ferrozero_runtime::nn::linear::{Linear, WeightLayout};
use ferrozero_runtime::nn::llama::{self, LlamaConfig};
use ferrozero_runtime::nn::{
    module::SavedState, Batch, BatchIds, Ctx, Grads, Init, Model, Module, ParamSpec, Params,
};
use ferrozero_runtime::tensor::{DType, Storage, Tensor};
use ferrozero_runtime::Result;
use nn_common::{batch, random, Weights};

const D_IN: usize = 13;
const D_OUT: usize = 11;
const R: usize = 3;

/// `y = x·W + b + scale·B(A x')` over `[2, 7, D_IN]` inputs.
#[derive(Debug)]
struct LoraLinear {
    dense: Dense,
    lora: Lora,
}

struct Kept(Storage);

impl SavedState for Kept {
    fn bytes(&self) -> usize {
        self.0.bytes() as usize
    }
    fn into_any(self: Box<Self>) -> Box<dyn Any> {
        self
    }
}

fn layer(scale: f32, dropout: f32) -> LoraLinear {
    let lin = Linear {
        d_in: D_IN,
        d_out: D_OUT,
        layout: WeightLayout::InOut,
    };
    LoraLinear {
        dense: Dense {
            lin,
            weight: 0,
            bias: Some(1),
            lora: None,
        },
        lora: Lora {
            a: 2,
            b: 3,
            r: R,
            scale,
            dropout,
            dims: (D_IN, D_OUT),
        },
    }
}

impl Module for LoraLinear {
    fn param_specs(&self) -> Vec<ParamSpec> {
        let spec = |name: &str, shape: Vec<usize>| ParamSpec {
            name: name.into(),
            shape,
            init: Init::Normal { std: 0.3 },
        };
        vec![
            spec("c_attn.weight", vec![D_IN, D_OUT]),
            spec("c_attn.bias", vec![D_OUT]),
            spec("c_attn.lora_A.weight", vec![R, D_IN]),
            spec("c_attn.lora_B.weight", vec![D_OUT, R]),
        ]
    }

    fn forward(&self, ctx: &mut Ctx<'_>, p: &Params<'_>, input: &Tensor) -> Result<Tensor> {
        let be = ctx.be;
        let rows = input.numel() / D_IN;
        let mut y = be.zeros(be.act_dtype(), rows * D_OUT)?;
        self.dense
            .forward(be, p, (input.view(), None), y.view_mut(), None)?;
        let drop = Draw::of(ctx);
        self.lora.forward(be, p, input.view(), y.view_mut(), drop)?;
        if ctx.training {
            *ctx.saved = Some(Box::new(Kept(be.copy(input.view())?)));
        }
        let mut shape = input.shape.clone();
        *shape.last_mut().unwrap() = D_OUT;
        Tensor::new(shape, y)
    }

    fn backward(
        &self,
        ctx: &mut Ctx<'_>,
        p: &Params<'_>,
        gr: &mut Grads<'_>,
        dy: &Tensor,
    ) -> Result<Tensor> {
        let be = ctx.be;
        let x = ctx
            .saved
            .take()
            .unwrap()
            .into_any()
            .downcast::<Kept>()
            .unwrap()
            .0;
        let drop = Draw::of(ctx);
        let mut dx = be.zeros(be.act_dtype(), x.len())?;
        let dxo = (dx.view_mut(), Accumulate::Overwrite);
        self.dense.backward_input(be, p, dy.view(), dxo, None)?;
        self.lora
            .backward_input(be, p, dy.view(), dx.view_mut(), drop)?;
        self.dense
            .backward_params(be, (p, gr), (x.view(), dy.view()), None)?;
        self.lora
            .backward_params(be, (p, gr), x.view(), dy.view(), drop)?;
        let mut shape = dy.shape.clone();
        *shape.last_mut().unwrap() = D_IN;
        Tensor::new(shape, dx)
    }
}

/// A tensor's elements on the host.
fn host(t: &Tensor) -> Vec<f32> {
    get(&t.storage)
}

fn params(seed: u64) -> Vec<Vec<f32>> {
    let l = layer(1.0, 0.0);
    l.param_specs()
        .iter()
        .enumerate()
        .map(|(i, s)| host(&random(s.shape.clone(), seed + i as u64)))
        .collect()
}

/// `module`'s inference forward on `d` with parameters `ps` and input `x` (host values).
fn forward_on(d: &Dev, module: &LoraLinear, b: &Batch, ps: &[Vec<f32>], x: &[f32]) -> Vec<f32> {
    let be = &*d.be;
    let stored: Vec<Storage> = ps.iter().map(|v| d.put(v)).collect();
    let p = Params::new(stored.iter().map(Storage::view).collect());
    let ids = BatchIds::new(be, b).unwrap();
    let mut saved = None;
    let mut ctx = Ctx {
        be,
        batch: b,
        ids: &ids,
        training: false,
        rng_seed: 0,
        rng_row: 0,
        saved: &mut saved,
    };
    let input = Tensor::new(vec![2, 7, D_IN], d.put(x)).unwrap();
    host(&module.forward(&mut ctx, &p, &input).unwrap())
}

/// `x·W + b + scale·(x·Aᵀ)·Bᵀ` in f64.
fn naive(p: &[Vec<f32>], x: &[f32], scale: f64) -> Vec<f64> {
    let rows = x.len() / D_IN;
    let (w, b, a, bb) = (&p[0], &p[1], &p[2], &p[3]);
    let mut y = vec![0.0; rows * D_OUT];
    for i in 0..rows {
        let xi = &x[i * D_IN..(i + 1) * D_IN];
        let t: Vec<f64> = (0..R)
            .map(|q| {
                (0..D_IN)
                    .map(|k| xi[k] as f64 * a[q * D_IN + k] as f64)
                    .sum()
            })
            .collect();
        for j in 0..D_OUT {
            let base: f64 = (0..D_IN)
                .map(|k| xi[k] as f64 * w[k * D_OUT + j] as f64)
                .sum();
            let low: f64 = (0..R).map(|q| t[q] * bb[j * R + q] as f64).sum();
            y[i * D_OUT + j] = base + b[j] as f64 + scale * low;
        }
    }
    y
}

/// Forward against the naive formula (inference: no dropout), on `d`.
fn forward_matches_the_formula(d: &Dev) {
    let b = batch(2, 7, 5, 1);
    let raw = params(10);
    let x = random(vec![2, 7, D_IN], 3);
    let xs = d.round(&host(&x));
    let ps: Vec<Vec<f32>> = raw.iter().map(|v| d.round(v)).collect();
    let want = naive(&ps, &xs, 2.5);
    let module = layer(2.5, 0.3);
    let got = forward_on(d, &module, &b, &ps, &xs);
    let want: Vec<f32> = want.iter().map(|&v| v as f32).collect();
    let tol = match d.act() {
        DType::F32 => Tol {
            abs: 1e-4,
            rel: 1e-4,
        },
        _ => d.tol(),
    };
    assert_close(&format!("{}: lora forward", d.name), &got, &want, tol);
    // The scale is the branch's only: at scale 0 the layer is the base product.
    let base = forward_on(d, &layer(0.0, 0.0), &b, &ps, &xs);
    let want0: Vec<f32> = naive(&ps, &xs, 0.0).iter().map(|&v| v as f32).collect();
    assert_close(&format!("{}: scale 0", d.name), &base, &want0, tol);
}
test_device!(forward_matches_the_formula);

/// The input's, W's, b's, A's and B's gradients against finite differences, with and without
/// the adapter's input dropout, on every f32 device.
fn backward_matches_finite_differences(d: &Dev) {
    if d.act() != DType::F32 {
        return;
    }
    for dropout in [0.0, 0.3] {
        let module = layer(2.5, dropout);
        let b = batch(2, 7, 5, 2);
        let mut ps = params(20);
        let x = random(vec![2, 7, D_IN], 4);
        let opts = Options {
            max_per_tensor: 0,
            ..Options::default()
        };
        let report = gradcheck::check_on(&*d.be, &module, &b, &mut ps, &x, &opts).unwrap();
        assert!(report.passed(), "{} dropout {dropout}:\n{report}", d.name);
        assert_eq!(report.tensors.len(), 5, "input and four parameters");
    }
}
test_device!(backward_matches_finite_differences);

/// Adapters on every linear layer of every block (PEFT's `"all-linear"` without the head).
fn all_linear(arch: &str, layers: usize, dropout: f32) -> Adapters {
    let modules: &[&str] = match arch {
        "gpt2" => &["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"],
        _ => &[
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        ],
    };
    let prefix = |i| match arch {
        "gpt2" => format!("transformer.h.{i}."),
        _ => format!("model.layers.{i}."),
    };
    let mut a = Adapters::default();
    for i in 0..layers {
        for m in modules {
            let spec = AdapterSpec {
                r: 2,
                scale: 1.5,
                dropout,
                init_a: Init::Normal { std: 0.3 },
            };
            a.insert(format!("{}{m}", prefix(i)), spec);
        }
    }
    a
}

fn gpt2_cfg(dropout: f32) -> Gpt2Config {
    let mut c = Gpt2Config::preset("tiny").unwrap();
    (c.n_layer, c.n_head, c.n_embd, c.vocab_size, c.n_positions) = (1, 3, 15, 37, 11);
    (c.resid_pdrop, c.embd_pdrop, c.attn_pdrop) = (dropout, dropout, dropout);
    c
}

fn llama_cfg() -> LlamaConfig {
    let mut c = LlamaConfig::preset("tiny").unwrap();
    (c.hidden_size, c.intermediate_size, c.num_hidden_layers) = (18, 37, 1);
    (c.num_attention_heads, c.num_key_value_heads, c.vocab_size) = (3, Some(1), 29);
    c
}

/// Every unit of `model` (whose blocks carry adapters) against finite differences on `d`,
/// every parameter probed; the weights spread so every path, the adapters' B included (zero
/// as PEFT starts it), carries signal.
fn check_units(d: &Dev, model: &Model, width: usize, vocab: usize) {
    let b = batch(2, 7, vocab, 5);
    let mut w = Weights::init(model, 5);
    for v in w.units.iter_mut().flatten().chain(w.shared.iter_mut()) {
        for (i, x) in v.iter_mut().enumerate() {
            *x += 0.3 * (backend::rng::uniform_f32(99, i as u64) - 0.5);
        }
    }
    for (u, unit) in model.units.iter().enumerate() {
        let input = match u {
            0 => Tensor::default(),
            _ => random(vec![2, 7, width], 5 + u as u64),
        };
        let mut params = w.unit_vecs(model, u);
        let opts = Options {
            max_per_tensor: 40,
            ..Options::default()
        };
        let module = unit.module.as_ref();
        let report = gradcheck::check_on(&*d.be, module, &b, &mut params, &input, &opts).unwrap();
        assert!(report.passed(), "{}: unit {}:\n{report}", d.name, unit.name);
        assert!(report.tensors.iter().all(|t| t.checked > 0));
    }
}

/// GPT-2 (Conv1D layers, the GELU fused around the MLP's products) and Llama (GQA, SwiGLU)
/// with adapters on every linear layer of their blocks: every unit's gradients, the
/// adapters' included, against finite differences, with and without adapter dropout.
fn adapted_models_match_finite_differences(d: &Dev) {
    if d.act() != DType::F32 {
        return;
    }
    for dropout in [0.0, 0.2] {
        let cfg = gpt2_cfg(dropout);
        let model = gpt2::build_with(&cfg, &all_linear("gpt2", 1, dropout)).unwrap();
        let lora = model.units[1].module.param_specs();
        assert_eq!(lora.iter().filter(|s| s.name.contains(".lora_")).count(), 8);
        check_units(d, &model, cfg.n_embd, cfg.vocab_size);
        let cfg = llama_cfg();
        let model = llama::build_with(&cfg, &all_linear("llama", 1, dropout)).unwrap();
        check_units(d, &model, cfg.hidden_size, cfg.vocab_size);
    }
}
test_device!(adapted_models_match_finite_differences);

/// An adapter as PEFT starts it (B zero) changes no output: the adapted model's loss is the
/// base model's, bit for bit; and an adapter for a layer the model lacks is refused by name.
#[test]
fn a_fresh_adapter_is_the_identity_and_a_stray_one_is_refused() {
    let cfg = gpt2_cfg(0.0);
    let base = gpt2::build(&cfg).unwrap();
    let adapted = gpt2::build_with(&cfg, &all_linear("gpt2", 1, 0.0)).unwrap();
    let b = batch(2, 7, cfg.vocab_size, 3);
    let wb = Weights::init(&base, 3);
    let mut wa = Weights::init(&adapted, 3);
    // The same base weights; A random, B zero (the initialisers').
    for (u, unit) in adapted.units.iter().enumerate() {
        let specs = unit.module.param_specs();
        let base_specs = base.units[u].module.param_specs();
        for (i, s) in specs.iter().enumerate() {
            if let Some(j) = base_specs.iter().position(|t| t.name == s.name) {
                wa.units[u][i] = wb.units[u][j].clone();
            }
        }
    }
    wa.shared = wb.shared.clone();
    let lb = nn_common::step(&base, &wb, &b, 1, 1.0).unwrap().loss;
    let la = nn_common::step(&adapted, &wa, &b, 1, 1.0).unwrap().loss;
    assert_eq!(lb.to_bits(), la.to_bits(), "base {lb}, adapted {la}");
    let mut stray = Adapters::default();
    let spec = AdapterSpec {
        r: 2,
        scale: 1.0,
        dropout: 0.0,
        init_a: Init::Zeros,
    };
    stray.insert("transformer.h.0.attn.q_proj", spec);
    let e = match gpt2::build_with(&cfg, &stray) {
        Ok(_) => panic!("an adapter for a missing layer was accepted"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("transformer.h.0.attn.q_proj"), "{e}");
}
