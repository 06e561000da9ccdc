//! A Hugging Face model directory in and out, as `ferrozero train` needs it: `config.json`
//! and `model.safetensors` in; the trained weights, the config and the tokenizer files out.

use std::path::{Path, PathBuf};

use super::model::ModelSpec;
use crate::data::file_err;
use crate::engine::NamedTensor;
use ferrozero_runtime::nn::weights::{self, Naming};
use ferrozero_runtime::nn::Model;
use ferrozero_runtime::tensor::DType;
use ferrozero_runtime::Result;

/// Files that travel with the weights when a run writes its output directory.
const COMPANIONS: [&str; 6] = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "merges.txt",
];

/// A model directory read for training.
pub struct ModelDir {
    /// The directory.
    pub dir: PathBuf,
    /// The architecture and its sizes, from `config.json`.
    pub spec: ModelSpec,
    /// Every parameter the model declares, from `model.safetensors`.
    pub init: Vec<NamedTensor>,
    /// `eos_token_id` of `config.json` (the first, when it lists several).
    pub eos: Option<u32>,
}

impl ModelDir {
    /// `tokenizer.json` of the directory.
    pub fn tokenizer(&self) -> PathBuf {
        self.dir.join("tokenizer.json")
    }
}

fn param_names(model: &Model) -> Vec<(String, Vec<usize>)> {
    model
        .units
        .iter()
        .flat_map(|u| u.module.param_specs())
        .chain(model.shared.iter().cloned())
        .map(|p| (p.name, p.shape))
        .collect()
}

/// Reads `dir/config.json` and `dir/model.safetensors`: every parameter of the model must be
/// there with its shape (extra tensors are ignored).
pub fn load_model(dir: &Path) -> Result<ModelDir> {
    let config = dir.join("config.json");
    if !dir.is_dir() {
        return Err(file_err(
            dir,
            "not a model directory (config.json + model.safetensors)",
        ));
    }
    if !config.is_file() {
        return Err(file_err(
            &config,
            "missing: a model directory needs config.json",
        ));
    }
    let spec = ModelSpec::parse(&config.to_string_lossy()).map_err(|e| file_err(&config, e))?;
    let text = std::fs::read_to_string(&config).map_err(|e| file_err(&config, e))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| file_err(&config, e))?;
    let eos = match v.get("eos_token_id") {
        Some(serde_json::Value::Array(a)) => a.first().and_then(|x| x.as_u64()),
        Some(x) => x.as_u64(),
        None => None,
    }
    .map(|x| x as u32);
    let weights_path = dir.join("model.safetensors");
    if !weights_path.is_file() {
        return Err(file_err(
            &weights_path,
            "missing: a model directory needs model.safetensors",
        ));
    }
    let naming = match spec {
        ModelSpec::Gpt2(_) => Naming::Gpt2,
        ModelSpec::Llama(_) => Naming::Exact,
    };
    let expected = param_names(&spec.build()?);
    let refs: Vec<(&str, &[usize])> = expected
        .iter()
        .map(|(n, s)| (n.as_str(), s.as_slice()))
        .collect();
    let values = weights::select(&weights_path, weights::load(&weights_path, naming)?, &refs)?;
    let init = expected
        .into_iter()
        .zip(values)
        .map(|((name, shape), data)| NamedTensor { name, shape, data })
        .collect();
    Ok(ModelDir {
        dir: dir.to_path_buf(),
        spec,
        init,
        eos,
    })
}

/// Writes a model directory: `model.safetensors` (f32) from `params`, and the config and
/// tokenizer files of `source` that exist.
pub fn write_output(out: &Path, source: &Path, params: &[NamedTensor]) -> Result<()> {
    std::fs::create_dir_all(out).map_err(|e| file_err(out, e))?;
    let tensors: Vec<(&str, &[usize], &[f32])> = params
        .iter()
        .map(|t| (t.name.as_str(), t.shape.as_slice(), t.data.as_slice()))
        .collect();
    weights::save(&out.join("model.safetensors"), &tensors, DType::F32)?;
    for name in COMPANIONS {
        let from = source.join(name);
        if from.is_file() && source != out {
            std::fs::copy(&from, out.join(name)).map_err(|e| file_err(&from, e))?;
        }
    }
    Ok(())
}
