//! One GPT-2 block: pre-LayerNorm attention and GELU MLP, each on a residual branch.

use std::sync::Arc;

use super::Gpt2Config;
use crate::backend::{rng, Accumulate, AttentionGrads, AttentionShape, Backend, RowView};
use crate::nn::linear::{Linear, WeightLayout};
use crate::nn::saved::{saved_struct, take};
use crate::nn::{check_rows, Ctx, Grads, Init, Module, ParamSpec, Params};
use crate::tensor::Tensor;
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
    be: Arc<dyn Backend>,
}

impl Block {
    /// Element counts of the views this unit needs, in `Params` order.
    fn lens(&self) -> Vec<usize> {
        crate::nn::spec_lens(&self.param_specs())
    }

    /// Block `index` of a model with `cfg`.
    pub fn new(cfg: Gpt2Config, index: usize, be: Arc<dyn Backend>) -> Self {
        Self {
            cfg,
            prefix: format!("transformer.h.{index}."),
            be,
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

    fn drop(&self, seed: u64, site: u64, x: &mut [f32]) {
        self.be
            .dropout(rng::derive(seed, site), self.cfg.resid_pdrop, x);
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
        let (c, be) = (self.cfg.n_embd, &*self.be);
        let (b, t) = (ctx.batch.batch, ctx.batch.seq);
        let n = check_rows("gpt2 block", input, b * t, c)?;
        let eps = self.cfg.layer_norm_epsilon;
        let x = input.data.clone();
        let (mut mean1, mut rstd1, mut ln1) = (vec![0.0; n], vec![0.0; n], vec![0.0; n * c]);
        be.layernorm_forward(
            &x,
            p.get(0),
            p.get(1),
            eps,
            &mut ln1,
            &mut mean1,
            &mut rstd1,
        );
        let mut qkv = vec![0.0; n * 3 * c];
        self.lin(c, 3 * c)
            .forward(be, &ln1, p.get(2), Some(p.get(3)), &mut qkv)?;
        let shape = self.attn_shape(b, t);
        let [qv, kv, vv] = self.qkv_views();
        let mut probs = vec![0.0; b * self.cfg.n_head * t * t];
        let mut att = vec![0.0; n * c];
        be.attention_forward(
            shape,
            (&qkv, qv),
            (&qkv, kv),
            (&qkv, vv),
            &mut probs,
            &mut att,
        )?;
        let mut x2 = vec![0.0; n * c];
        self.lin(c, c)
            .forward(be, &att, p.get(4), Some(p.get(5)), &mut x2)?;
        self.drop(ctx.rng_seed, SITE_ATTN, &mut x2);
        be.add_assign(&mut x2, &x);
        let (mut mean2, mut rstd2, mut ln2) = (vec![0.0; n], vec![0.0; n], vec![0.0; n * c]);
        be.layernorm_forward(
            &x2,
            p.get(6),
            p.get(7),
            eps,
            &mut ln2,
            &mut mean2,
            &mut rstd2,
        );
        let mut h = vec![0.0; n * 4 * c];
        self.lin(c, 4 * c)
            .forward(be, &ln2, p.get(8), Some(p.get(9)), &mut h)?;
        let mut g = vec![0.0; n * 4 * c];
        be.gelu_forward(&h, &mut g);
        let mut out = vec![0.0; n * c];
        self.lin(4 * c, c)
            .forward(be, &g, p.get(10), Some(p.get(11)), &mut out)?;
        self.drop(ctx.rng_seed, SITE_MLP, &mut out);
        be.add_assign(&mut out, &x2);
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
        let (c, be) = (self.cfg.n_embd, &*self.be);
        let (b, t) = (ctx.batch.batch, ctx.batch.seq);
        let n = check_rows("gpt2 block backward", grad_output, b * t, c)?;
        crate::nn::check_same_batch(&self.prefix, s.x.len(), ctx.batch, c)?;
        // MLP branch.
        let mut dm = grad_output.data.clone();
        self.drop(ctx.rng_seed, SITE_MLP, &mut dm);
        let mut dg = vec![0.0; n * 4 * c];
        let fc2 = self.lin(4 * c, c);
        fc2.backward_input(be, &dm, p.get(10), &mut dg, Accumulate::Overwrite)?;
        let (dw, db) = gr.pair_mut(10, 11);
        fc2.backward_params(be, &s.g, &dm, dw, Some(db))?;
        drop(dm);
        let mut dh = vec![0.0; n * 4 * c];
        be.gelu_backward(&s.h, &dg, &mut dh);
        drop(dg);
        let mut dln2 = vec![0.0; n * c];
        let fc1 = self.lin(c, 4 * c);
        fc1.backward_input(be, &dh, p.get(8), &mut dln2, Accumulate::Overwrite)?;
        let (dw, db) = gr.pair_mut(8, 9);
        fc1.backward_params(be, &s.ln2, &dh, dw, Some(db))?;
        drop(dh);
        let mut dx2 = vec![0.0; n * c];
        let (g6, g7) = gr.pair_mut(6, 7);
        be.layernorm_backward(&s.x2, p.get(6), &s.mean2, &s.rstd2, &dln2, &mut dx2, g6, g7);
        be.add_assign(&mut dx2, &grad_output.data);
        // Attention branch.
        let mut da = dx2.clone();
        self.drop(ctx.rng_seed, SITE_ATTN, &mut da);
        let proj = self.lin(c, c);
        let mut datt = dln2;
        proj.backward_input(be, &da, p.get(4), &mut datt, Accumulate::Overwrite)?;
        let (dw, db) = gr.pair_mut(4, 5);
        proj.backward_params(be, &s.att, &da, dw, Some(db))?;
        let mut dqkv = vec![0.0; n * 3 * c];
        let [qv, kv, vv] = self.qkv_views();
        let q = (&s.qkv[..], qv);
        let (k, v) = ((&s.qkv[..], kv), (&s.qkv[..], vv));
        let shape = self.attn_shape(b, t);
        be.attention_backward(
            shape,
            q,
            k,
            v,
            &s.probs,
            &datt,
            AttentionGrads::Fused(&mut dqkv),
        )?;
        let qkv_lin = self.lin(c, 3 * c);
        let mut dln1 = da;
        qkv_lin.backward_input(be, &dqkv, p.get(2), &mut dln1, Accumulate::Overwrite)?;
        let (dw, db) = gr.pair_mut(2, 3);
        qkv_lin.backward_params(be, &s.ln1, &dqkv, dw, Some(db))?;
        let mut dx = datt;
        let (g0, g1) = gr.pair_mut(0, 1);
        be.layernorm_backward(&s.x, p.get(0), &s.mean1, &s.rstd1, &dln1, &mut dx, g0, g1);
        be.add_assign(&mut dx, &dx2);
        Tensor::new(grad_output.shape.clone(), dx)
    }

    fn saved_bytes(&self, batch: usize, seq: usize) -> usize {
        let (n, c) = (batch * seq, self.cfg.n_embd);
        // x, ln1, att, x2, ln2: n·c each; qkv 3n·c; h, g 4n·c each; four per-row stats.
        let floats =
            5 * n * c + 3 * n * c + 8 * n * c + 4 * n + batch * self.cfg.n_head * seq * seq;
        floats * 4
    }

    fn output_bytes(&self, batch: usize, seq: usize) -> usize {
        batch * seq * self.cfg.n_embd * 4
    }
}
