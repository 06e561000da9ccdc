//! Choosing the model: a preset name or a Hugging Face `config.json` (GPT2Config or
//! LlamaConfig, told apart by `model_type` or the keys present).

use std::path::Path;

use ferrozero_runtime::nn::gpt2::{self, Gpt2Config};
use ferrozero_runtime::nn::llama::{self, LlamaConfig};
use ferrozero_runtime::nn::Model;

/// A model family with its config.
#[derive(Debug, Clone)]
pub enum ModelSpec {
    /// GPT-2.
    Gpt2(Gpt2Config),
    /// Llama.
    Llama(LlamaConfig),
}

impl ModelSpec {
    /// How tensor names in this family's files map to the model's: GPT-2 exports may lack the
    /// `transformer.` prefix, the others are used as stored.
    pub fn naming(&self) -> ferrozero_runtime::nn::weights::Naming {
        match self {
            ModelSpec::Gpt2(_) => ferrozero_runtime::nn::weights::Naming::Gpt2,
            ModelSpec::Llama(_) => ferrozero_runtime::nn::weights::Naming::Exact,
        }
    }

    /// From a preset name or a `config.json` path.
    pub fn parse(s: &str) -> Result<Self, String> {
        let path = Path::new(s);
        if path.is_file() {
            let text = std::fs::read_to_string(path).map_err(|e| format!("{s}: {e}"))?;
            let v: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| format!("{s}: {e}"))?;
            let llama = v.get("model_type").and_then(|t| t.as_str()) == Some("llama")
                || v.get("num_hidden_layers").is_some();
            return if llama {
                LlamaConfig::from_json(&text)
                    .map(ModelSpec::Llama)
                    .map_err(|e| e.to_string())
            } else {
                Gpt2Config::from_json(&text)
                    .map(ModelSpec::Gpt2)
                    .map_err(|e| e.to_string())
            };
        }
        match s {
            // The default: small enough to learn 3-digit addition in a couple of minutes on 2 cores.
            "addition" => Ok(ModelSpec::Gpt2(Gpt2Config { n_layer: 3, n_head: 4, n_embd: 128, vocab_size: 16, n_positions: 16, ..Gpt2Config::preset("tiny").map_err(|e| e.to_string())? })),
            "llama-tiny" => LlamaConfig::preset("tiny").map(ModelSpec::Llama).map_err(|e| e.to_string()),
            "llama-7b" | "llama-13b" => LlamaConfig::preset(s).map(ModelSpec::Llama).map_err(|e| e.to_string()),
            other => Gpt2Config::preset(other)
                .map(ModelSpec::Gpt2)
                .map_err(|_| format!("unknown model `{other}`: a config.json path, or one of addition, tiny, bench-15m, gpt2-124m, llama-tiny, llama-7b, llama-13b")),
        }
    }

    /// Builds the model.
    pub fn build(&self) -> ferrozero_runtime::Result<Model> {
        match self {
            ModelSpec::Gpt2(c) => gpt2::build(c),
            ModelSpec::Llama(c) => llama::build(c),
        }
    }

    /// Hidden size (for `"auto"` bucket sizes).
    pub fn hidden(&self) -> usize {
        match self {
            ModelSpec::Gpt2(c) => c.n_embd,
            ModelSpec::Llama(c) => c.hidden_size,
        }
    }

    /// Vocabulary size.
    pub fn vocab(&self) -> usize {
        match self {
            ModelSpec::Gpt2(c) => c.vocab_size,
            ModelSpec::Llama(c) => c.vocab_size,
        }
    }

    /// Longest sequence.
    pub fn positions(&self) -> usize {
        match self {
            ModelSpec::Gpt2(c) => c.n_positions,
            ModelSpec::Llama(c) => c.max_position_embeddings,
        }
    }
}
