//! The LM head every decoder ends with: the final norm, the output projection (the embedding
//! table when tied, else its own `[vocab, dim]` weight) and the summed token cross-entropy,
//! fused with its backward in training.

use super::norm::NormStats;
use super::{Norm, ParamList};
use crate::backend::{Backend, HeadShape};
use crate::nn::linear::{Linear, WeightLayout};
use crate::nn::saved::{saved_struct, take, Held};
use crate::nn::{act, check_rows, check_tokens, Ctx, Grads, Init, Module, ParamSpec, Params};
use crate::tensor::{Storage, Tensor, View};
use crate::Result;

saved_struct!(
    /// What the head keeps: its input, the norm's statistics and output, and the loss's own
    /// state (the CPU keeps the softmax; a device may keep per-row statistics only).
    HeadSaved { x: Storage, stats: NormStats, normed: Storage, loss_state: Storage }
);

/// `head`: `norm`, logits `= norm(x) · tableᵀ`, and the summed cross-entropy.
#[derive(Debug, Clone)]
pub struct LmHead {
    params: ParamList,
    norm: Norm,
    dim: usize,
    vocab: usize,
    /// The table's index in the unit's `Params`.
    table: usize,
}

impl LmHead {
    /// A head over `dim`-wide states and `vocab` tokens whose `norm` is declared in `params`;
    /// `own_table` (name and initialiser) declares the output projection's `[vocab, dim]`
    /// weight after it, and `None` reads the unit's first shared parameter (tied embeddings).
    pub fn new(
        mut params: ParamList,
        norm: Norm,
        (dim, vocab): (usize, usize),
        own_table: Option<(&str, Init)>,
    ) -> Self {
        let table = params.table(own_table, (vocab, dim));
        Self {
            params,
            norm,
            dim,
            vocab,
            table,
        }
    }

    fn lm(&self) -> Linear {
        Linear {
            d_in: self.dim,
            d_out: self.vocab,
            layout: WeightLayout::OutIn,
        }
    }

    fn head_shape(&self, rows: usize) -> HeadShape {
        HeadShape {
            rows,
            dim: self.dim,
            vocab: self.vocab,
        }
    }

    /// The final norm of `[rows, dim]` states: its statistics and output.
    fn final_norm(
        &self,
        be: &dyn Backend,
        p: &Params<'_>,
        x: View<'_>,
    ) -> Result<(NormStats, Storage)> {
        let n = x.len() / self.dim.max(1);
        let (mut st, mut normed) = (self.norm.stats(be, n)?, act(be, n * self.dim)?);
        self.norm.forward(be, p, x, normed.view_mut(), &mut st)?;
        Ok((st, normed))
    }

    /// Logits `[rows, vocab]` for hidden states `[.., dim]` (inference and tests).
    pub fn logits(&self, be: &dyn Backend, p: &Params<'_>, input: &Tensor) -> Result<Tensor> {
        let rows = input.numel() / self.dim.max(1);
        check_rows("head logits", input, rows, self.dim)?;
        let (_, normed) = self.final_norm(be, p, input.view())?;
        let mut logits = act(be, rows * self.vocab)?;
        let table = p.get(self.table);
        self.lm()
            .forward(be, normed.view(), table, None, logits.view_mut())?;
        Tensor::new(vec![rows, self.vocab], logits)
    }
}

impl Module for LmHead {
    fn param_specs(&self) -> Vec<ParamSpec> {
        self.params.specs().to_vec()
    }

    fn forward(&self, ctx: &mut Ctx<'_>, p: &Params<'_>, input: &Tensor) -> Result<Tensor> {
        self.params.check("head", p, None)?;
        let (b, t, be) = (ctx.batch.batch, ctx.batch.seq, ctx.be);
        check_tokens(ctx.batch, usize::MAX)?;
        let n = check_rows("head", input, b * t, self.dim)?;
        let (stats, normed) = self.final_norm(be, p, input.view())?;
        let (shape, table) = (self.head_shape(n), p.get(self.table));
        let out = be.head_loss_forward(shape, normed.view(), table, ctx.targets(), ctx.training)?;
        if let (true, Some(loss_state)) = (ctx.training, out.saved) {
            *ctx.saved = Some(Box::new(HeadSaved {
                x: be.copy(input.view())?,
                stats,
                normed,
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
        self.params.check("head", p, Some(gr))?;
        let s = take::<HeadSaved>(ctx.saved, "head")?;
        let g = crate::nn::loss_grad(grad_output)?;
        let (d, be) = (self.dim, ctx.be);
        crate::nn::check_same_batch("head", s.x.len(), ctx.batch, d)?;
        let n = s.x.len() / d;
        let mut dnormed = act(be, n * d)?;
        be.head_loss_backward(
            self.head_shape(n),
            s.normed.view(),
            p.get(self.table),
            ctx.targets(),
            s.loss_state,
            g,
            dnormed.view_mut(),
            gr.get_mut(self.table),
        )?;
        let mut dx = act(be, n * d)?;
        let (x, dy) = ((s.x.view(), &s.stats), (dnormed.view(), None));
        self.norm.backward(be, (p, gr), x, dy, dx.view_mut())?;
        (dnormed, (s.x, (s.stats, s.normed))).hand_back(be);
        Tensor::new(vec![ctx.batch.batch, ctx.batch.seq, d], dx)
    }

    fn forward_backward(
        &self,
        ctx: &mut Ctx<'_>,
        p: &Params<'_>,
        gr: &mut Grads<'_>,
        input: &Tensor,
        grad_output: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        self.params.check("head", p, Some(gr))?;
        let g = crate::nn::loss_grad(grad_output)?;
        let (b, t, d, be) = (ctx.batch.batch, ctx.batch.seq, self.dim, ctx.be);
        check_tokens(ctx.batch, usize::MAX)?;
        let n = check_rows("head", input, b * t, d)?;
        let (stats, normed) = self.final_norm(be, p, input.view())?;
        let mut dnormed = act(be, n * d)?;
        let loss = be.head_loss_fused(
            self.head_shape(n),
            normed.view(),
            p.get(self.table),
            ctx.targets(),
            g,
            dnormed.view_mut(),
            gr.get_mut(self.table),
        )?;
        let mut dx = act(be, n * d)?;
        let (x, dy) = ((input.view(), &stats), (dnormed.view(), None));
        self.norm.backward(be, (p, gr), x, dy, dx.view_mut())?;
        (dnormed, (stats, normed)).hand_back(be);
        Ok((Tensor::new(vec![1], loss)?, Tensor::new(vec![b, t, d], dx)?))
    }

    fn predict(
        &self,
        ctx: &mut Ctx<'_>,
        p: &Params<'_>,
        input: &Tensor,
    ) -> Result<Option<Vec<u32>>> {
        let logits = self.logits(ctx.be, p, input)?;
        Ok(Some(ctx.be.argmax_rows(logits.view(), self.vocab)?))
    }
}
