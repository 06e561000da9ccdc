//! Writing what PEFT reads back: an `adapter_config.json` for `PeftModel.from_pretrained`, and
//! adapters merged into their base weights as `merge_and_unload()` does.

use std::path::Path;

use serde_json::{json, Map, Value};

use super::adapter::{LoraFactors, ADAPTER_CONFIG_FILE};
use super::config::{LoraConfig, LoraInit, TargetModules};
use super::target::Adapter;
use crate::nn::weights::file_err;
use crate::Result;

fn targets_json(t: &TargetModules) -> Value {
    match t {
        TargetModules::Names(n) => json!(n),
        TargetModules::Regex(r) => json!(r),
        TargetModules::AllLinear => json!("all-linear"),
    }
}

impl LoraConfig {
    /// The config as PEFT writes it (the keys ferrozero implements; PEFT fills in the rest
    /// with its defaults, which are the features ferrozero refuses switched off). `conv1d`
    /// says the adapted layers store their weight `[in, out]` (GPT-2), which PEFT records as
    /// `fan_in_fan_out`.
    pub fn to_json(&self, conv1d: bool) -> Value {
        let patterns =
            |p: &[(String, Value)]| Value::Object(p.iter().cloned().collect::<Map<_, _>>());
        let ranks: Vec<(String, Value)> = self
            .rank_pattern
            .iter()
            .map(|(k, v)| (k.clone(), json!(v)))
            .collect();
        let alphas: Vec<(String, Value)> = self
            .alpha_pattern
            .iter()
            .map(|(k, v)| (k.clone(), json!(v)))
            .collect();
        json!({
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": self.base_model,
            "r": self.r,
            "lora_alpha": self.alpha,
            "target_modules": targets_json(&self.targets),
            "exclude_modules": self.exclude.as_ref().map(targets_json),
            "lora_dropout": self.dropout,
            "use_rslora": self.use_rslora,
            "layers_to_transform": self.layers_to_transform,
            "layers_pattern": (!self.layers_pattern.is_empty()).then_some(&self.layers_pattern),
            "rank_pattern": patterns(&ranks),
            "alpha_pattern": patterns(&alphas),
            "modules_to_save": (!self.modules_to_save.is_empty()).then_some(&self.modules_to_save),
            "init_lora_weights": match self.init { LoraInit::Kaiming => json!(true), LoraInit::Gaussian => json!("gaussian") },
            "fan_in_fan_out": conv1d,
            "bias": "none",
            "inference_mode": true,
        })
    }

    /// Writes [`LoraConfig::to_json`] as `dir`'s `adapter_config.json`.
    pub fn write(&self, dir: &Path, conv1d: bool) -> Result<()> {
        let path = dir.join(ADAPTER_CONFIG_FILE);
        let text = serde_json::to_string_pretty(&self.to_json(conv1d)).expect("JSON values print");
        std::fs::write(&path, text + "\n").map_err(|e| file_err(&path, e))
    }
}

/// Adds `scaling * B A` to the base weight `w` of `adapter`'s layer, in place: `w` is
/// `[out, in]`, or `[in, out]` when `conv1d` (GPT-2's layout). The product is formed first and
/// scaled after, in f32, as PEFT's `get_delta_weight` does.
pub fn merge_into(w: &mut [f32], conv1d: bool, adapter: &Adapter, f: &LoraFactors) {
    let (r, n_in, n_out) = (
        adapter.r,
        adapter.site.in_features,
        adapter.site.out_features,
    );
    assert_eq!(
        w.len(),
        n_in * n_out,
        "merge: weight of {}",
        adapter.site.name
    );
    for o in 0..n_out {
        for i in 0..n_in {
            let mut d = 0.0f32;
            for k in 0..r {
                d += f.b[o * r + k] * f.a[k * n_in + i];
            }
            let at = if conv1d { i * n_out + o } else { o * n_in + i };
            w[at] += d * adapter.scaling;
        }
    }
}
