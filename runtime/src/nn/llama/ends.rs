//! Llama's first and last units: token embedding, and final RMSNorm + LM head + summed
//! cross-entropy. With tied embeddings the table is the unit's last (shared) parameter.

use std::sync::Arc;

use super::LlamaConfig;
use crate::backend::{Accumulate, Backend};
use crate::nn::linear::{Linear, WeightLayout};
use crate::nn::saved::{saved_struct, take};
use crate::nn::{check_rows, check_tokens, Ctx, Grads, Init, Module, ParamSpec, Params};
use crate::tensor::Tensor;
use crate::Result;

saved_struct!(
    /// The embedding keeps nothing; the marker proves forward ran.
    EmbedSaved {}
);

saved_struct!(
    /// What the head keeps: its input, RMSNorm stats and output, and the softmax.
    HeadSaved { x, rstd, normed, probs }
);

fn table_spec(cfg: &LlamaConfig, name: &str) -> ParamSpec {
    ParamSpec {
        name: name.into(),
        shape: vec![cfg.vocab_size, cfg.hidden_size],
        init: Init::Normal {
            std: cfg.initializer_range,
        },
    }
}

/// `embed`: `embed_tokens[token]`.
pub struct Embed {
    cfg: LlamaConfig,
    be: Arc<dyn Backend>,
}

impl Embed {
    /// Element counts of the views this unit needs, in `Params` order.
    fn lens(&self) -> Vec<usize> {
        vec![self.cfg.vocab_size * self.cfg.hidden_size]
    }

    /// The embedding unit for `cfg`.
    pub fn new(cfg: LlamaConfig, be: Arc<dyn Backend>) -> Self {
        Self { cfg, be }
    }
}

impl Module for Embed {
    fn param_specs(&self) -> Vec<ParamSpec> {
        if self.cfg.tie_word_embeddings {
            vec![]
        } else {
            vec![table_spec(&self.cfg, "model.embed_tokens.weight")]
        }
    }

    fn forward(&self, ctx: &mut Ctx<'_>, p: &Params<'_>, _input: &Tensor) -> Result<Tensor> {
        crate::nn::check_views("embed", p, None, &self.lens())?;
        let (b, t, h) = (ctx.batch.batch, ctx.batch.seq, self.cfg.hidden_size);
        check_tokens(ctx.batch, self.cfg.max_position_embeddings)?;
        let mut out = vec![0.0; b * t * h];
        self.be.embedding_forward(
            &ctx.batch.tokens,
            p.get(0),
            h,
            &mut out,
            Accumulate::Overwrite,
        )?;
        if ctx.training {
            *ctx.saved = Some(Box::new(EmbedSaved {}));
        }
        Tensor::new(vec![b, t, h], out)
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
        let (b, t, h) = (ctx.batch.batch, ctx.batch.seq, self.cfg.hidden_size);
        check_rows("llama embed backward", grad_output, b * t, h)?;
        self.be
            .embedding_backward(&ctx.batch.tokens, &grad_output.data, h, gr.get_mut(0));
        Ok(Tensor::default())
    }

    fn saved_bytes(&self, _batch: usize, _seq: usize) -> usize {
        0
    }

    fn output_bytes(&self, batch: usize, seq: usize) -> usize {
        batch * seq * self.cfg.hidden_size * 4
    }
}

/// `head`: `model.norm`, logits `= norm(x) · lm_headᵀ`, and the summed cross-entropy.
pub struct Head {
    cfg: LlamaConfig,
    be: Arc<dyn Backend>,
}

impl Head {
    /// Element counts of the views this unit needs, in `Params` order.
    fn lens(&self) -> Vec<usize> {
        vec![
            self.cfg.hidden_size,
            self.cfg.vocab_size * self.cfg.hidden_size,
        ]
    }

    /// The head unit for `cfg`.
    pub fn new(cfg: LlamaConfig, be: Arc<dyn Backend>) -> Self {
        Self { cfg, be }
    }

    fn lm(&self) -> Linear {
        Linear {
            d_in: self.cfg.hidden_size,
            d_out: self.cfg.vocab_size,
            layout: WeightLayout::OutIn,
        }
    }
}

impl Module for Head {
    fn param_specs(&self) -> Vec<ParamSpec> {
        let h = self.cfg.hidden_size;
        let norm = ParamSpec {
            name: "model.norm.weight".into(),
            shape: vec![h],
            init: Init::Ones,
        };
        if self.cfg.tie_word_embeddings {
            vec![norm]
        } else {
            vec![norm, table_spec(&self.cfg, "lm_head.weight")]
        }
    }

    fn forward(&self, ctx: &mut Ctx<'_>, p: &Params<'_>, input: &Tensor) -> Result<Tensor> {
        crate::nn::check_views("head", p, None, &self.lens())?;
        let (h, v, be) = (self.cfg.hidden_size, self.cfg.vocab_size, &*self.be);
        check_tokens(ctx.batch, usize::MAX)?;
        let n = check_rows("llama head", input, ctx.batch.batch * ctx.batch.seq, h)?;
        let (mut rstd, mut normed) = (vec![0.0; n], vec![0.0; n * h]);
        be.rmsnorm_forward(
            &input.data,
            p.get(0),
            self.cfg.rms_norm_eps,
            &mut normed,
            &mut rstd,
        );
        let mut probs = vec![0.0; n * v];
        self.lm().forward(be, &normed, p.get(1), None, &mut probs)?;
        let loss = be.cross_entropy_forward(&mut probs, v, &ctx.batch.targets)?;
        if ctx.training {
            let x = input.data.clone();
            *ctx.saved = Some(Box::new(HeadSaved {
                x,
                rstd,
                normed,
                probs,
            }));
        }
        Ok(Tensor::scalar(loss as f32))
    }

    fn predict(
        &self,
        _ctx: &mut Ctx<'_>,
        p: &Params<'_>,
        input: &Tensor,
    ) -> Result<Option<Vec<u32>>> {
        let (h, v, be) = (self.cfg.hidden_size, self.cfg.vocab_size, &*self.be);
        let n = input.numel() / h.max(1);
        check_rows("llama head predict", input, n, h)?;
        let (mut rstd, mut normed) = (vec![0.0; n], vec![0.0; n * h]);
        be.rmsnorm_forward(
            &input.data,
            p.get(0),
            self.cfg.rms_norm_eps,
            &mut normed,
            &mut rstd,
        );
        let mut logits = vec![0.0; n * v];
        self.lm()
            .forward(be, &normed, p.get(1), None, &mut logits)?;
        Ok(Some(crate::nn::module::argmax_rows(&logits, v)))
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
        let (h, v, be) = (self.cfg.hidden_size, self.cfg.vocab_size, &*self.be);
        crate::nn::check_same_batch("head", s.x.len(), ctx.batch, h)?;
        let n = s.x.len() / h;
        let mut dlogits = s.probs;
        be.cross_entropy_backward(&mut dlogits, v, &ctx.batch.targets, g);
        self.lm()
            .backward_params(be, &s.normed, &dlogits, gr.get_mut(1), None)?;
        let mut dnormed = vec![0.0; n * h];
        self.lm()
            .backward_input(be, &dlogits, p.get(1), &mut dnormed, Accumulate::Overwrite)?;
        drop(dlogits);
        let mut dx = vec![0.0; n * h];
        be.rmsnorm_backward(&s.x, p.get(0), &s.rstd, &dnormed, &mut dx, gr.get_mut(0));
        Tensor::new(vec![ctx.batch.batch, ctx.batch.seq, h], dx)
    }

    fn saved_bytes(&self, batch: usize, seq: usize) -> usize {
        let n = batch * seq;
        (2 * n * self.cfg.hidden_size + n + n * self.cfg.vocab_size) * 4
    }

    fn output_bytes(&self, _batch: usize, _seq: usize) -> usize {
        4
    }
}
