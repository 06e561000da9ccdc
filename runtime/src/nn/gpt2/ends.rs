//! GPT-2's first and last units: token + position embedding, and final LayerNorm + tied LM
//! head + summed cross-entropy.

use super::Gpt2Config;
use crate::backend::{rng, Accumulate, Backend, HeadShape, MemoryModel};
use crate::nn::linear::{Linear, WeightLayout};
use crate::nn::saved::{saved_struct, take};
use crate::nn::{
    act, check_rows, check_tokens, stats, Ctx, Grads, Init, Module, ParamSpec, Params, Transients,
};
use crate::tensor::{DType, Storage, Tensor, View};
use crate::Result;

const SITE_EMBED: u64 = 0;

saved_struct!(
    /// The embedding keeps nothing (tokens come from the batch); the marker proves forward ran.
    EmbedSaved {}
);

saved_struct!(
    /// What the head keeps: its input, LayerNorm stats and output, and the loss's own state
    /// (the CPU keeps the softmax; a device may keep per-row statistics only).
    HeadSaved { x, mean, rstd, lnf, loss_state }
);

/// `embed`: `wte[token] + wpe[position]`, then embedding dropout.
pub struct Embed {
    cfg: Gpt2Config,
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
    pub fn new(cfg: Gpt2Config) -> Self {
        Self { cfg }
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
        let be = ctx.be;
        let mut out = act(be, b * t * c)?;
        be.embedding_forward(
            ctx.tokens(),
            p.get(1),
            c,
            out.view_mut(),
            Accumulate::Overwrite,
        )?;
        be.position_forward(p.get(0), b, t, out.view_mut())?;
        be.dropout(
            rng::derive(ctx.rng_seed, SITE_EMBED),
            self.cfg.embd_pdrop,
            out.view_mut(),
        )?;
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
        let be = ctx.be;
        let mut g = be.copy(grad_output.view())?;
        be.dropout(
            rng::derive(ctx.rng_seed, SITE_EMBED),
            self.cfg.embd_pdrop,
            g.view_mut(),
        )?;
        be.embedding_backward(ctx.tokens(), g.view(), c, gr.get_mut(1))?;
        be.position_backward(g.view(), b, t, gr.get_mut(0))?;
        Ok(Tensor::default())
    }

    fn saved_bytes(&self, _batch: usize, _seq: usize, _m: &MemoryModel) -> usize {
        0
    }

    fn output_bytes(&self, batch: usize, seq: usize, m: &MemoryModel) -> usize {
        m.act_bytes(batch * seq * self.cfg.n_embd)
    }

    fn transient_bytes(&self, batch: usize, seq: usize, m: &MemoryModel) -> Transients {
        // Backward drops out a copy of the incoming gradient.
        Transients {
            forward: 0,
            backward: m.act_bytes(batch * seq * self.cfg.n_embd),
        }
    }
}

/// `head`: `ln_f`, logits `= ln_f(x) · wteᵀ`, and the summed token cross-entropy.
pub struct Head {
    cfg: Gpt2Config,
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
    pub fn new(cfg: Gpt2Config) -> Self {
        Self { cfg }
    }

    fn lm(&self) -> Linear {
        Linear {
            d_in: self.cfg.n_embd,
            d_out: self.cfg.vocab_size,
            layout: WeightLayout::OutIn,
        }
    }

    fn head_shape(&self, rows: usize) -> HeadShape {
        HeadShape {
            rows,
            dim: self.cfg.n_embd,
            vocab: self.cfg.vocab_size,
        }
    }

    /// `ln_f` of hidden states `[rows, n_embd]`: `[mean, rstd, lnf]` (params: `ln_f.weight`,
    /// `ln_f.bias`, ...).
    fn final_norm(&self, be: &dyn Backend, p: &Params<'_>, x: View<'_>) -> Result<[Storage; 3]> {
        let (c, n) = (self.cfg.n_embd, x.len() / self.cfg.n_embd);
        let (mut mean, mut rstd, mut lnf) = (stats(be, n)?, stats(be, n)?, act(be, n * c)?);
        let eps = self.cfg.layer_norm_epsilon;
        be.layernorm_forward(
            x,
            p.get(0),
            p.get(1),
            eps,
            lnf.view_mut(),
            mean.view_mut(),
            rstd.view_mut(),
        )?;
        Ok([mean, rstd, lnf])
    }

    /// Logits `[rows, vocab_size]` for hidden states `[.., n_embd]` (inference and tests).
    pub fn logits(&self, be: &dyn Backend, p: &Params<'_>, input: &Tensor) -> Result<Tensor> {
        let rows = input.numel() / self.cfg.n_embd.max(1);
        check_rows("gpt2 head logits", input, rows, self.cfg.n_embd)?;
        let [_, _, lnf] = self.final_norm(be, p, input.view())?;
        let mut logits = act(be, rows * self.cfg.vocab_size)?;
        self.lm()
            .forward(be, lnf.view(), p.get(2), None, logits.view_mut())?;
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
        let n = check_rows("gpt2 head", input, b * t, self.cfg.n_embd)?;
        let be = ctx.be;
        let [mean, rstd, lnf] = self.final_norm(be, p, input.view())?;
        let out = be.head_loss_forward(
            self.head_shape(n),
            lnf.view(),
            p.get(2),
            ctx.targets(),
            ctx.training,
        )?;
        if let (true, Some(loss_state)) = (ctx.training, out.saved) {
            *ctx.saved = Some(Box::new(HeadSaved {
                x: be.copy(input.view())?,
                mean,
                rstd,
                lnf,
                loss_state,
            }));
        }
        Tensor::new(vec![1], out.loss)
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
        let (c, be) = (self.cfg.n_embd, ctx.be);
        crate::nn::check_same_batch("head", s.x.len(), ctx.batch, c)?;
        let n = s.x.len() / c;
        let mut dlnf = act(be, n * c)?;
        be.head_loss_backward(
            self.head_shape(n),
            s.lnf.view(),
            p.get(2),
            ctx.targets(),
            s.loss_state,
            g,
            dlnf.view_mut(),
            gr.get_mut(2),
        )?;
        let mut dx = act(be, n * c)?;
        let (g0, g1) = gr.pair_mut(0, 1);
        be.layernorm_backward(
            s.x.view(),
            p.get(0),
            s.mean.view(),
            s.rstd.view(),
            dlnf.view(),
            dx.view_mut(),
            g0,
            g1,
        )?;
        for dead in [dlnf, s.x, s.mean, s.rstd, s.lnf] {
            be.recycle(dead);
        }
        Tensor::new(vec![ctx.batch.batch, ctx.batch.seq, c], dx)
    }

    fn forward_backward(
        &self,
        ctx: &mut Ctx<'_>,
        p: &Params<'_>,
        gr: &mut Grads<'_>,
        input: &Tensor,
        grad_output: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        crate::nn::check_views("head", p, Some(gr), &self.lens())?;
        let g = crate::nn::loss_grad(grad_output)?;
        let (b, t, c, be) = (ctx.batch.batch, ctx.batch.seq, self.cfg.n_embd, ctx.be);
        check_tokens(ctx.batch, usize::MAX)?;
        let n = check_rows("gpt2 head", input, b * t, c)?;
        let [mean, rstd, lnf] = self.final_norm(be, p, input.view())?;
        let mut dlnf = act(be, n * c)?;
        let loss = be.head_loss_fused(
            self.head_shape(n),
            lnf.view(),
            p.get(2),
            ctx.targets(),
            g,
            dlnf.view_mut(),
            gr.get_mut(2),
        )?;
        let mut dx = act(be, n * c)?;
        let (g0, g1) = gr.pair_mut(0, 1);
        be.layernorm_backward(
            input.view(),
            p.get(0),
            mean.view(),
            rstd.view(),
            dlnf.view(),
            dx.view_mut(),
            g0,
            g1,
        )?;
        for dead in [dlnf, mean, rstd, lnf] {
            be.recycle(dead);
        }
        Ok((Tensor::new(vec![1], loss)?, Tensor::new(vec![b, t, c], dx)?))
    }

    fn forward_backward_bytes(&self, batch: usize, seq: usize, m: &MemoryModel) -> usize {
        let n = batch * seq;
        // lnf and its gradient, two f32 per-row stats, the fused loss's own buffers.
        2 * m.act_bytes(n * self.cfg.n_embd)
            + 2 * m.bytes(DType::F32, n)
            + m.head_fused_transient(self.head_shape(n))
    }

    fn saved_bytes(&self, batch: usize, seq: usize, m: &MemoryModel) -> usize {
        let n = batch * seq;
        // x and lnf, two f32 per-row stats, the loss's own state.
        2 * m.act_bytes(n * self.cfg.n_embd)
            + 2 * m.bytes(DType::F32, n)
            + m.head_saved(self.head_shape(n))
    }

    fn output_bytes(&self, _batch: usize, _seq: usize, m: &MemoryModel) -> usize {
        m.bytes(DType::F32, 1)
    }

    fn transient_bytes(&self, batch: usize, seq: usize, m: &MemoryModel) -> Transients {
        let n = batch * seq;
        let (forward, backward) = m.head_transient(self.head_shape(n));
        // Backward also holds dlnf beside the loss's own buffers.
        Transients {
            forward,
            backward: backward + m.act_bytes(n * self.cfg.n_embd),
        }
    }

    fn predict(
        &self,
        ctx: &mut Ctx<'_>,
        p: &Params<'_>,
        input: &Tensor,
    ) -> Result<Option<Vec<u32>>> {
        let logits = self.logits(ctx.be, p, input)?;
        Ok(Some(
            ctx.be.argmax_rows(logits.view(), self.cfg.vocab_size)?,
        ))
    }
}
