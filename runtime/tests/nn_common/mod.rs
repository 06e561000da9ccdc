//! Helpers shared by the `nn_*` integration tests: engine-like ownership of a model's
//! parameters and a plain forward/backward driver over its units.
#![allow(dead_code)]

use ferrozero_runtime::backend::Backend;
use ferrozero_runtime::nn::weights::{NamedTensor, Naming};
use ferrozero_runtime::nn::{
    init, Batch, BatchIds, Ctx, Grads, Model, Params, Saved, IGNORE_INDEX,
};
use ferrozero_runtime::tensor::{DType, FlatBuf, Storage, Tensor};
use ferrozero_runtime::Result;

/// The safetensors fixture `tests/fixtures/<file>`, every tensor under its exact name.
pub fn fixture(file: &str) -> Vec<NamedTensor> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    ferrozero_runtime::nn::weights::load(&path.join(file), Naming::Exact).expect("fixture loads")
}

/// The fixture's tensor `name`.
pub fn get<'a>(f: &'a [NamedTensor], name: &str) -> &'a [f32] {
    let t = f.iter().find(|t| t.name == name);
    &t.unwrap_or_else(|| panic!("fixture lacks {name}")).data
}

/// `got` is `want` within `tol` of `want`'s largest magnitude (at least 1e-3).
pub fn assert_close(name: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{name}: length");
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-3);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * scale,
            "{name}[{i}]: got {g}, want {w} (scale {scale})"
        );
    }
}

/// One training step of `model` on the fixture's weights and batch: the loss is PyTorch's
/// `golden.loss` within 1e-4 relative, every gradient its `grad.<name>` within 2e-4.
pub fn assert_golden_step(model: &Model, w: &Weights, batch: &Batch, f: &[NamedTensor]) {
    let out = step(model, w, batch, 0, 1.0).expect("step runs");
    let want = get(f, "golden.loss")[0];
    assert!(
        (out.loss - want).abs() <= 1e-4 * want.abs(),
        "loss {} vs {want}",
        out.loss
    );
    for (name, g) in out.grads.named(model) {
        assert_close(&name, g, get(f, &format!("grad.{name}")), 2e-4);
    }
}

/// `model`'s weights and a batch of `(rows, seq)` tokens from a PyTorch fixture `f`: every
/// parameter by its Hugging Face name (the shared ones too) and `golden.tokens`/`golden.targets`.
pub fn golden(model: &Model, f: &[NamedTensor], (rows, seq): (usize, usize)) -> (Weights, Batch) {
    let get = |name: &str| get(f, name);
    let mut w = Weights::zeros(model);
    for (u, unit) in model.units.iter().enumerate() {
        for (i, spec) in unit.module.param_specs().iter().enumerate() {
            w.units[u][i].copy_from_slice(get(&spec.name));
        }
    }
    for (i, spec) in model.shared.iter().enumerate() {
        w.shared[i].copy_from_slice(get(&spec.name));
    }
    let batch = Batch {
        batch: rows,
        seq,
        tokens: get("golden.tokens").iter().map(|&v| v as u32).collect(),
        targets: get("golden.targets").iter().map(|&v| v as i32).collect(),
    };
    (w, batch)
}

/// Flat per-parameter buffers, as the engine would own them.
#[derive(Debug, Clone, PartialEq)]
pub struct Weights {
    /// Per unit, per own parameter.
    pub units: Vec<Vec<Vec<f32>>>,
    /// Shared parameters.
    pub shared: Vec<Vec<f32>>,
}

impl Weights {
    /// Zero-filled buffers matching `model`.
    pub fn zeros(model: &Model) -> Self {
        let units = model
            .units
            .iter()
            .map(|u| {
                u.module
                    .param_specs()
                    .iter()
                    .map(|s| vec![0.0; s.numel()])
                    .collect()
            })
            .collect();
        let shared = model.shared.iter().map(|s| vec![0.0; s.numel()]).collect();
        Self { units, shared }
    }

    /// Deterministic initialisation from `seed`, as the engine does it.
    pub fn init(model: &Model, seed: u64) -> Self {
        let mut w = Self::zeros(model);
        for (u, unit) in model.units.iter().enumerate() {
            for (i, spec) in unit.module.param_specs().iter().enumerate() {
                init::fill(
                    &spec.init,
                    init::param_seed(seed, &spec.name),
                    &mut w.units[u][i],
                );
            }
        }
        for (i, spec) in model.shared.iter().enumerate() {
            init::fill(
                &spec.init,
                init::param_seed(seed, &spec.name),
                &mut w.shared[i],
            );
        }
        w
    }

    /// Every (name, buffer) pair: units in order, then shared.
    pub fn named<'a>(&'a self, model: &Model) -> Vec<(String, &'a [f32])> {
        let mut out = Vec::new();
        for (u, unit) in model.units.iter().enumerate() {
            for (i, spec) in unit.module.param_specs().iter().enumerate() {
                out.push((spec.name.clone(), self.units[u][i].as_slice()));
            }
        }
        for (i, spec) in model.shared.iter().enumerate() {
            out.push((spec.name.clone(), self.shared[i].as_slice()));
        }
        out
    }

    /// Unit `u`'s parameters followed by the shared ones it uses (the `Params` order).
    pub fn unit_vecs(&self, model: &Model, u: usize) -> Vec<Vec<f32>> {
        let mut v = self.units[u].clone();
        v.extend(
            model.units[u]
                .uses_shared
                .iter()
                .map(|&s| self.shared[s].clone()),
        );
        v
    }
}

/// Result of one micro-step.
#[derive(Debug)]
pub struct Step {
    /// Summed loss.
    pub loss: f32,
    /// Gradients of the loss sum.
    pub grads: Weights,
    /// Saved bytes per unit, as reported by the saved state.
    pub saved: Vec<usize>,
    /// Output bytes per unit.
    pub outputs: Vec<usize>,
}

/// Forward through every unit in training mode, then backward with d(obj)/d(loss) = `g`,
/// on the CPU.
pub fn step(model: &Model, w: &Weights, batch: &Batch, seed: u64, g: f32) -> Result<Step> {
    step_on(
        &*ferrozero_runtime::backend::cpu(),
        model,
        w,
        batch,
        seed,
        g,
    )
}

/// Unit `u`'s parameters (then the shared ones it uses) copied to `be`'s device in `dtype`
/// (rounded to nearest even when that is a half type).
pub fn upload_params(
    be: &dyn Backend,
    model: &Model,
    w: &Weights,
    u: usize,
    dtype: DType,
) -> Result<Vec<Storage>> {
    let shared = model.units[u].uses_shared.iter().map(|&s| &w.shared[s]);
    w.units[u]
        .iter()
        .chain(shared)
        .map(|p| {
            let mut b = FlatBuf::zeros(dtype, p.len());
            b.store_f32(0, p);
            be.upload(b.as_ref())
        })
        .collect()
}

/// [`step`] with the units computing on `be` (weights copied there in its activation dtype,
/// f32 gradients copied back).
pub fn step_on(
    be: &dyn Backend,
    model: &Model,
    w: &Weights,
    batch: &Batch,
    seed: u64,
    g: f32,
) -> Result<Step> {
    let n = model.units.len();
    let ids = BatchIds::new(be, batch)?;
    let mut slots: Vec<Saved> = (0..n).map(|_| None).collect();
    let mut x = Tensor::default();
    let mut outputs = Vec::new();
    for (u, unit) in model.units.iter().enumerate() {
        let stores = upload_params(be, model, w, u, be.act_dtype())?;
        let mut ctx = Ctx {
            be,
            batch,
            ids: &ids,
            training: true,
            rng_seed: seed + u as u64,
            rng_row: 0,
            saved: &mut slots[u],
        };
        x = unit.module.forward(
            &mut ctx,
            &Params::new(stores.iter().map(Storage::view).collect()),
            &x,
        )?;
        outputs.push(x.bytes());
    }
    let loss = x.to_vec_f32()?[0];
    let saved = slots
        .iter()
        .map(|s| s.as_ref().map_or(0, |s| s.bytes()))
        .collect();
    let mut grads = Weights::zeros(model);
    let mut gy = Tensor::scalar(g);
    for (u, unit) in model.units.iter().enumerate().rev() {
        let stores = upload_params(be, model, w, u, be.act_dtype())?;
        // Backward accumulates into what earlier units left (a shared parameter's gradient).
        let mut gstores = upload_params(be, model, &grads, u, DType::F32)?;
        let mut ctx = Ctx {
            be,
            batch,
            ids: &ids,
            training: true,
            rng_seed: seed + u as u64,
            rng_row: 0,
            saved: &mut slots[u],
        };
        gy = unit.module.backward(
            &mut ctx,
            &Params::new(stores.iter().map(Storage::view).collect()),
            &mut Grads::new(gstores.iter_mut().map(Storage::view_mut).collect()),
            &gy,
        )?;
        let own = grads.units[u].len();
        for (i, gs) in gstores.iter().enumerate() {
            let dst = if i < own {
                &mut grads.units[u][i]
            } else {
                &mut grads.shared[unit.uses_shared[i - own]]
            };
            *dst = gs.to_vec_f32()?;
        }
    }
    Ok(Step {
        loss,
        grads,
        saved,
        outputs,
    })
}

/// A deterministic batch with a few ignored targets.
pub fn batch(b: usize, t: usize, vocab: usize, seed: u64) -> Batch {
    let mut s = seed;
    let mut next = || {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (s >> 33) as usize
    };
    let tokens = (0..b * t).map(|_| (next() % vocab) as u32).collect();
    let targets = (0..b * t)
        .map(|i| {
            if i % 5 == 3 {
                IGNORE_INDEX
            } else {
                (next() % vocab) as i32
            }
        })
        .collect();
    Batch {
        batch: b,
        seq: t,
        tokens,
        targets,
    }
}

/// A random tensor (uniform in [-1, 1)) from a seed.
pub fn random(shape: Vec<usize>, seed: u64) -> Tensor {
    let n = shape.iter().product();
    let data = (0..n)
        .map(|i| ferrozero_runtime::backend::rng::uniform_f32(seed, i as u64) * 2.0 - 1.0)
        .collect();
    Tensor::from_f32(shape, data).expect("shape and data agree")
}
