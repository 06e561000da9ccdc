//! Choosing the model: a preset name, or a Hugging Face `config.json` read by the library
//! (`nn::hf`: the architecture it names, every key checked).

use std::path::Path;

use ferrozero_runtime::nn::gpt2::Gpt2Config;
use ferrozero_runtime::nn::hf::{Architecture, HfModel, ModelConfig};
use ferrozero_runtime::nn::llama::LlamaConfig;

/// From a preset name or a `config.json` path.
pub fn parse(s: &str) -> Result<HfModel, String> {
    if Path::new(s).is_file() {
        return HfModel::from_file(Path::new(s)).map_err(|e| e.to_string());
    }
    let err = |e: ferrozero_runtime::Error| e.to_string();
    let llama = |c: LlamaConfig| HfModel {
        architecture: Architecture::Llama,
        config: ModelConfig::Llama(c),
    };
    let gpt2 = |c: Gpt2Config| HfModel {
        architecture: Architecture::Gpt2,
        config: ModelConfig::Gpt2(c),
    };
    match s {
        // The default: small enough to learn 3-digit addition in a couple of minutes on 2 cores.
        "addition" => Ok(gpt2(Gpt2Config {
            n_layer: 3,
            n_head: 4,
            n_embd: 128,
            vocab_size: 16,
            n_positions: 16,
            ..Gpt2Config::preset("tiny").map_err(err)?
        })),
        "llama-tiny" => LlamaConfig::preset("tiny").map(llama).map_err(err),
        "llama-7b" | "llama-13b" => LlamaConfig::preset(s).map(llama).map_err(err),
        other => Gpt2Config::preset(other).map(gpt2).map_err(|_| {
            format!(
                "unknown model `{other}`: a config.json path, or one of addition, tiny, \
                 bench-15m, gpt2-124m, llama-tiny, llama-7b, llama-13b"
            )
        }),
    }
}
