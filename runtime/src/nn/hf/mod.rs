//! Models from a Hugging Face `config.json`: the architecture it names (`architectures`, or
//! `model_type` when that is absent), read key by key into one of ferrozero's model configs.
//!
//! Supported: `GPT2LMHeadModel` ([`crate::nn::gpt2`]), and `LlamaForCausalLM`,
//! `MistralForCausalLM`, `Qwen2ForCausalLM` ([`crate::nn::llama`], which carries the
//! differences: q/k/v biases, a sliding window). Every key is either read and its value
//! checked against what the model implements, known not to change training's math (token
//! ids, dtypes, generation settings), or refused with an error naming it: a checkpoint never
//! trains as a different model than the one it was saved from.
//!
//! Adding an architecture: a variant of [`Architecture`] with its class name and
//! `model_type`, a reader (a file beside `llama.rs`) that reads every key its transformers
//! config defines, and a parity fixture (`runtime/tests/fixtures/gen_hf_parity.py`).

mod gpt2;
mod keys;
mod llama;
mod rope;

use std::path::Path;

use serde_json::{Map, Value};

use crate::nn::gpt2::Gpt2Config;
use crate::nn::llama::LlamaConfig;
use crate::nn::weights::Naming;
use crate::nn::Model;
use crate::{Error, Result};
use keys::Keys;

/// A Hugging Face model class ferrozero implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    /// `GPT2LMHeadModel` (`model_type` `gpt2`).
    Gpt2,
    /// `LlamaForCausalLM` (`llama`).
    Llama,
    /// `MistralForCausalLM` (`mistral`).
    Mistral,
    /// `Qwen2ForCausalLM` (`qwen2`).
    Qwen2,
}

impl Architecture {
    /// Every supported architecture.
    pub const ALL: [Architecture; 4] = [Self::Gpt2, Self::Llama, Self::Mistral, Self::Qwen2];

    /// The transformers class name (`architectures` in `config.json`).
    pub fn class_name(self) -> &'static str {
        match self {
            Self::Gpt2 => "GPT2LMHeadModel",
            Self::Llama => "LlamaForCausalLM",
            Self::Mistral => "MistralForCausalLM",
            Self::Qwen2 => "Qwen2ForCausalLM",
        }
    }

    /// The `model_type` in `config.json`.
    pub fn model_type(self) -> &'static str {
        match self {
            Self::Gpt2 => "gpt2",
            Self::Llama => "llama",
            Self::Mistral => "mistral",
            Self::Qwen2 => "qwen2",
        }
    }

    fn supported() -> String {
        let names: Vec<String> = Self::ALL
            .iter()
            .map(|a| format!("{} ({})", a.class_name(), a.model_type()))
            .collect();
        names.join(", ")
    }
}

/// The model a `config.json` describes.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelConfig {
    /// GPT-2.
    Gpt2(Gpt2Config),
    /// The Llama family (Llama, Mistral, Qwen2).
    Llama(LlamaConfig),
}

/// A model read from a Hugging Face `config.json`: what to build and what callers need.
#[derive(Debug, Clone, PartialEq)]
pub struct HfModel {
    /// The class it was saved as.
    pub architecture: Architecture,
    /// Its hyper-parameters.
    pub config: ModelConfig,
}

impl HfModel {
    /// Reads `config.json` at `path`.
    pub fn from_file(path: &Path) -> Result<Self> {
        Self::from_json(&read_text(path)?, &path.display().to_string())
    }

    /// Parses `config.json` text; `origin` names it in errors.
    pub fn from_json(text: &str, origin: &str) -> Result<Self> {
        let map = object(text, origin)?;
        let architecture = architecture(&map, origin)?;
        Self::read(&map, origin, architecture)
    }

    /// Reads `map` as `architecture` (whatever it names itself).
    fn read(map: &Map<String, Value>, origin: &str, architecture: Architecture) -> Result<Self> {
        let mut k = Keys::new(origin, architecture.class_name(), map);
        let config = match architecture {
            Architecture::Gpt2 => ModelConfig::Gpt2(gpt2::read(&mut k)?),
            arch => ModelConfig::Llama(llama::read(&mut k, arch)?),
        };
        k.finish()?;
        Ok(Self {
            architecture,
            config,
        })
    }

    /// Builds the model (parameter names as in the architecture's checkpoints).
    pub fn build(&self) -> Result<Model> {
        match &self.config {
            ModelConfig::Gpt2(c) => crate::nn::gpt2::build(c),
            ModelConfig::Llama(c) => crate::nn::llama::build(c),
        }
    }

    /// The linear layers LoRA can target, by Hugging Face module name.
    pub fn linear_sites(&self) -> Vec<crate::nn::peft::LinearSite> {
        match &self.config {
            ModelConfig::Gpt2(c) => crate::nn::gpt2::linear_sites(c),
            ModelConfig::Llama(c) => crate::nn::llama::linear_sites(c),
        }
    }

    /// Builds the model with the LoRA adapters `lora` puts on it, every parameter frozen but
    /// the adapters and `modules_to_save` (PEFT's `get_peft_model`).
    pub fn build_lora(&self, lora: &crate::nn::peft::LoraConfig) -> Result<Model> {
        let arch = self.architecture.class_name();
        let (adapters, frozen) = crate::nn::peft::plan(lora, &self.linear_sites(), arch)?;
        let model = match &self.config {
            ModelConfig::Gpt2(c) => crate::nn::gpt2::build_with(c, &adapters),
            ModelConfig::Llama(c) => crate::nn::llama::build_with(c, &adapters),
        }?;
        model
            .freeze(frozen)
            .map_err(|e| Error::Config(format!("{}: {e}", lora.origin)))
    }

    /// Model width.
    pub fn hidden(&self) -> usize {
        match &self.config {
            ModelConfig::Gpt2(c) => c.n_embd,
            ModelConfig::Llama(c) => c.hidden_size,
        }
    }

    /// Vocabulary size.
    pub fn vocab(&self) -> usize {
        match &self.config {
            ModelConfig::Gpt2(c) => c.vocab_size,
            ModelConfig::Llama(c) => c.vocab_size,
        }
    }

    /// The longest sequence a run may use (positions, and Mistral's window).
    pub fn max_seq(&self) -> usize {
        match &self.config {
            ModelConfig::Gpt2(c) => c.n_positions,
            ModelConfig::Llama(c) => c.max_seq(),
        }
    }

    /// How names in this architecture's weight files map to the model's parameter names.
    pub fn naming(&self) -> Naming {
        match self.architecture {
            Architecture::Gpt2 => Naming::Gpt2,
            _ => Naming::Exact,
        }
    }
}

/// The text of the `config.json` at `path`.
pub(crate) fn read_text(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|e| Error::File {
        path: path.display().to_string(),
        reason: e.to_string(),
    })
}

/// `from_json` and `from_json_file` of a model family's config: read through [`read_as`] as
/// its `$variant` of [`ModelConfig`] (and [`Architecture`], when the file names none).
macro_rules! config_readers {
    ($variant:ident, $class:literal) => {
        #[doc = concat!("Parses a Hugging Face `", $class, "` `config.json` (see [`crate::nn::hf`]: ")]
        /// keys that would change the math and are not implemented are refused).
        pub fn from_json(text: &str) -> $crate::Result<Self> {
            Self::parse(text, "config.json")
        }

        /// Reads and parses a `config.json` file.
        pub fn from_json_file(path: &std::path::Path) -> $crate::Result<Self> {
            Self::parse(
                &$crate::nn::hf::read_text(path)?,
                &path.display().to_string(),
            )
        }

        fn parse(text: &str, origin: &str) -> $crate::Result<Self> {
            use $crate::nn::hf::{Architecture, ModelConfig};
            let pick = |c| match c {
                ModelConfig::$variant(c) => Some(c),
                _ => None,
            };
            $crate::nn::hf::read_as(text, origin, Architecture::$variant, pick)
        }
    };
}
pub(crate) use config_readers;

/// Parses `text` (`origin` names it in errors) as the architecture it names, or as `default`
/// when it names none (`architectures` and `model_type` may be absent); `pick` takes the
/// config of `default`'s family and refuses another.
pub(crate) fn read_as<T>(
    text: &str,
    origin: &str,
    default: Architecture,
    pick: fn(ModelConfig) -> Option<T>,
) -> Result<T> {
    let map = object(text, origin)?;
    let arch = if has_name(&map) {
        architecture(&map, origin)?
    } else {
        default
    };
    pick(HfModel::read(&map, origin, arch)?.config).ok_or_else(|| {
        Error::Config(format!(
            "{origin}: a {} config where one of {}'s family was expected",
            arch.class_name(),
            default.class_name()
        ))
    })
}

fn object(text: &str, origin: &str) -> Result<Map<String, Value>> {
    match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(other) => Err(Error::Config(format!(
            "{origin}: a config.json is a JSON object, not {other}"
        ))),
        Err(e) => Err(Error::Config(format!("{origin}: not JSON: {e}"))),
    }
}

fn has_name(map: &Map<String, Value>) -> bool {
    map.contains_key("architectures") || map.contains_key("model_type")
}

/// The architecture `architectures` names (exactly one), else `model_type`'s.
fn architecture(map: &Map<String, Value>, origin: &str) -> Result<Architecture> {
    let err = |m: String| {
        Error::Config(format!(
            "{origin}: {m} (supported: {})",
            Architecture::supported()
        ))
    };
    if let Some(v) = map.get("architectures").filter(|v| !v.is_null()) {
        let names: Option<Vec<&str>> = v
            .as_array()
            .and_then(|a| a.iter().map(Value::as_str).collect());
        return match names.as_deref() {
            Some([one]) => Architecture::ALL
                .into_iter()
                .find(|a| a.class_name() == *one)
                .ok_or_else(|| {
                    err(format!(
                        "architectures names `{one}`, which is not supported"
                    ))
                }),
            _ => Err(err(format!(
                "key `architectures` = {v} must name exactly one model class"
            ))),
        };
    }
    match map.get("model_type").and_then(Value::as_str) {
        Some(t) => Architecture::ALL
            .into_iter()
            .find(|a| a.model_type() == t)
            .ok_or_else(|| err(format!("model_type `{t}` is not supported"))),
        None => Err(err(
            "neither `architectures` nor `model_type` names the model".into(),
        )),
    }
}
