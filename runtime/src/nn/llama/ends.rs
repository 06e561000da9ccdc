//! Llama's first and last units: token embedding, and final RMSNorm + LM head + summed
//! cross-entropy. With tied embeddings the table is the unit's last (shared) parameter.

use super::LlamaConfig;
use crate::backend::{Accumulate, Backend, HeadShape, MemoryModel};
use crate::nn::linear::{Linear, WeightLayout};
use crate::nn::saved::{saved_struct, take};
use crate::nn::{
    act, check_rows, check_tokens, stats, Ctx, Grads, Init, Module, ParamSpec, Params, Transients,
};
use crate::tensor::{DType, Storage, Tensor, View};
use crate::{Error, Result};

saved_struct!(
    /// The embedding keeps nothing; the marker proves forward ran.
    EmbedSaved {}
);

saved_struct!(
    /// What the head keeps: its input, RMSNorm stats and output, and the loss's own state.
    HeadSaved { x, rstd, normed, loss_state }
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

/// Refuses a sequence longer than Mistral's attention window: windowed attention is not
/// implemented, and within the window it is full causal attention.
fn check_window(cfg: &LlamaConfig, seq: usize) -> Result<()> {
    match cfg.sliding_window {
        Some(w) if seq > w => Err(Error::Invalid(format!(
            "sequence length {seq} exceeds the model's sliding_window {w}: sliding-window \
             attention is not implemented (within the window it is full causal attention); \
             use a sequence length of at most {w}"
        ))),
        _ => Ok(()),
    }
}

/// `embed`: `embed_tokens[token]`.
pub struct Embed {
    cfg: LlamaConfig,
}

impl Embed {
    /// Element counts of the views this unit needs, in `Params` order.
    fn lens(&self) -> Vec<usize> {
        vec![self.cfg.vocab_size * self.cfg.hidden_size]
    }

    /// The embedding unit for `cfg`.
    pub fn new(cfg: LlamaConfig) -> Self {
        Self { cfg }
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
        check_window(&self.cfg, ctx.batch.seq)?;
        let mut out = act(ctx.be, b * t * h)?;
        ctx.be.embedding_forward(
            ctx.tokens(),
            p.get(0),
            h,
            out.view_mut(),
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
        ctx.be
            .embedding_backward(ctx.tokens(), grad_output.view(), h, gr.get_mut(0))?;
        Ok(Tensor::default())
    }

    fn saved_bytes(&self, _batch: usize, _seq: usize, _m: &MemoryModel) -> usize {
        0
    }

    fn output_bytes(&self, batch: usize, seq: usize, m: &MemoryModel) -> usize {
        m.act_bytes(batch * seq * self.cfg.hidden_size)
    }
}

/// `head`: `model.norm`, logits `= norm(x) · lm_headᵀ`, and the summed cross-entropy.
pub struct Head {
    cfg: LlamaConfig,
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
    pub fn new(cfg: LlamaConfig) -> Self {
        Self { cfg }
    }

    fn lm(&self) -> Linear {
        Linear {
            d_in: self.cfg.hidden_size,
            d_out: self.cfg.vocab_size,
            layout: WeightLayout::OutIn,
        }
    }

    fn head_shape(&self, rows: usize) -> HeadShape {
        HeadShape {
            rows,
            dim: self.cfg.hidden_size,
            vocab: self.cfg.vocab_size,
        }
    }

    /// `model.norm` of `[rows, hidden]` states: `[rstd, normed]`.
    fn final_norm(&self, be: &dyn Backend, p: &Params<'_>, x: View<'_>) -> Result<[Storage; 2]> {
        let (h, n) = (self.cfg.hidden_size, x.len() / self.cfg.hidden_size.max(1));
        let (mut rstd, mut normed) = (stats(be, n)?, act(be, n * h)?);
        be.rmsnorm_forward(
            x,
            p.get(0),
            self.cfg.rms_norm_eps,
            normed.view_mut(),
            rstd.view_mut(),
        )?;
        Ok([rstd, normed])
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
        let (h, be) = (self.cfg.hidden_size, ctx.be);
        check_tokens(ctx.batch, usize::MAX)?;
        let n = check_rows("llama head", input, ctx.batch.batch * ctx.batch.seq, h)?;
        let [rstd, normed] = self.final_norm(be, p, input.view())?;
        let shape = self.head_shape(n);
        let out =
            be.head_loss_forward(shape, normed.view(), p.get(1), ctx.targets(), ctx.training)?;
        if let (true, Some(loss_state)) = (ctx.training, out.saved) {
            *ctx.saved = Some(Box::new(HeadSaved {
                x: be.copy(input.view())?,
                rstd,
                normed,
                loss_state,
            }));
        }
        Tensor::new(vec![1], out.loss)
    }

    fn predict(
        &self,
        ctx: &mut Ctx<'_>,
        p: &Params<'_>,
        input: &Tensor,
    ) -> Result<Option<Vec<u32>>> {
        let (h, v, be) = (self.cfg.hidden_size, self.cfg.vocab_size, ctx.be);
        let n = input.numel() / h.max(1);
        check_rows("llama head predict", input, n, h)?;
        let [_, normed] = self.final_norm(be, p, input.view())?;
        let mut logits = act(be, n * v)?;
        self.lm()
            .forward(be, normed.view(), p.get(1), None, logits.view_mut())?;
        Ok(Some(be.argmax_rows(logits.view(), v)?))
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
        let (h, be) = (self.cfg.hidden_size, ctx.be);
        crate::nn::check_same_batch("head", s.x.len(), ctx.batch, h)?;
        let n = s.x.len() / h;
        let shape = self.head_shape(n);
        let mut dnormed = act(be, n * h)?;
        be.head_loss_backward(
            shape,
            s.normed.view(),
            p.get(1),
            ctx.targets(),
            s.loss_state,
            g,
            dnormed.view_mut(),
            gr.get_mut(1),
        )?;
        let mut dx = act(be, n * h)?;
        be.rmsnorm_backward(
            s.x.view(),
            p.get(0),
            s.rstd.view(),
            dnormed.view(),
            dx.view_mut(),
            gr.get_mut(0),
        )?;
        for dead in [dnormed, s.x, s.rstd, s.normed] {
            be.recycle(dead);
        }
        Tensor::new(vec![ctx.batch.batch, ctx.batch.seq, h], dx)
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
        let (h, be) = (self.cfg.hidden_size, ctx.be);
        check_tokens(ctx.batch, usize::MAX)?;
        let n = check_rows("llama head", input, ctx.batch.batch * ctx.batch.seq, h)?;
        let [rstd, normed] = self.final_norm(be, p, input.view())?;
        let mut dnormed = act(be, n * h)?;
        let loss = be.head_loss_fused(
            self.head_shape(n),
            normed.view(),
            p.get(1),
            ctx.targets(),
            g,
            dnormed.view_mut(),
            gr.get_mut(1),
        )?;
        let mut dx = act(be, n * h)?;
        be.rmsnorm_backward(
            input.view(),
            p.get(0),
            rstd.view(),
            dnormed.view(),
            dx.view_mut(),
            gr.get_mut(0),
        )?;
        for dead in [dnormed, rstd, normed] {
            be.recycle(dead);
        }
        let dx = Tensor::new(vec![ctx.batch.batch, ctx.batch.seq, h], dx)?;
        Ok((Tensor::new(vec![1], loss)?, dx))
    }

    fn forward_backward_bytes(&self, batch: usize, seq: usize, m: &MemoryModel) -> usize {
        let (n, h) = (batch * seq, self.cfg.hidden_size);
        // normed and its gradient, the f32 per-row rstd, the fused loss's own buffers.
        2 * m.act_bytes(n * h) + m.bytes(DType::F32, n) + m.head_fused_transient(self.head_shape(n))
    }

    fn saved_bytes(&self, batch: usize, seq: usize, m: &MemoryModel) -> usize {
        let (n, h) = (batch * seq, self.cfg.hidden_size);
        // x and normed, the f32 per-row rstd, the loss's own state.
        let shape = self.head_shape(n);
        2 * m.act_bytes(n * h) + m.bytes(DType::F32, n) + m.head_saved(shape)
    }

    fn output_bytes(&self, _batch: usize, _seq: usize, m: &MemoryModel) -> usize {
        m.bytes(DType::F32, 1)
    }

    fn transient_bytes(&self, batch: usize, seq: usize, m: &MemoryModel) -> Transients {
        let (n, h) = (batch * seq, self.cfg.hidden_size);
        let shape = self.head_shape(n);
        let (forward, backward) = m.head_transient(shape);
        // Backward also holds dnormed beside the loss's own buffers.
        Transients {
            forward,
            backward: backward + m.act_bytes(n * h),
        }
    }
}
