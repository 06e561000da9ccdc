//! Models to estimate, described the ways a user knows them: a preset name, a Hugging Face
//! `config.json`, or just a size (`7e9` parameters, 32 layers, width 4096). Building a model
//! only records parameter specs, so even 13B models cost nothing here.

use std::path::Path;

use crate::nn::{gpt2, llama, Model};
use crate::{Error, Result};

/// A model's shape, with what the estimator's callers need beside the module list.
pub struct ModelShape {
    /// The model (specs only; no parameter memory exists until an engine builds it).
    pub model: Model,
    /// Width, for `"auto"` bucket sizes.
    pub hidden: usize,
    /// Longest sequence the model accepts.
    pub max_seq: usize,
    /// A short description for reports.
    pub description: String,
    /// The architecture's config the model was built from.
    pub config: crate::nn::hf::ModelConfig,
}

impl ModelShape {
    /// The model with the LoRA adapters `lora` puts on it and its base frozen (PEFT's
    /// `get_peft_model`).
    pub fn with_peft(mut self, lora: &crate::nn::peft::LoraConfig) -> Result<Self> {
        use crate::nn::hf::ModelConfig;
        let (sites, arch) = match &self.config {
            ModelConfig::Gpt2(c) => (gpt2::linear_sites(c), "GPT2LMHeadModel"),
            ModelConfig::Llama(c) => (llama::linear_sites(c), "LlamaForCausalLM"),
        };
        let (adapters, frozen) = crate::nn::peft::plan(lora, &sites, arch)?;
        let model = match &self.config {
            ModelConfig::Gpt2(c) => gpt2::build_with(c, &adapters)?,
            ModelConfig::Llama(c) => llama::build_with(c, &adapters)?,
        };
        self.model = model.freeze(frozen)?;
        self.description += &format!(
            ", LoRA r {} on {} layers",
            lora.r,
            adapters.modules().count()
        );
        Ok(self)
    }

    /// The model with the parameters `frozen`'s rules name frozen.
    pub fn with_frozen(mut self, frozen: crate::nn::freeze::Freeze) -> Result<Self> {
        let rules: Vec<&str> = frozen.rules().collect();
        self.description += &format!(", frozen [{}]", rules.join(", "));
        self.model = self.model.freeze(frozen)?;
        Ok(self)
    }
}

/// Known preset names.
pub const PRESETS: [&str; 6] = [
    "tiny-gpt2",
    "bench-15m",
    "gpt2-124m",
    "tiny-llama",
    "llama-7b",
    "llama-13b",
];

fn from_gpt2(cfg: gpt2::Gpt2Config, what: String) -> Result<ModelShape> {
    Ok(ModelShape {
        hidden: cfg.n_embd,
        max_seq: cfg.n_positions,
        model: gpt2::build(&cfg)?,
        description: what,
        config: crate::nn::hf::ModelConfig::Gpt2(cfg),
    })
}

fn from_llama(cfg: llama::LlamaConfig, what: String) -> Result<ModelShape> {
    Ok(ModelShape {
        hidden: cfg.hidden_size,
        max_seq: cfg.max_position_embeddings,
        model: llama::build(&cfg)?,
        description: what,
        config: crate::nn::hf::ModelConfig::Llama(cfg),
    })
}

/// A preset: GPT-2 (`gpt2-124m`, `bench-15m`, `tiny-gpt2`) or Llama (`llama-7b`,
/// `llama-13b`, `tiny-llama`).
pub fn preset(name: &str) -> Result<ModelShape> {
    let what = format!("preset {name}");
    match name {
        "tiny-gpt2" => from_gpt2(gpt2::Gpt2Config::preset("tiny")?, what),
        "tiny-llama" => from_llama(llama::LlamaConfig::preset("tiny")?, what),
        n if n.starts_with("llama") => from_llama(llama::LlamaConfig::preset(n)?, what),
        n if gpt2::Gpt2Config::preset(n).is_ok() => from_gpt2(gpt2::Gpt2Config::preset(n)?, what),
        other => Err(Error::Config(format!(
            "unknown model preset `{other}` (known: {})",
            PRESETS.join(", ")
        ))),
    }
}

/// A Hugging Face `config.json` of a supported architecture (read by [`crate::nn::hf`]).
pub fn hf_config(path: &Path) -> Result<ModelShape> {
    let what = format!("{}", path.display());
    match crate::nn::hf::HfModel::from_file(path)?.config {
        crate::nn::hf::ModelConfig::Gpt2(c) => from_gpt2(c, what),
        crate::nn::hf::ModelConfig::Llama(c) => from_llama(c, what),
    }
}

/// A Llama-shaped model of about `params` parameters: the MLP width is solved from the
/// parameter count (rounded to a multiple of 256, as Llama's are), heads are 128 wide.
pub fn from_size(
    params: f64,
    layers: usize,
    hidden: usize,
    vocab: usize,
    seq: usize,
) -> Result<ModelShape> {
    if !(params.is_finite() && params >= 1.0) || layers == 0 || hidden == 0 || vocab == 0 {
        return Err(Error::Config(format!(
            "--params {params} --layers {layers} --hidden {hidden} --vocab {vocab}: all must be positive"
        )));
    }
    let (l, h, v) = (layers as f64, hidden as f64, vocab as f64);
    // Untied embedding and head (2·V·H), final norm (H); per layer: attention 4·H², two
    // norms 2·H, and a gated MLP 3·H·I.
    let rest = params - 2.0 * v * h - h - l * (4.0 * h * h + 2.0 * h);
    let inter = (rest / (3.0 * l * h) / 256.0).round() as i64 * 256;
    if inter <= 0 {
        return Err(Error::Config(format!(
            "{params:e} parameters are too few for {layers} layers of width {hidden} and a \
             {vocab}-token vocabulary (attention and embeddings alone need more)"
        )));
    }
    let heads = (hidden / 128).max(1);
    if !hidden.is_multiple_of(heads) {
        return Err(Error::Config(format!(
            "--hidden {hidden} must be a multiple of 128 (or below 128)"
        )));
    }
    let cfg = llama::LlamaConfig {
        hidden_size: hidden,
        intermediate_size: inter as usize,
        num_hidden_layers: layers,
        num_attention_heads: heads,
        num_key_value_heads: None,
        head_dim: None,
        rms_norm_eps: 1e-5,
        rope: crate::backend::Rope::plain(10000.0),
        vocab_size: vocab,
        max_position_embeddings: seq,
        tie_word_embeddings: false,
        initializer_range: 0.02,
        qkv_bias: false,
        sliding_window: None,
        attention_dropout: 0.0,
    };
    let what = format!("Llama-shaped, {params:.3e} params, {layers} layers, width {hidden}");
    from_llama(cfg, what)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_solves_to_the_llama_7b_shape() {
        let s = from_size(6.74e9, 32, 4096, 32000, 4096).unwrap();
        let want = preset("llama-7b").unwrap().model.num_params() as f64;
        let got = s.model.num_params() as f64;
        assert!((got - want).abs() / want < 0.01, "{got} vs {want}");
    }

    #[test]
    fn bad_sizes_and_names_are_errors() {
        assert!(from_size(1e6, 32, 4096, 32000, 4096).is_err());
        assert!(from_size(f64::NAN, 32, 4096, 32000, 4096).is_err());
        assert!(from_size(7e9, 0, 4096, 32000, 4096).is_err());
        assert!(preset("gpt5").is_err());
        assert!(hf_config(Path::new("/nonexistent/config.json")).is_err());
    }

    #[test]
    fn presets_resolve() {
        for p in &PRESETS {
            assert!(preset(p).unwrap().model.num_params() > 0, "{p}");
        }
    }
}
