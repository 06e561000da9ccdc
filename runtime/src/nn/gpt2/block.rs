//! One GPT-2 block: pre-LayerNorm attention and GELU MLP, each on a residual branch.

use super::Gpt2Config;
use crate::backend::{
    rng, Accumulate, AttentionGrads, AttentionShape, Backend, MemoryModel, RowView,
};
use crate::nn::linear::{Linear, WeightLayout};
use crate::nn::saved::{saved_struct, take};
use crate::nn::{act, check_rows, stats, Ctx, Grads, Init, Module, ParamSpec, Params, Transients};
use crate::tensor::{DType, Storage, Tensor, View, ViewMut};
use crate::Result;

/// Dropout site tags within a block.
const SITE_ATTN: u64 = 1;
const SITE_MLP: u64 = 2;

saved_struct!(
    /// What a block keeps for backward.
    BlockSaved { x, mean1, rstd1, ln1, qkv, probs, att, x2, mean2, rstd2, ln2, h, g }
);

/// A GPT-2 block (`transformer.h.{index}`).
pub struct Block {
    cfg: Gpt2Config,
    prefix: String,
}

impl Block {
    /// Element counts of the views this unit needs, in `Params` order.
    fn lens(&self) -> Vec<usize> {
        crate::nn::spec_lens(&self.param_specs())
    }

    /// Block `index` of a model with `cfg`.
    pub fn new(cfg: Gpt2Config, index: usize) -> Self {
        Self {
            cfg,
            prefix: format!("transformer.h.{index}."),
        }
    }

    fn lin(&self, d_in: usize, d_out: usize) -> Linear {
        Linear {
            d_in,
            d_out,
            layout: WeightLayout::InOut,
        }
    }

    fn attn_shape(&self, batch: usize, seq: usize) -> AttentionShape {
        let h = self.cfg.n_head;
        AttentionShape {
            batch,
            seq,
            q_heads: h,
            kv_heads: h,
            head_dim: self.cfg.head_dim(),
        }
    }

    /// Views of q, k and v inside the fused `[rows, 3C]` qkv buffer.
    fn qkv_views(&self) -> [RowView; 3] {
        let c = self.cfg.n_embd;
        [0, c, 2 * c].map(|offset| RowView {
            stride: 3 * c,
            offset,
        })
    }

    fn drop(&self, be: &dyn Backend, seed: u64, site: u64, x: ViewMut<'_>) -> Result<()> {
        be.dropout(rng::derive(seed, site), self.cfg.resid_pdrop, x)
    }

    /// Whether the residual branches apply dropout: between the projection and the residual
    /// add, where it keeps the product from adding the residual itself.
    fn dropout(&self) -> bool {
        self.cfg.resid_pdrop > 0.0
    }

    /// `x2 = x + c_proj(att)` (written by the product, or with dropout between them by the
    /// norm) and `ln_2(x2)`.
    fn attn_residual_ln2(
        &self,
        ctx: &Ctx<'_>,
        p: &Params<'_>,
        (att, x): (View<'_>, View<'_>),
        mut x2: ViewMut<'_>,
        (ln2, mean2, rstd2): (ViewMut<'_>, ViewMut<'_>, ViewMut<'_>),
    ) -> Result<()> {
        let (c, be, eps) = (self.cfg.n_embd, ctx.be, self.cfg.layer_norm_epsilon);
        let (proj, w) = (self.lin(c, c), (p.get(4), Some(p.get(5))));
        let (gamma, beta) = (p.get(6), p.get(7));
        if !self.dropout() {
            proj.forward_residual(be, att, w, x, x2.reborrow())?;
            return be.layernorm_forward(x2.as_view(), gamma, beta, eps, ln2, mean2, rstd2);
        }
        let mut y = act(be, x.len())?;
        proj.forward(be, att, w.0, w.1, y.view_mut())?;
        self.drop(be, ctx.rng_seed, SITE_ATTN, y.view_mut())?;
        let stats = (mean2, rstd2);
        be.residual_layernorm_forward(y.view(), Some(x), gamma, beta, eps, x2, ln2, stats)?;
        be.recycle(y);
        Ok(())
    }

    /// The gradient through a residual branch's dropout: a masked copy of `g`, or `None`
    /// when dropout is off and the branch sees `g` itself (no copy to make).
    fn drop_grad(
        &self,
        be: &dyn Backend,
        seed: u64,
        site: u64,
        g: View<'_>,
    ) -> Result<Option<Storage>> {
        if self.cfg.resid_pdrop <= 0.0 {
            return Ok(None);
        }
        let mut copy = be.copy(g)?;
        self.drop(be, seed, site, copy.view_mut())?;
        Ok(Some(copy))
    }
}

impl Module for Block {
    fn param_specs(&self) -> Vec<ParamSpec> {
        let c = self.cfg.n_embd;
        let std = self.cfg.initializer_range;
        // GPT-2 scales residual projections by 1/sqrt(2 * n_layer).
        let proj_std = std / (2.0 * self.cfg.n_layer as f32).sqrt();
        let p = |n: &str, shape: Vec<usize>, init| ParamSpec {
            name: format!("{}{n}", self.prefix),
            shape,
            init,
        };
        vec![
            p("ln_1.weight", vec![c], Init::Ones),
            p("ln_1.bias", vec![c], Init::Zeros),
            p("attn.c_attn.weight", vec![c, 3 * c], Init::Normal { std }),
            p("attn.c_attn.bias", vec![3 * c], Init::Zeros),
            p(
                "attn.c_proj.weight",
                vec![c, c],
                Init::Normal { std: proj_std },
            ),
            p("attn.c_proj.bias", vec![c], Init::Zeros),
            p("ln_2.weight", vec![c], Init::Ones),
            p("ln_2.bias", vec![c], Init::Zeros),
            p("mlp.c_fc.weight", vec![c, 4 * c], Init::Normal { std }),
            p("mlp.c_fc.bias", vec![4 * c], Init::Zeros),
            p(
                "mlp.c_proj.weight",
                vec![4 * c, c],
                Init::Normal { std: proj_std },
            ),
            p("mlp.c_proj.bias", vec![c], Init::Zeros),
        ]
    }

    fn forward(&self, ctx: &mut Ctx<'_>, p: &Params<'_>, input: &Tensor) -> Result<Tensor> {
        crate::nn::check_views(&self.prefix, p, None, &self.lens())?;
        let (c, be) = (self.cfg.n_embd, ctx.be);
        let (b, t) = (ctx.batch.batch, ctx.batch.seq);
        let n = check_rows("gpt2 block", input, b * t, c)?;
        let eps = self.cfg.layer_norm_epsilon;
        // The norm keeps its own copy of the input (the caller reuses the input's buffer).
        let (mut x, mut ln1) = (act(be, n * c)?, act(be, n * c)?);
        let (mut mean1, mut rstd1) = (stats(be, n)?, stats(be, n)?);
        be.residual_layernorm_forward(
            input.view(),
            None,
            p.get(0),
            p.get(1),
            eps,
            x.view_mut(),
            ln1.view_mut(),
            (mean1.view_mut(), rstd1.view_mut()),
        )?;
        let mut qkv = act(be, n * 3 * c)?;
        self.lin(c, 3 * c)
            .forward(be, ln1.view(), p.get(2), Some(p.get(3)), qkv.view_mut())?;
        let [qv, kv, vv] = self.qkv_views();
        let mut att = act(be, n * c)?;
        let probs = be.attention_forward(
            self.attn_shape(b, t),
            (qkv.view(), qv),
            (qkv.view(), kv),
            (qkv.view(), vv),
            att.view_mut(),
        )?;
        let (mut x2, mut ln2) = (act(be, n * c)?, act(be, n * c)?);
        let (mut mean2, mut rstd2) = (stats(be, n)?, stats(be, n)?);
        let ln2_out = (ln2.view_mut(), mean2.view_mut(), rstd2.view_mut());
        self.attn_residual_ln2(ctx, p, (att.view(), x.view()), x2.view_mut(), ln2_out)?;
        let (mut h, mut g) = (act(be, n * 4 * c)?, act(be, n * 4 * c)?);
        self.lin(c, 4 * c).forward_gelu(
            be,
            ln2.view(),
            p.get(8),
            p.get(9),
            h.view_mut(),
            g.view_mut(),
        )?;
        let mut out = act(be, n * c)?;
        let (fc2, w) = (self.lin(4 * c, c), (p.get(10), Some(p.get(11))));
        if self.dropout() {
            fc2.forward(be, g.view(), w.0, w.1, out.view_mut())?;
            self.drop(be, ctx.rng_seed, SITE_MLP, out.view_mut())?;
            be.add_assign(out.view_mut(), x2.view())?;
        } else {
            fc2.forward_residual(be, g.view(), w, x2.view(), out.view_mut())?;
        }
        if ctx.training {
            let s = BlockSaved {
                x,
                mean1,
                rstd1,
                ln1,
                qkv,
                probs,
                att,
                x2,
                mean2,
                rstd2,
                ln2,
                h,
                g,
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
        crate::nn::check_views(&self.prefix, p, Some(gr), &self.lens())?;
        let s = take::<BlockSaved>(ctx.saved, &self.prefix)?;
        let (c, be) = (self.cfg.n_embd, ctx.be);
        let (b, t) = (ctx.batch.batch, ctx.batch.seq);
        let n = check_rows("gpt2 block backward", grad_output, b * t, c)?;
        crate::nn::check_same_batch(&self.prefix, s.x.len(), ctx.batch, c)?;
        // MLP branch.
        let dm_copy = self.drop_grad(be, ctx.rng_seed, SITE_MLP, grad_output.view())?;
        let dm = dm_copy.as_ref().map_or(grad_output.view(), Storage::view);
        // The gradient at fc1's output, through the GELU, with fc1's bias gradient.
        let mut dh = act(be, n * 4 * c)?;
        let fc2 = self.lin(4 * c, c);
        fc2.backward_input_gelu(be, dm, p.get(10), s.h.view(), dh.view_mut(), gr.get_mut(9))?;
        let (dw, db) = gr.pair_mut(10, 11);
        fc2.backward_params(be, s.g.view(), dm, dw, Some(db))?;
        if let Some(copy) = dm_copy {
            be.recycle(copy);
        }
        let mut dln2 = act(be, n * c)?;
        let fc1 = self.lin(c, 4 * c);
        fc1.backward_input(
            be,
            dh.view(),
            p.get(8),
            dln2.view_mut(),
            Accumulate::Overwrite,
        )?;
        fc1.backward_params(be, s.ln2.view(), dh.view(), gr.get_mut(8), None)?;
        be.recycle(dh);
        // The residual stream's gradient: through ln_2, plus the output's around it.
        let mut dx2 = act(be, n * c)?;
        let (g6, g7) = gr.pair_mut(6, 7);
        be.layernorm_backward_residual(
            s.x2.view(),
            p.get(6),
            (s.mean2.view(), s.rstd2.view()),
            dln2.view(),
            grad_output.view(),
            dx2.view_mut(),
            g6,
            g7,
        )?;
        // Attention branch.
        let da_copy = self.drop_grad(be, ctx.rng_seed, SITE_ATTN, dx2.view())?;
        let da = da_copy.as_ref().map_or(dx2.view(), Storage::view);
        let proj = self.lin(c, c);
        let mut datt = dln2;
        proj.backward_input(be, da, p.get(4), datt.view_mut(), Accumulate::Overwrite)?;
        let (dw, db) = gr.pair_mut(4, 5);
        proj.backward_params(be, s.att.view(), da, dw, Some(db))?;
        let mut dqkv = act(be, n * 3 * c)?;
        let [qv, kv, vv] = self.qkv_views();
        be.attention_backward(
            self.attn_shape(b, t),
            (s.qkv.view(), qv),
            (s.qkv.view(), kv),
            (s.qkv.view(), vv),
            s.att.view(),
            &s.probs,
            datt.view(),
            AttentionGrads::Fused(dqkv.view_mut()),
        )?;
        let qkv_lin = self.lin(c, 3 * c);
        let mut dln1 = match da_copy {
            Some(copy) => copy,
            None => act(be, n * c)?,
        };
        qkv_lin.backward_input(
            be,
            dqkv.view(),
            p.get(2),
            dln1.view_mut(),
            Accumulate::Overwrite,
        )?;
        let (dw, db) = gr.pair_mut(2, 3);
        qkv_lin.backward_params(be, s.ln1.view(), dqkv.view(), dw, Some(db))?;
        let mut dx = datt;
        let (g0, g1) = gr.pair_mut(0, 1);
        be.layernorm_backward_residual(
            s.x.view(),
            p.get(0),
            (s.mean1.view(), s.rstd1.view()),
            dln1.view(),
            dx2.view(),
            dx.view_mut(),
            g0,
            g1,
        )?;
        for dead in [dx2, dqkv, dln1] {
            be.recycle(dead);
        }
        s.recycle(be);
        Tensor::new(grad_output.shape.clone(), dx)
    }

    fn saved_bytes(&self, batch: usize, seq: usize, m: &MemoryModel) -> usize {
        let (n, c) = (batch * seq, self.cfg.n_embd);
        // x, ln1, att, x2, ln2: n·c each; qkv 3n·c; h, g 4n·c each; four f32 per-row stats.
        5 * m.act_bytes(n * c)
            + m.act_bytes(3 * n * c)
            + 2 * m.act_bytes(4 * n * c)
            + 4 * m.bytes(DType::F32, n)
            + m.attention_saved(self.attn_shape(batch, seq))
    }

    fn output_bytes(&self, batch: usize, seq: usize, m: &MemoryModel) -> usize {
        m.act_bytes(batch * seq * self.cfg.n_embd)
    }

    fn transient_bytes(&self, batch: usize, seq: usize, m: &MemoryModel) -> Transients {
        let nc = batch * seq * self.cfg.n_embd;
        let attn = m.attention_transient(self.attn_shape(batch, seq));
        // Backward's two crowded moments: dh and dln2 (fc2's input gradient goes through the
        // GELU inside its product: no separate dg); then datt (the input gradient it returns,
        // priced by the caller), dx2, dqkv and dln1 around attention.
        let backward = [
            m.act_bytes(4 * nc) + m.act_bytes(nc),
            2 * m.act_bytes(nc) + m.act_bytes(3 * nc) + attn,
        ];
        Transients {
            // With residual dropout, c_proj's output waits for the norm that adds it to x.
            forward: if self.dropout() { m.act_bytes(nc) } else { 0 },
            backward: backward.into_iter().max().unwrap_or(0),
        }
    }

    fn attention_width(&self) -> usize {
        self.cfg.n_head * self.cfg.head_dim()
    }
}
