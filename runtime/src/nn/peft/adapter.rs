//! A PEFT adapter directory's weights (`adapter_model.safetensors`): each adapter's `A` and
//! `B` and the tensors of `modules_to_save`, under PEFT's names, checked against the adapters
//! a config puts on the base model so a file for another model or rank fails by name.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::config::LoraConfig;
use super::target::Adapter;
use crate::nn::weights::{self, file_err, MappedFile, NamedTensor};
use crate::tensor::DType;
use crate::Result;

/// The config file of an adapter directory.
pub const ADAPTER_CONFIG_FILE: &str = "adapter_config.json";
/// The weights file of an adapter directory.
pub const ADAPTER_WEIGHTS_FILE: &str = "adapter_model.safetensors";
/// The prefix PEFT's saved names carry before the base model's own names.
const PREFIX: &str = "base_model.model.";

/// One adapter's factors, row-major: `a` is `[r, in]`, `b` is `[out, r]`.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraFactors {
    /// `lora_A.weight`.
    pub a: Vec<f32>,
    /// `lora_B.weight`.
    pub b: Vec<f32>,
}

/// An adapter directory's weights, by the base model's module and parameter names.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct AdapterWeights {
    /// Each adapted module's factors.
    pub lora: BTreeMap<String, LoraFactors>,
    /// `modules_to_save` tensors, by parameter name.
    pub saved: BTreeMap<String, NamedTensor>,
}

/// What `--peft PATH` names: a config alone (new adapters), or a directory holding a config
/// and the weights to start from.
#[derive(Debug, Clone)]
pub struct PeftSource {
    /// The adapter's config.
    pub config: LoraConfig,
    /// The weights file, when PATH is a directory.
    pub weights: Option<PathBuf>,
}

impl AdapterWeights {
    /// The weights under the names a model built with `adapters` gives its parameters:
    /// `{module}.lora_A.weight` `[r, in]` and `{module}.lora_B.weight` `[out, r]` for each
    /// adapter, then the `modules_to_save` tensors (what `Engine::set_parameters` takes).
    pub fn named(&self, adapters: &[Adapter]) -> Vec<NamedTensor> {
        let mut out = Vec::new();
        for ad in adapters {
            let Some(f) = self.lora.get(&ad.site.name) else {
                continue;
            };
            let (r, site) = (ad.r, &ad.site);
            for (which, shape, data) in [
                ("A", vec![r, site.in_features], &f.a),
                ("B", vec![site.out_features, r], &f.b),
            ] {
                out.push(NamedTensor {
                    name: format!("{}.lora_{which}.weight", site.name),
                    shape,
                    data: data.clone(),
                });
            }
        }
        out.extend(self.saved.values().cloned());
        out
    }
}

impl PeftSource {
    /// Opens `path`: an `adapter_config.json`, or a directory with one and its
    /// `adapter_model.safetensors` (a directory without the weights is an error: starting
    /// from fresh adapters is asked for by naming the config file).
    pub fn open(path: &Path) -> Result<Self> {
        if !path.is_dir() {
            return Ok(Self {
                config: LoraConfig::from_file(path)?,
                weights: None,
            });
        }
        let config = LoraConfig::from_file(&path.join(ADAPTER_CONFIG_FILE))?;
        let weights = path.join(ADAPTER_WEIGHTS_FILE);
        if !weights.is_file() {
            return Err(file_err(
                &weights,
                format!(
                    "missing: a PEFT adapter directory holds {ADAPTER_CONFIG_FILE} and \
                     {ADAPTER_WEIGHTS_FILE} (to start new adapters, pass the config file itself)"
                ),
            ));
        }
        Ok(Self {
            config,
            weights: Some(weights),
        })
    }
}

/// The expected shape of a tensor, or an error naming the file, the tensor and both shapes.
fn expect(path: &Path, file: &MappedFile, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
    let info = file.tensors().get(name).ok_or_else(|| {
        file_err(
            path,
            format!("has no tensor `{name}`, which this adapter config needs"),
        )
    })?;
    if info.shape != shape {
        return Err(file_err(
            path,
            format!(
                "tensor `{name}` has shape {:?}; the base model and adapter config need {shape:?}",
                info.shape
            ),
        ));
    }
    file.read(name, 0..info.numel())
}

impl AdapterWeights {
    /// Reads `path` for `adapters` and the `modules_to_save` parameters `saved` (name, shape).
    /// Every tensor in the file must be one of them: a tensor naming a module this model lacks
    /// means an adapter for another model.
    pub fn read(path: &Path, adapters: &[Adapter], saved: &[(&str, &[usize])]) -> Result<Self> {
        let file = MappedFile::open(path)?;
        let mut out = AdapterWeights::default();
        let mut used = std::collections::BTreeSet::new();
        for ad in adapters {
            let (m, s) = (&ad.site.name, &ad.site);
            let (an, bn) = (
                format!("{PREFIX}{m}.lora_A.weight"),
                format!("{PREFIX}{m}.lora_B.weight"),
            );
            let a = expect(path, &file, &an, &[ad.r, s.in_features])?;
            let b = expect(path, &file, &bn, &[s.out_features, ad.r])?;
            out.lora.insert(m.clone(), LoraFactors { a, b });
            used.extend([an, bn]);
        }
        for &(name, shape) in saved {
            let stored = format!("{PREFIX}{name}");
            let data = expect(path, &file, &stored, shape)?;
            let t = NamedTensor {
                name: name.to_string(),
                shape: shape.to_vec(),
                data,
            };
            out.saved.insert(name.to_string(), t);
            used.insert(stored);
        }
        if let Some(extra) = file.tensors().keys().find(|k| !used.contains(*k)) {
            return Err(file_err(
                path,
                format!(
                    "tensor `{extra}` is not an adapter of this base model under its adapter \
                     config (an adapter made for another model, or another `target_modules`?)"
                ),
            ));
        }
        Ok(out)
    }

    /// Writes the weights as PEFT names them, in `dtype`, to `dir`'s `adapter_model.safetensors`
    /// (`adapters` gives each module's shapes).
    pub fn write(&self, dir: &Path, adapters: &[Adapter], dtype: DType) -> Result<()> {
        let mut named: Vec<(String, Vec<usize>, &[f32])> = Vec::new();
        for ad in adapters {
            let m = &ad.site.name;
            let f = self.lora.get(m).ok_or_else(|| {
                file_err(
                    dir,
                    format!("no trained factors for adapter `{m}` to write"),
                )
            })?;
            let (r, s) = (ad.r, &ad.site);
            named.push((
                format!("{PREFIX}{m}.lora_A.weight"),
                vec![r, s.in_features],
                &f.a,
            ));
            named.push((
                format!("{PREFIX}{m}.lora_B.weight"),
                vec![s.out_features, r],
                &f.b,
            ));
        }
        for t in self.saved.values() {
            named.push((format!("{PREFIX}{}", t.name), t.shape.clone(), &t.data));
        }
        let views: Vec<(&str, &[usize], &[f32])> = named
            .iter()
            .map(|(n, s, d)| (n.as_str(), s.as_slice(), *d))
            .collect();
        weights::save(&dir.join(ADAPTER_WEIGHTS_FILE), &views, dtype)
    }
}
