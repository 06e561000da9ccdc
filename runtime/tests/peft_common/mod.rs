//! Helpers shared by the `peft_*` tests: the fixtures PEFT wrote (`fixtures/peft/`) and the
//! base models they adapt (`fixtures/hf/`).
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use ferrozero_runtime::nn::peft::{LinearSite, LoraConfig};
use safetensors::SafeTensors;

/// The test fixtures folder.
pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// Every tensor's shape in a safetensors file, by name.
pub fn shapes(path: &Path) -> BTreeMap<String, Vec<usize>> {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(n, t)| (n, t.shape().to_vec()))
        .collect()
}

/// The base model's linear layers, from its weights: GPT-2's blocks hold Conv1D weights
/// (`[in, out]`), Llama's `nn.Linear` weights (`[out, in]`); embeddings are not linear layers.
pub fn sites(arch: &str) -> Vec<LinearSite> {
    let base = shapes(&fixtures().join(format!("hf/{arch}/parity.safetensors")));
    base.iter()
        .filter(|(n, s)| {
            s.len() == 2
                && n.ends_with(".weight")
                && !n.contains("embed")
                && !n.contains(".wte")
                && !n.contains(".wpe")
        })
        .map(|(n, s)| {
            let (in_features, out_features) = if arch == "gpt2" {
                (s[0], s[1])
            } else {
                (s[1], s[0])
            };
            LinearSite {
                name: n.trim_end_matches(".weight").to_string(),
                in_features,
                out_features,
                output_head: n.starts_with("lm_head"),
            }
        })
        .collect()
}

/// (module, r) of every adapter PEFT wrote, and the names of the tensors it saved in full.
pub fn written(arch: &str) -> (BTreeMap<String, usize>, Vec<String>) {
    let st = shapes(&fixtures().join(format!("peft/{arch}/start/adapter_model.safetensors")));
    let mut ranks = BTreeMap::new();
    let mut saved = Vec::new();
    for (name, shape) in st {
        let name = name.strip_prefix("base_model.model.").unwrap().to_string();
        match name.strip_suffix(".lora_A.weight") {
            Some(module) => {
                ranks.insert(module.to_string(), shape[0]);
            }
            None if name.contains(".lora_B.") => {}
            None => saved.push(name),
        }
    }
    (ranks, saved)
}

/// The config PEFT wrote for `arch`'s starting adapter.
pub fn read(arch: &str) -> LoraConfig {
    LoraConfig::from_file(&fixtures().join(format!("peft/{arch}/start/adapter_config.json")))
        .unwrap()
}

/// The base model's parameters `cfg` trains in full (`modules_to_save`), with their shapes.
pub fn saved_params(arch: &str, cfg: &LoraConfig) -> Vec<(String, Vec<usize>)> {
    shapes(&fixtures().join(format!("hf/{arch}/parity.safetensors")))
        .into_iter()
        .filter(|(n, _)| cfg.saves(n))
        .collect()
}

/// Every tensor of a safetensors file as f32, by name.
pub fn tensors(path: &Path) -> BTreeMap<String, Vec<f32>> {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(n, t)| {
            assert_eq!(t.dtype(), safetensors::Dtype::F32, "{n}");
            let v = t
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            (n, v)
        })
        .collect()
}
