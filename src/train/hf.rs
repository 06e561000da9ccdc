//! A Hugging Face model directory in and out, as `ferrozero train` needs it: `config.json`
//! (read by `nn::hf`) and the weights (mapped by `nn::weights`, one file or an index with its
//! shards) in; the trained weights, the config and the tokenizer files out.

use std::path::{Path, PathBuf};

use crate::data::file_err;
use crate::engine::NamedTensor;
use ferrozero_runtime::nn::hf::HfModel;
use ferrozero_runtime::nn::weights::{
    write_model_dir, ModelFiles, ModelWeights, ParamSource, DEFAULT_MAX_SHARD_BYTES,
};
use ferrozero_runtime::nn::Model;
use ferrozero_runtime::tensor::DType;
use ferrozero_runtime::Result;

/// A model directory opened for training: nothing of the weights is read yet beyond the
/// headers; each rank copies out its part when it loads them.
pub struct ModelDir {
    /// The directory.
    pub dir: PathBuf,
    /// The architecture and its sizes, from `config.json`.
    pub spec: HfModel,
    /// The weights, mapped and checked against the model's parameters.
    pub weights: ModelWeights,
    /// `config.json` and the tokenizer files, for checkpoints and the output directory.
    pub files: ModelFiles,
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

fn eos_of(config: &Path) -> Result<Option<u32>> {
    let text = std::fs::read_to_string(config).map_err(|e| file_err(config, e))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| file_err(config, e))?;
    Ok(match v.get("eos_token_id") {
        Some(serde_json::Value::Array(a)) => a.first().and_then(|x| x.as_u64()),
        Some(x) => x.as_u64(),
        None => None,
    }
    .map(|x| x as u32))
}

/// Opens `dir`: `config.json` and the weights (`model.safetensors`, or the index and its
/// shards); every parameter of the model must be there with its shape (extra tensors are
/// ignored).
pub fn load_model(dir: &Path) -> Result<ModelDir> {
    if !dir.is_dir() {
        return Err(file_err(
            dir,
            "not a model directory (config.json + model.safetensors or its index and shards)",
        ));
    }
    let config = dir.join("config.json");
    if !config.is_file() {
        return Err(file_err(
            &config,
            "missing: a model directory needs config.json",
        ));
    }
    let spec = HfModel::from_file(&config)?;
    let eos = eos_of(&config)?;
    let weights = ModelWeights::open(dir, spec.naming())?;
    let expected = param_names(&spec.build()?);
    let refs: Vec<(&str, &[usize])> = expected
        .iter()
        .map(|(n, s)| (n.as_str(), s.as_slice()))
        .collect();
    weights.check(&refs)?;
    Ok(ModelDir {
        dir: dir.to_path_buf(),
        spec,
        weights,
        files: ModelFiles::from_dir(dir)?,
        eos,
    })
}

/// Writes a model directory as `save_pretrained` does: the weights in f32 (one file, or
/// shards of at most 5 GB with an index) and `files` (the config and tokenizer files).
pub fn write_output(out: &Path, files: &ModelFiles, params: &[NamedTensor]) -> Result<()> {
    let tensors: Vec<(String, Vec<usize>)> = params
        .iter()
        .map(|t| (t.name.clone(), t.shape.clone()))
        .collect();
    let mut read = |i: usize| Ok(params[i].data.clone());
    write_model_dir(
        out,
        files,
        &tensors,
        DType::F32,
        DEFAULT_MAX_SHARD_BYTES,
        &mut read,
    )?;
    Ok(())
}
