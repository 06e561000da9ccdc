//! A LoRA run from end to end: the adapter a user names (a PEFT config, or a PEFT adapter
//! directory to start from) applied to a Hugging Face model, the starting values, and the
//! trained adapter written back as a PEFT directory or merged into the base model.

use std::path::Path;

use super::adapter::{AdapterWeights, LoraFactors, PeftSource};
use super::config::LoraConfig;
use super::target::Adapter;
use crate::nn::hf::{HfModel, ModelConfig};
use crate::nn::weights::NamedTensor;
use crate::nn::Model;
use crate::tensor::DType;
use crate::{Error, Result};

/// Whether `name` is a LoRA factor (`….lora_A.weight` or `….lora_B.weight`).
pub fn is_adapter_param(name: &str) -> bool {
    name.ends_with(".lora_A.weight") || name.ends_with(".lora_B.weight")
}

/// A LoRA adapter on one base model.
#[derive(Debug, Clone)]
pub struct PeftRun {
    /// The adapter's config.
    pub config: LoraConfig,
    /// The adapters it puts on the base model's linear layers.
    pub adapters: Vec<Adapter>,
    /// The weights to start from, when a PEFT directory was named.
    pub start: Option<AdapterWeights>,
    /// The base model's architecture and sizes.
    pub base: HfModel,
}

impl PeftRun {
    /// Opens `path` (an `adapter_config.json`, or a PEFT adapter directory) for `base`: every
    /// adapter and saved module checked against the base model's layers and shapes.
    pub fn open(path: &Path, base: &HfModel) -> Result<Self> {
        let src = PeftSource::open(path)?;
        let mut run = Self::new(src.config, base)?;
        if let Some(file) = &src.weights {
            let saved = saved_shapes(&run.config, &base.build()?);
            let refs: Vec<(&str, &[usize])> = (saved.iter())
                .map(|(n, s)| (n.as_str(), s.as_slice()))
                .collect();
            run.start = Some(AdapterWeights::read(file, &run.adapters, &refs)?);
        }
        Ok(run)
    }

    /// New adapters of `config` on `base` (no weights to start from).
    pub fn new(config: LoraConfig, base: &HfModel) -> Result<Self> {
        let arch = base.architecture.class_name();
        let adapters = config.adapters(&base.linear_sites(), arch)?;
        Ok(Self {
            config,
            adapters,
            start: None,
            base: base.clone(),
        })
    }

    /// The adapter's config as PEFT writes it (what a checkpoint carries beside the base
    /// model's `config.json`, so it can be exported again).
    pub fn config_json(&self) -> String {
        let v = self.config.to_json(self.conv1d());
        serde_json::to_string_pretty(&v).unwrap_or_else(|_| v.to_string()) + "\n"
    }

    /// Whether the adapted layers store their weights `[in, out]` (GPT-2's `Conv1D`).
    pub fn conv1d(&self) -> bool {
        matches!(self.base.config, ModelConfig::Gpt2(_))
    }

    /// The model with its adapters, every parameter frozen but theirs and `modules_to_save`.
    pub fn build(&self) -> Result<Model> {
        self.base.build_lora(&self.config)
    }

    /// The values a directory's adapter starts from (empty for new adapters, which keep the
    /// initialisation PEFT gives them).
    pub fn start_values(&self) -> Vec<NamedTensor> {
        self.start
            .as_ref()
            .map_or_else(Vec::new, |w| w.named(&self.adapters))
    }

    /// The adapter weights among `params` (the trained model's, by name): each adapter's
    /// factors and the `modules_to_save` tensors.
    pub fn weights_of(&self, params: &[NamedTensor]) -> Result<AdapterWeights> {
        let find = |n: &str| {
            params.iter().find(|t| t.name == n).ok_or_else(|| {
                Error::Invalid(format!(
                    "the trained model has no parameter `{n}` to export"
                ))
            })
        };
        let mut out = AdapterWeights::default();
        for ad in &self.adapters {
            let m = &ad.site.name;
            let a = find(&format!("{m}.lora_A.weight"))?.data.clone();
            let b = find(&format!("{m}.lora_B.weight"))?.data.clone();
            out.lora.insert(m.clone(), LoraFactors { a, b });
        }
        for t in params.iter().filter(|t| self.config.saves(&t.name)) {
            out.saved.insert(t.name.clone(), t.clone());
        }
        Ok(out)
    }

    /// Writes a PEFT adapter directory `dir` (`adapter_config.json` and
    /// `adapter_model.safetensors` in `dtype`) from the trained `params`, which
    /// `PeftModel.from_pretrained(base, dir)` loads.
    pub fn write(&self, dir: &Path, params: &[NamedTensor], dtype: DType) -> Result<()> {
        let weights = self.weights_of(params)?;
        std::fs::create_dir_all(dir).map_err(|e| crate::nn::weights::file_err(dir, e))?;
        self.config.write(dir, self.conv1d())?;
        weights.write(dir, &self.adapters, dtype)
    }

    /// The base model's parameters with every adapter merged in (PEFT's `merge_and_unload`)
    /// and the adapters' factors dropped: a plain model `from_pretrained` loads.
    pub fn merged(&self, mut params: Vec<NamedTensor>) -> Result<Vec<NamedTensor>> {
        let weights = self.weights_of(&params)?;
        for ad in &self.adapters {
            let name = format!("{}.weight", ad.site.name);
            let w = params.iter_mut().find(|t| t.name == name).ok_or_else(|| {
                Error::Invalid(format!(
                    "the model has no base weight `{name}` to merge into"
                ))
            })?;
            let f = &weights.lora[&ad.site.name];
            let (n, r) = (ad.site.in_features * ad.site.out_features, ad.r);
            let sizes = (f.a.len(), f.b.len());
            if w.data.len() != n || sizes != (r * ad.site.in_features, ad.site.out_features * r) {
                return Err(Error::Invalid(format!(
                    "merge into `{name}`: {} elements and factors of {sizes:?} for a rank-{r} \
                     adapter on {} -> {}",
                    w.data.len(),
                    ad.site.in_features,
                    ad.site.out_features
                )));
            }
            super::write::merge_into(&mut w.data, self.conv1d(), ad, f);
        }
        params.retain(|t| !is_adapter_param(&t.name));
        Ok(params)
    }
}

/// The base model's parameters `cfg` trains in full (`modules_to_save`), with their shapes.
fn saved_shapes(cfg: &LoraConfig, base: &Model) -> Vec<(String, Vec<usize>)> {
    let own = base.units.iter().flat_map(|u| u.module.param_specs());
    own.chain(base.shared.iter().cloned())
        .filter(|p| cfg.saves(&p.name))
        .map(|p| (p.name, p.shape))
        .collect()
}
