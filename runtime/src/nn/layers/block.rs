//! The residual block every decoder here is made of: `x2 = x + o(attn(norm1(x)))`, then
//! `out = x2 + down(mlp(norm2(x2)))`, with optional dropout on both branches.

use super::attention::AttnActs;
use super::lora::Draw;
use super::mlp::MlpActs;
use super::norm::NormStats;
use super::{reuse, Attention, Mlp, Norm, ParamList};
use crate::backend::{rng, Accumulate, AttentionShape};
use crate::nn::saved::{saved_struct, take, Held};
use crate::nn::{act, check_rows, Ctx, Grads, Module, ParamSpec, Params};
use crate::tensor::{Storage, Tensor, View, ViewMut};
use crate::Result;

/// Dropout site tags within a block.
const SITE_ATTN: u64 = 1;
const SITE_MLP: u64 = 2;
const SITE_PROBS: u64 = 3;

saved_struct!(
    /// What a block keeps for backward: its input, each norm's statistics and output, the
    /// attention's and the MLP's activations, and the residual stream between them.
    BlockSaved {
        x: Storage,
        s1: NormStats,
        n1: Storage,
        attn: AttnActs,
        x2: Storage,
        s2: NormStats,
        n2: Storage,
        mlp: MlpActs,
    }
);

/// A pre-norm transformer block: one unit of a decoder.
#[derive(Debug, Clone)]
pub struct Block {
    /// The unit's parameters, in layout order; the prefix names the unit in errors.
    pub params: ParamList,
    /// Residual stream width.
    pub width: usize,
    /// The norm before attention.
    pub norm1: Norm,
    /// Self-attention.
    pub attn: Attention,
    /// The norm before the MLP.
    pub norm2: Norm,
    /// The feed-forward layer.
    pub mlp: Mlp,
    /// Dropout on each branch before its residual add (0: none). With it, dropout sits
    /// between the projection and the add, so the product cannot add the residual itself.
    pub resid_pdrop: f32,
}

impl Block {
    fn name(&self) -> &str {
        self.params.prefix()
    }

    /// The attention core's shape for this call: probability dropout only while training.
    fn attn_shape(&self, ctx: &Ctx<'_>) -> AttentionShape {
        let s = self.attn.shape(ctx.batch.batch, ctx.batch.seq);
        if !ctx.training {
            return s;
        }
        let offset = ctx.rng_offset(self.attn.q_heads * s.seq * s.seq);
        self.attn
            .with_dropout(s, (rng::derive(ctx.rng_seed, SITE_PROBS), offset))
    }

    /// Residual dropout over a `[batch·seq, width]` branch output.
    fn drop(&self, ctx: &Ctx<'_>, site: u64, x: ViewMut<'_>) -> Result<()> {
        let seed = rng::derive(ctx.rng_seed, site);
        let offset = ctx.rng_offset(ctx.batch.seq * self.width);
        ctx.be.dropout(seed, offset, self.resid_pdrop, x)
    }

    /// `x2 = x + o(att)` (written by the product, or with dropout between them by the norm)
    /// and `n2 = norm2(x2)`.
    fn attn_residual_norm2(
        &self,
        ctx: &Ctx<'_>,
        p: &Params<'_>,
        (att, x): (View<'_>, View<'_>),
        mut x2: ViewMut<'_>,
        (n2, s2): (ViewMut<'_>, &mut NormStats),
    ) -> Result<()> {
        let (be, o) = (ctx.be, &self.attn.o);
        if self.resid_pdrop <= 0.0 {
            o.forward(be, p, (att, Some(x)), x2.reborrow(), Draw::of(ctx))?;
            return self.norm2.forward(be, p, x2.as_view(), n2, s2);
        }
        let mut y = act(be, x.len())?;
        o.forward(be, p, (att, None), y.view_mut(), Draw::of(ctx))?;
        self.drop(ctx, SITE_ATTN, y.view_mut())?;
        self.norm2
            .residual_forward(be, p, (y.view(), Some(x)), (x2, n2), s2)?;
        be.recycle(y);
        Ok(())
    }

    /// `out = x2 + down(h)`, dropout between the product and the add when on.
    fn mlp_residual(
        &self,
        ctx: &Ctx<'_>,
        p: &Params<'_>,
        (h, x2): (View<'_>, View<'_>),
        mut out: ViewMut<'_>,
    ) -> Result<()> {
        let down = self.mlp.down();
        if self.resid_pdrop <= 0.0 {
            return down.forward(ctx.be, p, (h, Some(x2)), out, Draw::of(ctx));
        }
        down.forward(ctx.be, p, (h, None), out.reborrow(), Draw::of(ctx))?;
        self.drop(ctx, SITE_MLP, out.reborrow())?;
        ctx.be.add_assign(out, x2)
    }

    /// The gradient through a branch's dropout: a masked copy of `g`, or `None` when
    /// dropout is off and the branch sees `g` itself (no copy to make).
    fn drop_grad(&self, ctx: &Ctx<'_>, site: u64, g: View<'_>) -> Result<Option<Storage>> {
        if self.resid_pdrop <= 0.0 {
            return Ok(None);
        }
        let mut copy = ctx.be.copy(g)?;
        self.drop(ctx, site, copy.view_mut())?;
        Ok(Some(copy))
    }

    /// The attention branch's backward from `dx2`, the residual stream's gradient after
    /// norm2; `dn2`, dead, lends its buffer. Returns the block's input gradient.
    fn attn_backward(
        &self,
        ctx: &Ctx<'_>,
        (p, gr): (&Params<'_>, &mut Grads<'_>),
        s: &BlockSaved,
        (dx2, dn2): (View<'_>, Storage),
    ) -> Result<Storage> {
        let (be, rows) = (ctx.be, ctx.batch.batch * ctx.batch.seq);
        let da_copy = self.drop_grad(ctx, SITE_ATTN, dx2)?;
        let da = da_copy.as_ref().map_or(dx2, Storage::view);
        let (o, att) = (&self.attn.o, s.attn.att.view());
        let mut datt = reuse(be, dn2, rows * self.attn.width())?;
        let drop = Draw::of(ctx);
        o.backward_input(be, p, da, (datt.view_mut(), Accumulate::Overwrite), drop)?;
        o.backward_params(be, (p, gr), (att, da), drop)?;
        let shape = self.attn_shape(ctx);
        let dqkv = self.attn.core_backward(be, &s.attn, datt.view(), shape)?;
        let mut dn1 = match da_copy {
            Some(copy) => copy,
            None => act(be, rows * self.width)?,
        };
        let x = (s.n1.view(), dqkv.as_slice());
        self.attn
            .projections_backward(be, (p, gr), x, (dn1.view_mut(), drop))?;
        let mut dx = reuse(be, datt, rows * self.width)?;
        let (x, dy) = ((s.x.view(), &s.s1), (dn1.view(), Some(dx2)));
        self.norm1.backward(be, (p, gr), x, dy, dx.view_mut())?;
        (dqkv, dn1).hand_back(be);
        Ok(dx)
    }
}

impl Module for Block {
    fn param_specs(&self) -> Vec<ParamSpec> {
        self.params.specs().to_vec()
    }

    fn forward(&self, ctx: &mut Ctx<'_>, p: &Params<'_>, input: &Tensor) -> Result<Tensor> {
        self.params.check(self.name(), p, None)?;
        let (w, be, b, t) = (self.width, ctx.be, ctx.batch.batch, ctx.batch.seq);
        let n = check_rows("block", input, b * t, w)?;
        // The norm keeps its own copy of the input (the caller reuses the input's buffer).
        let (mut x, mut n1, mut s1) = (act(be, n * w)?, act(be, n * w)?, self.norm1.stats(be, n)?);
        let copy = (input.view(), None);
        self.norm1
            .residual_forward(be, p, copy, (x.view_mut(), n1.view_mut()), &mut s1)?;
        let attn = self
            .attn
            .forward(be, p, n1.view(), (self.attn_shape(ctx), Draw::of(ctx)))?;
        let (mut x2, mut n2, mut s2) = (act(be, n * w)?, act(be, n * w)?, self.norm2.stats(be, n)?);
        let n2_out = (n2.view_mut(), &mut s2);
        self.attn_residual_norm2(ctx, p, (attn.att.view(), x.view()), x2.view_mut(), n2_out)?;
        let mlp = self.mlp.forward(be, p, n2.view(), Draw::of(ctx))?;
        let mut out = act(be, n * w)?;
        self.mlp_residual(ctx, p, (mlp.down_input(), x2.view()), out.view_mut())?;
        if ctx.training {
            let s = BlockSaved {
                x,
                s1,
                n1,
                attn,
                x2,
                s2,
                n2,
                mlp,
            };
            *ctx.saved = Some(Box::new(s));
        }
        Tensor::new(input.shape.clone(), out)
    }

    fn backward(
        &self,
        ctx: &mut Ctx<'_>,
        p: &Params<'_>,
        gr: &mut Grads<'_>,
        grad_output: &Tensor,
    ) -> Result<Tensor> {
        self.params.check(self.name(), p, Some(gr))?;
        let s = take::<BlockSaved>(ctx.saved, self.name())?;
        let (w, be) = (self.width, ctx.be);
        let n = check_rows(
            "block backward",
            grad_output,
            ctx.batch.batch * ctx.batch.seq,
            w,
        )?;
        crate::nn::check_same_batch(self.name(), s.x.len(), ctx.batch, w)?;
        let dout = grad_output.view();
        let dm_copy = self.drop_grad(ctx, SITE_MLP, dout)?;
        let dm = dm_copy.as_ref().map_or(dout, Storage::view);
        let inner = self
            .mlp
            .backward_down(be, (p, gr), &s.mlp, (dm, Draw::of(ctx)))?;
        dm_copy.hand_back(be);
        let dn2 = self
            .mlp
            .backward_up(be, (p, gr), (s.n2.view(), Draw::of(ctx)), inner)?;
        // The residual stream's gradient: through norm2, plus the output's around it.
        let mut dx2 = act(be, n * w)?;
        let (x2, dy) = ((s.x2.view(), &s.s2), (dn2.view(), Some(dout)));
        self.norm2.backward(be, (p, gr), x2, dy, dx2.view_mut())?;
        let dx = self.attn_backward(ctx, (p, gr), &s, (dx2.view(), dn2))?;
        (dx2, *s).hand_back(be);
        Tensor::new(grad_output.shape.clone(), dx)
    }

    fn attention_width(&self) -> usize {
        self.attn.width()
    }
}
