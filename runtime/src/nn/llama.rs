//! A Llama-style decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention) with Hugging Face
//! parameter names and layouts.
//!
//! Units: `embed` (`model.embed_tokens.weight [vocab, H]`), one `layers.{i}` per block, and
//! `head` (`model.norm.weight [H]` + `lm_head.weight [vocab, H]` + summed cross-entropy).
//! With `tie_word_embeddings` the embedding table is a shared parameter read by `embed` and
//! `head`, and no `lm_head.weight` exists (as in Hugging Face).
//!
//! Blocks `model.layers.{i}.` declare their parameters in [`block`] as Hugging Face's
//! checkpoints hold them: `nn.Linear` weights stored `[out, in]` (`y = x · Wᵀ`). RoPE follows
//! Hugging Face's rotate-half convention (dimension `i` pairs with `i + D/2`), with its
//! frequency scalings (`linear`, `llama3`).
//!
//! The same code is Mistral (a `sliding_window`: the run's sequence must fit in it, where
//! windowed attention is full causal attention) and Qwen2 (`qkv_bias`: q/k/v projections
//! carry `bias [width]` parameters after their weights). [`crate::nn::hf`] reads each
//! architecture's `config.json` into a [`LlamaConfig`].

use crate::backend::Rope;
use std::sync::Arc;

use crate::nn::layers::{decoder, Adapters, Attention, Block, LmHead, Mlp, ParamList, TokenEmbed};
use crate::nn::linear::{Linear, WeightLayout};
use crate::nn::{Init, Model, ParamSpec};
use crate::{Error, Result};

/// Llama hyper-parameters, field names as in Hugging Face's `LlamaConfig` (`config.json`,
/// read by [`crate::nn::hf`]).
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    /// Model width.
    pub hidden_size: usize,
    /// MLP width.
    pub intermediate_size: usize,
    /// Blocks.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (defaults to the query heads).
    pub num_key_value_heads: Option<usize>,
    /// Head width (defaults to `hidden_size / num_attention_heads`).
    pub head_dim: Option<usize>,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f32,
    /// RoPE base and frequency scaling (`rope_theta`, `rope_scaling` / `rope_parameters`).
    pub rope: Rope,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Longest sequence.
    pub max_position_embeddings: usize,
    /// Whether the LM head reuses the embedding table.
    pub tie_word_embeddings: bool,
    /// Std of the normal initialiser.
    pub initializer_range: f32,
    /// Whether the q, k and v projections have biases (Qwen2).
    pub qkv_bias: bool,
    /// Mistral's attention window; a run's sequence may not exceed it (within it, windowed
    /// attention is full causal attention).
    pub sliding_window: Option<usize>,
    /// Dropout on the attention probabilities while training (`attention_dropout`).
    pub attention_dropout: f32,
}

impl LlamaConfig {
    /// A named preset: `tiny` (tests, GQA with 4 query and 2 kv heads), `llama-7b`, `llama-13b`.
    pub fn preset(name: &str) -> Result<Self> {
        let (h, i, l, q, kv, v, pos) = match name {
            "tiny" => (32, 64, 2, 4, 2, 64, 64),
            "llama-7b" => (4096, 11008, 32, 32, 32, 32000, 4096),
            "llama-13b" => (5120, 13824, 40, 40, 40, 32000, 4096),
            other => {
                return Err(Error::Config(format!(
                    "unknown Llama preset `{other}` (known: tiny, llama-7b, llama-13b)"
                )))
            }
        };
        Ok(Self {
            hidden_size: h,
            intermediate_size: i,
            num_hidden_layers: l,
            num_attention_heads: q,
            num_key_value_heads: Some(kv),
            head_dim: None,
            rms_norm_eps: if name == "tiny" { 1e-6 } else { 1e-5 },
            rope: Rope::plain(10000.0),
            vocab_size: v,
            max_position_embeddings: pos,
            tie_word_embeddings: false,
            initializer_range: 0.02,
            qkv_bias: false,
            sliding_window: None,
            attention_dropout: 0.0,
        })
    }

    crate::nn::hf::config_readers!(Llama, "LlamaForCausalLM");

    /// Key/value heads.
    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// Head width.
    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// The longest sequence a run may use: the positions, and Mistral's window.
    pub fn max_seq(&self) -> usize {
        self.sliding_window
            .map_or(self.max_position_embeddings, |w| {
                w.min(self.max_position_embeddings)
            })
    }

    /// Checks that the sizes are usable.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Config(format!("Llama config: {m}")));
        let sizes = [
            self.hidden_size,
            self.intermediate_size,
            self.num_hidden_layers,
        ];
        if sizes.contains(&0) || self.num_attention_heads == 0 || self.vocab_size == 0 {
            return bad("sizes, layer and head counts must be positive".into());
        }
        let split =
            self.head_dim.is_some() || self.hidden_size.is_multiple_of(self.num_attention_heads);
        if !split || self.head_dim() == 0 || !self.head_dim().is_multiple_of(2) {
            return bad(format!(
                "hidden_size {} must split into {} heads of even width (or head_dim {:?} be \
                 even and positive)",
                self.hidden_size, self.num_attention_heads, self.head_dim
            ));
        }
        let kv = self.kv_heads();
        if kv == 0 || !self.num_attention_heads.is_multiple_of(kv) {
            return bad(format!(
                "num_key_value_heads {kv} must divide num_attention_heads {}",
                self.num_attention_heads
            ));
        }
        if !(0.0..1.0).contains(&self.attention_dropout) {
            return bad(format!(
                "attention_dropout = {} is outside [0, 1)",
                self.attention_dropout
            ));
        }
        if self.max_position_embeddings == 0 || self.sliding_window == Some(0) {
            return bad("max_position_embeddings and sliding_window must be positive".into());
        }
        self.rope
            .validate()
            .map_err(|m| Error::Config(format!("Llama config: {m}")))?;
        Ok(())
    }
}

/// The embedding table's name and initialiser, when the unit declares it (untied).
fn own_table<'a>(cfg: &LlamaConfig, name: &'a str) -> Option<(&'a str, Init)> {
    let init = Init::Normal {
        std: cfg.initializer_range,
    };
    (!cfg.tie_word_embeddings).then_some((name, init))
}

/// `embed`: `embed_tokens[token]` (shared with the head when tied).
pub fn embed(cfg: &LlamaConfig) -> TokenEmbed {
    let sizes = (cfg.hidden_size, cfg.vocab_size, cfg.max_position_embeddings);
    let table = own_table(cfg, "model.embed_tokens.weight");
    let mut embed = TokenEmbed::new(sizes, None, table);
    embed.window = cfg.sliding_window;
    embed
}

/// Block `model.layers.{index}`: RMSNorm, grouped-query attention with RoPE, RMSNorm,
/// SwiGLU; every projection an `nn.Linear` (`[out, in]`), biased only on q/k/v with
/// `qkv_bias`, whose biases come after the nine weights so the weights keep their places.
pub fn block(cfg: &LlamaConfig, index: usize) -> Block {
    block_with(cfg, index, &Arc::default())
}

/// The linear layers LoRA can target, by Hugging Face module name (`lm_head` as the output
/// head).
pub fn linear_sites(cfg: &LlamaConfig) -> Vec<crate::nn::peft::LinearSite> {
    let (h, i, d) = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim());
    let (qw, kvw) = (cfg.num_attention_heads * d, cfg.kv_heads() * d);
    let site = crate::nn::peft::LinearSite::new;
    let mut out = Vec::new();
    for b in 0..cfg.num_hidden_layers {
        let layers = [
            ("self_attn.q_proj", (h, qw)),
            ("self_attn.k_proj", (h, kvw)),
            ("self_attn.v_proj", (h, kvw)),
            ("self_attn.o_proj", (qw, h)),
            ("mlp.gate_proj", (h, i)),
            ("mlp.up_proj", (h, i)),
            ("mlp.down_proj", (i, h)),
        ];
        for (m, io) in layers {
            out.push(site(format!("model.layers.{b}.{m}"), io, false));
        }
    }
    out.push(site("lm_head".into(), (h, cfg.vocab_size), true));
    out
}

/// [`block`] with LoRA `adapters` on the linear layers they name.
pub fn block_with(cfg: &LlamaConfig, index: usize, adapters: &Arc<Adapters>) -> Block {
    let (h, i, eps) = (cfg.hidden_size, cfg.intermediate_size, cfg.rms_norm_eps);
    let d = cfg.head_dim();
    let (qw, kvw) = (cfg.num_attention_heads * d, cfg.kv_heads() * d);
    let w = Init::Normal {
        std: cfg.initializer_range,
    };
    let lin = |d_in, d_out| Linear {
        d_in,
        d_out,
        layout: WeightLayout::OutIn,
    };
    let mut p = ParamList::new(format!("model.layers.{index}.")).with_adapters(adapters);
    let mut qkv = [("q", qw), ("k", kvw), ("v", kvw)]
        .map(|(n, out)| p.dense(&format!("self_attn.{n}_proj"), lin(h, out), w, false));
    let o = p.dense("self_attn.o_proj", lin(qw, h), w, false);
    let gate = p.dense("mlp.gate_proj", lin(h, i), w, false);
    let up = p.dense("mlp.up_proj", lin(h, i), w, false);
    let down = p.dense("mlp.down_proj", lin(i, h), w, false);
    let norm1 = p.rms_norm("input_layernorm", h, eps);
    let norm2 = p.rms_norm("post_attention_layernorm", h, eps);
    if cfg.qkv_bias {
        for (dense, n) in qkv.iter_mut().zip(["q", "k", "v"]) {
            let name = format!("self_attn.{n}_proj.bias");
            dense.bias = Some(p.add(&name, vec![dense.lin.d_out], Init::Zeros));
        }
    }
    let attn = Attention {
        qkv: qkv.to_vec(),
        o,
        q_heads: cfg.num_attention_heads,
        kv_heads: cfg.kv_heads(),
        head_dim: d,
        rope: Some(cfg.rope),
        pdrop: cfg.attention_dropout,
    };
    Block {
        params: p,
        width: h,
        norm1,
        attn,
        norm2,
        mlp: Mlp::SwiGlu { gate, up, down },
        resid_pdrop: 0.0,
    }
}

/// `head`: `model.norm`, then `lm_head` (the embedding table when tied).
pub fn head(cfg: &LlamaConfig) -> LmHead {
    let mut p = ParamList::new("");
    let norm = p.rms_norm("model.norm", cfg.hidden_size, cfg.rms_norm_eps);
    let table = own_table(cfg, "lm_head.weight");
    LmHead::new(p, norm, (cfg.hidden_size, cfg.vocab_size), table)
}

/// Builds the model. It holds no device: the engine (or whoever calls the modules) passes
/// the backend in each call's [`crate::nn::Ctx`], so one model runs on any device.
pub fn build(cfg: &LlamaConfig) -> Result<Model> {
    build_with(cfg, &Adapters::default())
}

/// [`build`] with LoRA `adapters` on the linear layers they name (Hugging Face module names);
/// an adapter whose layer this model lacks is an error.
pub fn build_with(cfg: &LlamaConfig, adapters: &Adapters) -> Result<Model> {
    cfg.validate()?;
    let plan = Arc::new(adapters.clone());
    let table = ParamSpec {
        name: "model.embed_tokens.weight".into(),
        shape: vec![cfg.vocab_size, cfg.hidden_size],
        init: Init::Normal {
            std: cfg.initializer_range,
        },
    };
    let tied = cfg.tie_word_embeddings.then_some(table);
    let blocks = (0..cfg.num_hidden_layers)
        .map(|i| block_with(cfg, i, &plan))
        .collect();
    let model = decoder(tied, embed(cfg), ("layers", blocks), head(cfg));
    adapters.check_placed(&model)?;
    Ok(model)
}
