//! safetensors I/O: bit-identical round trips, Hugging Face names and layouts, clear errors.

mod nn_common;

use std::path::PathBuf;

use ferrozero_runtime::nn::gpt2::{self, Gpt2Config};
use ferrozero_runtime::nn::llama::{self, LlamaConfig};
use ferrozero_runtime::nn::weights::{self, Naming};
use ferrozero_runtime::nn::Model;
use ferrozero_runtime::tensor::DType;
use nn_common::Weights;

/// A per-test scratch directory, removed when the guard drops (tests run in parallel).
struct Scratch(PathBuf);

impl Scratch {
    fn new(test: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("fz-nn-weights-{}-{test}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }
    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn save_model(
    path: &std::path::Path,
    model: &ferrozero_runtime::nn::Model,
    w: &Weights,
    dtype: DType,
) {
    let specs: Vec<_> = model
        .units
        .iter()
        .flat_map(|u| u.module.param_specs())
        .chain(model.shared.clone())
        .collect();
    let named = w.named(model);
    let list: Vec<(&str, &[usize], &[f32])> = specs
        .iter()
        .zip(&named)
        .map(|(s, (_, d))| (s.name.as_str(), s.shape.as_slice(), *d))
        .collect();
    weights::save(path, &list, dtype).unwrap();
}

#[test]
fn f32_round_trip_is_bit_identical_for_both_families() {
    let dir = Scratch::new("f32_round_trip_is_bit_identical_for_both_families");
    let gpt = gpt2::build(&Gpt2Config::preset("tiny").unwrap()).unwrap();
    let lla = llama::build(&LlamaConfig::preset("tiny").unwrap()).unwrap();
    for (i, model) in [gpt, lla].iter().enumerate() {
        let w = Weights::init(model, 11);
        let path = dir.path(&format!("model{i}.safetensors"));
        save_model(&path, model, &w, DType::F32);
        let loaded = weights::load(&path, Naming::Exact).unwrap();
        for (name, data) in w.named(model) {
            let t = loaded.iter().find(|t| t.name == name).unwrap();
            let same = t
                .data
                .iter()
                .zip(data)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(
                same && t.data.len() == data.len(),
                "{name} differs after reload"
            );
        }
    }
}

#[test]
fn half_precision_files_reload_and_resave_identically() {
    let dir = Scratch::new("half_precision_files_reload_and_resave_identically");
    let data: Vec<f32> = (0..1001).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
    for dtype in [DType::Bf16, DType::F16] {
        let (a, b) = (dir.path("h1.safetensors"), dir.path("h2.safetensors"));
        weights::save(&a, &[("x", &[7, 11, 13], &data)], dtype).unwrap();
        let first = weights::load(&a, Naming::Exact).unwrap();
        assert_eq!(first[0].shape, vec![7, 11, 13]);
        let max_err = first[0]
            .data
            .iter()
            .zip(&data)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        assert!(max_err < 3.0 / 128.0, "{dtype:?} rounding error {max_err}");
        weights::save(&b, &[("x", &[7, 11, 13], &first[0].data)], dtype).unwrap();
        assert_eq!(
            std::fs::read(&a).unwrap(),
            std::fs::read(&b).unwrap(),
            "{dtype:?} re-save"
        );
    }
}

/// The shape of the units' parameter `name` in `model`.
fn unit_shape(model: &Model, name: &str) -> Vec<usize> {
    let specs = model.units.iter().flat_map(|u| u.module.param_specs());
    let mut found = specs.filter(|s| s.name == name);
    found.next().unwrap_or_else(|| panic!("{name}")).shape
}

#[test]
fn hugging_face_names_and_layouts() {
    let gpt = gpt2::build(&Gpt2Config::preset("tiny").unwrap()).unwrap();
    let find = |n: &str| unit_shape(&gpt, n);
    // GPT-2's Conv1D stores [in, out].
    assert_eq!(find("transformer.h.0.attn.c_attn.weight"), vec![16, 48]);
    assert_eq!(find("transformer.h.1.mlp.c_proj.weight"), vec![64, 16]);
    assert_eq!(gpt.shared[0].name, "transformer.wte.weight");
    let lla = llama::build(&LlamaConfig::preset("tiny").unwrap()).unwrap();
    let find = |n: &str| unit_shape(&lla, n);
    // nn.Linear stores [out, in]; tiny has 4 query heads and 2 kv heads of width 8.
    assert_eq!(find("model.layers.0.self_attn.k_proj.weight"), vec![16, 32]);
    assert_eq!(find("model.layers.1.mlp.down_proj.weight"), vec![32, 64]);
    assert_eq!(find("lm_head.weight"), vec![64, 32]);
    assert_eq!(
        gpt2::build(&Gpt2Config::preset("gpt2-124m").unwrap())
            .unwrap()
            .num_params(),
        124_439_808
    );
}

#[test]
fn gpt2_names_without_prefix_are_accepted_and_extras_ignored() {
    let dir = Scratch::new("gpt2_names_without_prefix_are_accepted_and_extras_ignored");
    let path = dir.path("legacy.safetensors");
    let w = [1.0f32, 2.0, 3.0, 4.0];
    weights::save(
        &path,
        &[
            ("h.0.ln_1.weight", &[4], &w),
            ("h.0.attn.bias", &[2, 2], &w),
            ("wte.weight", &[2, 2], &w),
        ],
        DType::F32,
    )
    .unwrap();
    let loaded = weights::load(&path, Naming::Gpt2).unwrap();
    assert!(loaded
        .iter()
        .any(|t| t.name == "transformer.h.0.ln_1.weight"));
    let picked = weights::select(
        &path,
        loaded,
        &[
            ("transformer.wte.weight", &[2, 2]),
            ("transformer.h.0.ln_1.weight", &[4]),
        ],
    )
    .unwrap();
    assert_eq!(picked, vec![w.to_vec(), w.to_vec()]);
}

#[test]
fn bad_files_and_lists_give_clear_errors() {
    let dir = Scratch::new("bad_files_and_lists_give_clear_errors");
    let path = dir.path("bad.safetensors");
    let e = weights::save(&path, &[("a", &[3], &[1.0, 2.0])], DType::F32).unwrap_err();
    assert!(e.to_string().contains("3 elements"), "{e}");
    let e = weights::save(
        &path,
        &[("a", &[1], &[1.0]), ("a", &[1], &[2.0])],
        DType::F32,
    )
    .unwrap_err();
    assert!(e.to_string().contains("twice"), "{e}");
    weights::save(&path, &[("a", &[2], &[1.0, 2.0])], DType::F32).unwrap();
    let loaded = weights::load(&path, Naming::Exact).unwrap();
    let e = weights::select(&path, loaded.clone(), &[("a", &[1, 2]), ("b", &[1])]).unwrap_err();
    assert!(e.to_string().contains("missing tensors: b"), "{e}");
    let e = weights::select(&path, loaded, &[("a", &[1, 2])]).unwrap_err();
    assert!(e.to_string().contains("has shape [2]"), "{e}");
    std::fs::write(&path, b"not a safetensors file").unwrap();
    assert!(weights::load(&path, Naming::Exact).is_err());
    assert!(weights::load(&dir.path("absent.safetensors"), Naming::Exact).is_err());
}
