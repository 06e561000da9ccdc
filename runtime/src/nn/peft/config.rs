//! PEFT's `adapter_config.json` for LoRA, read key by key: each key is read and checked,
//! accepted as bookkeeping, or refused with what ferrozero supports, so an adapter that
//! would compute something else never trains silently as plain LoRA.

use std::path::Path;

use serde_json::{Map, Value};

use super::reader::Reader;
use crate::{Error, Result};

/// Which linear layers get adapters (`target_modules`).
#[derive(Debug, Clone, PartialEq)]
pub enum TargetModules {
    /// Module names, each matching a module whose name is it or ends in `.` and it.
    Names(Vec<String>),
    /// A Python regular expression the whole module name must match.
    Regex(String),
    /// Every linear layer but the output head (`"all-linear"`).
    AllLinear,
}

/// How new adapters start (`init_lora_weights`); `B` is zero either way, so a new adapter
/// leaves the model's output unchanged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoraInit {
    /// `A` as `nn.Linear` initialises its weight: uniform in ±1/sqrt(fan_in) (`true`).
    Kaiming,
    /// `A` normal with standard deviation 1/r (`"gaussian"`).
    Gaussian,
}

/// A LoRA adapter's configuration, as PEFT's `LoraConfig` defines it.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraConfig {
    /// The file (or text) it was read from, for errors.
    pub origin: String,
    /// Rank of every adapter without a `rank_pattern` entry.
    pub r: usize,
    /// Scale numerator of every adapter without an `alpha_pattern` entry.
    pub alpha: f32,
    /// The layers adapted.
    pub targets: TargetModules,
    /// Layers never adapted (`exclude_modules`), matched as `targets` are.
    pub exclude: Option<TargetModules>,
    /// Dropout on the adapter's input (training only).
    pub dropout: f32,
    /// Scale `alpha / sqrt(r)` instead of `alpha / r`.
    pub use_rslora: bool,
    /// Only layers with these indices (`layers_to_transform`), when set.
    pub layers_to_transform: Option<Vec<usize>>,
    /// The module-list names whose index `layers_to_transform` reads (`layers_pattern`).
    pub layers_pattern: Vec<String>,
    /// Per-layer ranks: (pattern, rank), in the file's order.
    pub rank_pattern: Vec<(String, usize)>,
    /// Per-layer alphas: (pattern, alpha), in the file's order.
    pub alpha_pattern: Vec<(String, f32)>,
    /// Modules trained in full beside the adapters.
    pub modules_to_save: Vec<String>,
    /// How new adapters are initialised.
    pub init: LoraInit,
    /// The base model the adapter was made for, when the file names it.
    pub base_model: Option<String>,
}

/// Keys that change nothing ferrozero computes: bookkeeping, or settings of features that are
/// off (their switches are checked).
const BOOKKEEPING: &[&str] = &[
    "auto_mapping",
    "peft_version",
    "revision",
    "inference_mode",
    "megatron_core",
    "runtime_config",
    "qalora_group_size",
    "fan_in_fan_out",
];

/// PEFT features ferrozero does not implement: (key, the value that means "off").
const OFF: &[(&str, &str)] = &[
    ("use_dora", "false"),
    ("use_qalora", "false"),
    ("lora_bias", "false"),
    ("ensure_weight_tying", "false"),
    ("loftq_config", "{}"),
    ("eva_config", "null"),
    ("corda_config", "null"),
    ("lora_ga_config", "null"),
    ("velora_config", "null"),
    ("monteclora_config", "null"),
    ("arrow_config", "null"),
    ("kasa_config", "null"),
    ("megatron_config", "null"),
    ("trainable_token_indices", "null"),
    ("layer_replication", "null"),
    ("target_parameters", "null"),
    ("alora_invocation_tokens", "null"),
    ("use_bdlora", "null"),
];

/// Whether `v` is the "off" value `off` (PEFT writes `null`, `false`, `{}` or `[]` for them).
fn is_off(v: &Value, off: &str) -> bool {
    match v {
        Value::Null => true,
        Value::Bool(b) => !b && off == "false",
        Value::Object(m) => m.is_empty(),
        Value::Array(a) => a.is_empty(),
        _ => false,
    }
}

impl LoraConfig {
    /// Reads an `adapter_config.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::File {
            path: path.display().to_string(),
            reason: format!("cannot read the PEFT adapter config: {e}"),
        })?;
        Self::from_json(&text, &path.display().to_string())
    }

    /// Reads an `adapter_config.json`'s text; `origin` names it in errors.
    pub fn from_json(text: &str, origin: &str) -> Result<Self> {
        let map: Map<String, Value> = match serde_json::from_str(text) {
            Ok(Value::Object(m)) => m,
            Ok(_) => return Err(Error::Config(format!("{origin}: not a JSON object"))),
            Err(e) => return Err(Error::Config(format!("{origin}: not JSON: {e}"))),
        };
        let mut k = Reader::new(origin, &map);
        k.require_str("peft_type", "LORA", "only LoRA adapters are supported")?;
        k.require_str("task_type", "CAUSAL_LM", "ferrozero trains causal LMs")?;
        k.require_str("bias", "none", "bias training is not implemented")?;
        for (key, off) in OFF {
            if let Some(v) = k.raw(key) {
                if !is_off(v, off) {
                    return Err(k.err(format!(
                        "key `{key}` = {v} is not supported (ferrozero implements plain LoRA; \
                         supported: {off})"
                    )));
                }
            }
        }
        k.accept(BOOKKEEPING);
        let cfg = Self::read(&mut k, origin)?;
        k.finish()?;
        Ok(cfg)
    }

    fn read(k: &mut Reader<'_>, origin: &str) -> Result<Self> {
        let r = k.positive_or("r", 8)?;
        let cfg = LoraConfig {
            origin: origin.to_string(),
            r,
            alpha: k.f32_or("lora_alpha", 8.0)?,
            targets: k
                .targets("target_modules")?
                .ok_or_else(|| k.err("key `target_modules` is missing: name the layers to adapt (a list, a regular expression, or \"all-linear\")"))?,
            exclude: k.targets("exclude_modules")?,
            dropout: k.probability("lora_dropout")?,
            use_rslora: k.bool_or("use_rslora", false)?,
            layers_to_transform: k.indices("layers_to_transform")?,
            layers_pattern: k.strings("layers_pattern")?,
            rank_pattern: k.pattern_map("rank_pattern", |v| {
                v.as_u64().filter(|&n| n > 0).map(|n| n as usize)
            })?,
            alpha_pattern: k.pattern_map("alpha_pattern", |v| v.as_f64().map(|x| x as f32))?,
            modules_to_save: k.strings("modules_to_save")?,
            init: k.init("init_lora_weights")?,
            base_model: k.string_opt("base_model_name_or_path")?,
        };
        Ok(cfg)
    }

    /// The scale of an adapter with rank `r` and alpha `alpha`: `alpha / r`, or
    /// `alpha / sqrt(r)` with rsLoRA.
    pub fn scaling(&self, r: usize, alpha: f32) -> f32 {
        if self.use_rslora {
            alpha / (r as f32).sqrt()
        } else {
            alpha / r as f32
        }
    }
}
