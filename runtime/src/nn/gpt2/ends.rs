//! GPT-2's first and last units: token + position embedding, and final LayerNorm + tied LM
//! head + summed cross-entropy.

use std::sync::Arc;

use super::Gpt2Config;
use crate::backend::{rng, Accumulate, Backend};
use crate::nn::linear::{Linear, WeightLayout};
use crate::nn::saved::{saved_struct, take};
use crate::nn::{check_rows, check_tokens, Ctx, Grads, Init, Module, ParamSpec, Params};
use crate::tensor::Tensor;
use crate::Result;

const SITE_EMBED: u64 = 0;

saved_struct!(
    /// The embedding keeps nothing (tokens come from the batch); the marker proves forward ran.
    EmbedSaved {}
);

saved_struct!(
    /// What the head keeps: its input, LayerNorm stats and output, and the softmax.
    HeadSaved { x, mean, rstd, lnf, probs }
);

/// `embed`: `wte[token] + wpe[position]`, then embedding dropout.
pub struct Embed {
    cfg: Gpt2Config,
    be: Arc<dyn Backend>,
}

impl Embed {
    /// Element counts of the views this unit needs, in `Params` order.
    fn lens(&self) -> Vec<usize> {
        vec![
            self.cfg.n_positions * self.cfg.n_embd,
            self.cfg.vocab_size * self.cfg.n_embd,
        ]
    }

    /// The embedding unit for `cfg`.
    pub fn new(cfg: Gpt2Config, be: Arc<dyn Backend>) -> Self {
        Self { cfg, be }
    }

    fn positions(&self, batch: usize, seq: usize) -> Vec<u32> {
        (0..batch * seq).map(|i| (i % seq) as u32).collect()
    }
}

impl Module for Embed {
    fn param_specs(&self) -> Vec<ParamSpec> {
        vec![ParamSpec {
            name: "transformer.wpe.weight".into(),
            shape: vec![self.cfg.n_positions, self.cfg.n_embd],
            init: Init::Normal {
                std: self.cfg.initializer_range,
            },
        }]
    }

    fn forward(&self, ctx: &mut Ctx<'_>, p: &Params<'_>, _input: &Tensor) -> Result<Tensor> {
        crate::nn::check_views("embed", p, None, &self.lens())?;
        let (b, t, c) = (ctx.batch.batch, ctx.batch.seq, self.cfg.n_embd);
        check_tokens(ctx.batch, self.cfg.n_positions)?;
        let mut out = vec![0.0; b * t * c];
        let be = &*self.be;
        be.embedding_forward(
            &ctx.batch.tokens,
            p.get(1),
            c,
            &mut out,
            Accumulate::Overwrite,
        )?;
        let pos = self.positions(b, t);
        be.embedding_forward(&pos, p.get(0), c, &mut out, Accumulate::Add)?;
        be.dropout(
            rng::derive(ctx.rng_seed, SITE_EMBED),
            self.cfg.embd_pdrop,
            &mut out,
        );
        if ctx.training {
            *ctx.saved = Some(Box::new(EmbedSaved {}));
        }
        Tensor::new(vec![b, t, c], out)
    }

    fn backward(
        &self,
        ctx: &mut Ctx<'_>,
        p: &Params<'_>,
        gr: &mut Grads<'_>,
        grad_output: &Tensor,
    ) -> Result<Tensor> {
        crate::nn::check_views("embed", p, Some(gr), &self.lens())?;
        take::<EmbedSaved>(ctx.saved, "embed")?;
        let (b, t, c) = (ctx.batch.batch, ctx.batch.seq, self.cfg.n_embd);
        check_rows("gpt2 embed backward", grad_output, b * t, c)?;
        let mut g = grad_output.data.clone();
        let be = &*self.be;
        be.dropout(
            rng::derive(ctx.rng_seed, SITE_EMBED),
            self.cfg.embd_pdrop,
            &mut g,
        );
        be.embedding_backward(&ctx.batch.tokens, &g, c, gr.get_mut(1));
        be.embedding_backward(&self.positions(b, t), &g, c, gr.get_mut(0));
        Ok(Tensor::default())
    }

    fn saved_bytes(&self, _batch: usize, _seq: usize) -> usize {
        0
    }

    fn output_bytes(&self, batch: usize, seq: usize) -> usize {
        batch * seq * self.cfg.n_embd * 4
    }
}

/// `head`: `ln_f`, logits `= ln_f(x) · wteᵀ`, and the summed token cross-entropy.
pub struct Head {
    cfg: Gpt2Config,
    be: Arc<dyn Backend>,
}

impl Head {
    /// Element counts of the views this unit needs, in `Params` order.
    fn lens(&self) -> Vec<usize> {
        vec![
            self.cfg.n_embd,
            self.cfg.n_embd,
            self.cfg.vocab_size * self.cfg.n_embd,
        ]
    }

    /// The head unit for `cfg`.
    pub fn new(cfg: Gpt2Config, be: Arc<dyn Backend>) -> Self {
        Self { cfg, be }
    }

    fn lm(&self) -> Linear {
        Linear {
            d_in: self.cfg.n_embd,
            d_out: self.cfg.vocab_size,
            layout: WeightLayout::OutIn,
        }
    }

    /// Logits `[rows, vocab]` for hidden states `[rows, n_embd]`, plus LayerNorm mean,
    /// rstd and output (params: `ln_f.weight`, `ln_f.bias`, `wte`).
    fn logits_parts(&self, p: &Params<'_>, x: &[f32]) -> Result<[Vec<f32>; 4]> {
        let (c, n) = (self.cfg.n_embd, x.len() / self.cfg.n_embd);
        let (mut mean, mut rstd, mut lnf) = (vec![0.0; n], vec![0.0; n], vec![0.0; n * c]);
        let eps = self.cfg.layer_norm_epsilon;
        self.be
            .layernorm_forward(x, p.get(0), p.get(1), eps, &mut lnf, &mut mean, &mut rstd);
        let mut logits = vec![0.0; n * self.cfg.vocab_size];
        self.lm()
            .forward(&*self.be, &lnf, p.get(2), None, &mut logits)?;
        Ok([logits, mean, rstd, lnf])
    }

    /// Logits `[rows, vocab_size]` for hidden states `[.., n_embd]` (inference and tests).
    pub fn logits(&self, p: &Params<'_>, input: &Tensor) -> Result<Tensor> {
        let rows = input.numel() / self.cfg.n_embd.max(1);
        check_rows("gpt2 head logits", input, rows, self.cfg.n_embd)?;
        let [logits, ..] = self.logits_parts(p, &input.data)?;
        Tensor::new(vec![rows, self.cfg.vocab_size], logits)
    }
}

impl Module for Head {
    fn param_specs(&self) -> Vec<ParamSpec> {
        let c = self.cfg.n_embd;
        vec![
            ParamSpec {
                name: "transformer.ln_f.weight".into(),
                shape: vec![c],
                init: Init::Ones,
            },
            ParamSpec {
                name: "transformer.ln_f.bias".into(),
                shape: vec![c],
                init: Init::Zeros,
            },
        ]
    }

    fn forward(&self, ctx: &mut Ctx<'_>, p: &Params<'_>, input: &Tensor) -> Result<Tensor> {
        crate::nn::check_views("head", p, None, &self.lens())?;
        let (b, t) = (ctx.batch.batch, ctx.batch.seq);
        check_tokens(ctx.batch, usize::MAX)?;
        check_rows("gpt2 head", input, b * t, self.cfg.n_embd)?;
        let [mut probs, mean, rstd, lnf] = self.logits_parts(p, &input.data)?;
        let v = self.cfg.vocab_size;
        let loss = self
            .be
            .cross_entropy_forward(&mut probs, v, &ctx.batch.targets)?;
        if ctx.training {
            let x = input.data.clone();
            *ctx.saved = Some(Box::new(HeadSaved {
                x,
                mean,
                rstd,
                lnf,
                probs,
            }));
        }
        Ok(Tensor::scalar(loss as f32))
    }

    fn backward(
        &self,
        ctx: &mut Ctx<'_>,
        p: &Params<'_>,
        gr: &mut Grads<'_>,
        grad_output: &Tensor,
    ) -> Result<Tensor> {
        crate::nn::check_views("head", p, Some(gr), &self.lens())?;
        let s = take::<HeadSaved>(ctx.saved, "head")?;
        let g = crate::nn::loss_grad(grad_output)?;
        let (c, v, be) = (self.cfg.n_embd, self.cfg.vocab_size, &*self.be);
        crate::nn::check_same_batch("head", s.x.len(), ctx.batch, c)?;
        let n = s.x.len() / c;
        let mut dlogits = s.probs;
        be.cross_entropy_backward(&mut dlogits, v, &ctx.batch.targets, g);
        self.lm()
            .backward_params(be, &s.lnf, &dlogits, gr.get_mut(2), None)?;
        let mut dlnf = vec![0.0; n * c];
        self.lm()
            .backward_input(be, &dlogits, p.get(2), &mut dlnf, Accumulate::Overwrite)?;
        drop(dlogits);
        let mut dx = vec![0.0; n * c];
        let (g0, g1) = gr.pair_mut(0, 1);
        be.layernorm_backward(&s.x, p.get(0), &s.mean, &s.rstd, &dlnf, &mut dx, g0, g1);
        Tensor::new(vec![ctx.batch.batch, ctx.batch.seq, c], dx)
    }

    fn saved_bytes(&self, batch: usize, seq: usize) -> usize {
        let n = batch * seq;
        (2 * n * self.cfg.n_embd + 2 * n + n * self.cfg.vocab_size) * 4
    }

    fn output_bytes(&self, _batch: usize, _seq: usize) -> usize {
        4
    }

    fn predict(
        &self,
        _ctx: &mut Ctx<'_>,
        p: &Params<'_>,
        input: &Tensor,
    ) -> Result<Option<Vec<u32>>> {
        let logits = self.logits(p, input)?;
        Ok(Some(crate::nn::module::argmax_rows(
            &logits.data,
            self.cfg.vocab_size,
        )))
    }
}
