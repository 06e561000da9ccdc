//! A GPT-2-style decoder with Hugging Face parameter names and layouts.
//!
//! Units: `embed` (reads tokens; owns `transformer.wpe.weight` `[n_positions, n_embd]` and
//! reads the shared `transformer.wte.weight` `[vocab_size, n_embd]`), one `h.{i}` per block,
//! and `head` (`transformer.ln_f` + LM head tied to `wte` + summed cross-entropy).
//!
//! Blocks `transformer.h.{i}.` declare their parameters in [`block`] as Hugging Face's
//! checkpoints hold them: GPT-2's `Conv1D` stores weights as `[in, out]` (so `y = x · W`, no
//! transposition); the LM head multiplies by `wteᵀ`. `c_attn`'s output columns are q, k, v in
//! thirds, each split into heads of `n_embd / n_head` columns.
//!
//! Dropout (`resid_pdrop`, `embd_pdrop`, `attn_pdrop`) applies after the embedding sum, on
//! each residual branch and on the attention probabilities; masks derive from
//! `ctx.rng_seed` and `ctx.rng_row` only.

use std::sync::Arc;

use crate::nn::layers::{decoder, Adapters, Attention, Block, LmHead, Mlp, ParamList, TokenEmbed};
use crate::nn::linear::{Linear, WeightLayout};
use crate::nn::{Init, Model, ParamSpec};
use crate::{Error, Result};

/// GPT-2 hyper-parameters, field names as in Hugging Face's `GPT2Config` (`config.json`,
/// read by [`crate::nn::hf`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Gpt2Config {
    /// Blocks.
    pub n_layer: usize,
    /// Attention heads per block.
    pub n_head: usize,
    /// Model width.
    pub n_embd: usize,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Longest sequence (rows of `wpe`).
    pub n_positions: usize,
    /// LayerNorm epsilon.
    pub layer_norm_epsilon: f32,
    /// Residual dropout probability.
    pub resid_pdrop: f32,
    /// Embedding dropout probability.
    pub embd_pdrop: f32,
    /// Attention-probability dropout.
    pub attn_pdrop: f32,
    /// Std of the normal initialiser.
    pub initializer_range: f32,
}

impl Gpt2Config {
    /// A named preset: `tiny` (tests), `bench-15m` (6 layers, width 384, 6 heads, vocab
    /// 4096, 128 positions) or `gpt2-124m` (the original GPT-2 small).
    pub fn preset(name: &str) -> Result<Self> {
        let (n_layer, n_head, n_embd, vocab_size, n_positions) = match name {
            "tiny" => (2, 2, 16, 64, 32),
            "bench-15m" => (6, 6, 384, 4096, 128),
            "gpt2-124m" => (12, 12, 768, 50257, 1024),
            other => {
                return Err(Error::Config(format!(
                    "unknown GPT-2 preset `{other}` (known: tiny, bench-15m, gpt2-124m)"
                )))
            }
        };
        Ok(Self {
            n_layer,
            n_head,
            n_embd,
            vocab_size,
            n_positions,
            layer_norm_epsilon: 1e-5,
            resid_pdrop: 0.0,
            embd_pdrop: 0.0,
            attn_pdrop: 0.0,
            initializer_range: 0.02,
        })
    }

    crate::nn::hf::config_readers!(Gpt2, "GPT2LMHeadModel");

    /// Checks that the sizes are usable.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Config(format!("GPT-2 config: {m}")));
        if self.n_layer == 0 || self.n_head == 0 || self.n_embd == 0 || self.vocab_size == 0 {
            return bad("n_layer, n_head, n_embd and vocab_size must be positive".into());
        }
        if !self.n_embd.is_multiple_of(self.n_head) {
            return bad(format!(
                "n_embd {} is not a multiple of n_head {}",
                self.n_embd, self.n_head
            ));
        }
        if self.n_positions == 0 {
            return bad("n_positions must be positive".into());
        }
        for (name, p) in [
            ("resid_pdrop", self.resid_pdrop),
            ("embd_pdrop", self.embd_pdrop),
            ("attn_pdrop", self.attn_pdrop),
        ] {
            if !(0.0..1.0).contains(&p) {
                return bad(format!("{name} = {p} is outside [0, 1)"));
            }
        }
        Ok(())
    }

    /// Head width.
    pub fn head_dim(&self) -> usize {
        self.n_embd / self.n_head
    }
}

/// `embed`: `wte[token] + wpe[position]` (`wte` shared with the head), then dropout.
pub fn embed(cfg: &Gpt2Config) -> TokenEmbed {
    let sizes = (cfg.n_embd, cfg.vocab_size, cfg.n_positions);
    let wpe = ("transformer.wpe.weight", normal(cfg.initializer_range));
    let mut embed = TokenEmbed::new(sizes, Some(wpe), None);
    embed.dropout = Some(cfg.embd_pdrop);
    embed
}

/// Block `transformer.h.{index}`: LayerNorm, attention over the fused `c_attn`, LayerNorm,
/// GELU MLP, each projection a `Conv1D` (`[in, out]`) with a bias.
pub fn block(cfg: &Gpt2Config, index: usize) -> Block {
    block_with(cfg, index, &Arc::default())
}

/// [`block`] with LoRA `adapters` on the linear layers they name.
pub fn block_with(cfg: &Gpt2Config, index: usize, adapters: &Arc<Adapters>) -> Block {
    let (c, eps) = (cfg.n_embd, cfg.layer_norm_epsilon);
    let std = normal(cfg.initializer_range);
    // GPT-2 scales residual projections by 1/sqrt(2 * n_layer).
    let proj_std = normal(cfg.initializer_range / (2.0 * cfg.n_layer as f32).sqrt());
    let lin = |d_in, d_out| Linear {
        d_in,
        d_out,
        layout: WeightLayout::InOut,
    };
    let mut p = ParamList::new(format!("transformer.h.{index}.")).with_adapters(adapters);
    let norm1 = p.layer_norm("ln_1", c, eps);
    let c_attn = p.dense("attn.c_attn", lin(c, 3 * c), std, true);
    let o = p.dense("attn.c_proj", lin(c, c), proj_std, true);
    let norm2 = p.layer_norm("ln_2", c, eps);
    let fc = p.dense("mlp.c_fc", lin(c, 4 * c), std, true);
    let proj = p.dense("mlp.c_proj", lin(4 * c, c), proj_std, true);
    let attn = Attention {
        qkv: vec![c_attn],
        o,
        q_heads: cfg.n_head,
        kv_heads: cfg.n_head,
        head_dim: cfg.head_dim(),
        rope: None,
        pdrop: cfg.attn_pdrop,
    };
    Block {
        params: p,
        width: c,
        norm1,
        attn,
        norm2,
        mlp: Mlp::Gelu { fc, proj },
        resid_pdrop: cfg.resid_pdrop,
    }
}

/// The linear layers LoRA can target, by Hugging Face module name (`Conv1D`s, and the tied
/// `lm_head` as the output head).
pub fn linear_sites(cfg: &Gpt2Config) -> Vec<crate::nn::peft::LinearSite> {
    let c = cfg.n_embd;
    let site = crate::nn::peft::LinearSite::new;
    let mut out = Vec::new();
    for b in 0..cfg.n_layer {
        let at = |m: &str| format!("transformer.h.{b}.{m}");
        out.push(site(at("attn.c_attn"), (c, 3 * c), false));
        out.push(site(at("attn.c_proj"), (c, c), false));
        out.push(site(at("mlp.c_fc"), (c, 4 * c), false));
        out.push(site(at("mlp.c_proj"), (4 * c, c), false));
    }
    out.push(site("lm_head".into(), (c, cfg.vocab_size), true));
    out
}

/// `head`: `transformer.ln_f`, then the LM head tied to `wte`.
pub fn head(cfg: &Gpt2Config) -> LmHead {
    let mut p = ParamList::new("transformer.");
    let norm = p.layer_norm("ln_f", cfg.n_embd, cfg.layer_norm_epsilon);
    LmHead::new(p, norm, (cfg.n_embd, cfg.vocab_size), None)
}

fn normal(std: f32) -> Init {
    Init::Normal { std }
}

/// Builds the model. It holds no device: the engine (or whoever calls the modules) passes
/// the backend in each call's [`crate::nn::Ctx`], so one model runs on any device.
pub fn build(cfg: &Gpt2Config) -> Result<Model> {
    build_with(cfg, &Adapters::default())
}

/// [`build`] with LoRA `adapters` on the linear layers they name (Hugging Face module names);
/// an adapter whose layer this model lacks is an error.
pub fn build_with(cfg: &Gpt2Config, adapters: &Adapters) -> Result<Model> {
    cfg.validate()?;
    let plan = Arc::new(adapters.clone());
    let wte = ParamSpec {
        name: "transformer.wte.weight".into(),
        shape: vec![cfg.vocab_size, cfg.n_embd],
        init: normal(cfg.initializer_range),
    };
    let blocks = (0..cfg.n_layer)
        .map(|i| block_with(cfg, i, &plan))
        .collect();
    let model = decoder(Some(wte), embed(cfg), ("h", blocks), head(cfg));
    adapters.check_placed(&model)?;
    Ok(model)
}
