//! One Llama block: RMSNorm → GQA attention with RoPE → residual, RMSNorm → SwiGLU MLP →
//! residual.

use std::sync::Arc;

use super::LlamaConfig;
use crate::backend::{Accumulate, AttentionGrads, AttentionShape, Backend, Rotation, RowView};
use crate::nn::linear::{Linear, WeightLayout};
use crate::nn::saved::{saved_struct, take};
use crate::nn::{check_rows, Ctx, Grads, Init, Module, ParamSpec, Params};
use crate::tensor::Tensor;
use crate::Result;

saved_struct!(
    /// What a block keeps for backward (q and k after RoPE).
    BlockSaved { x, rstd1, n1, q, k, v, probs, att, x2, rstd2, n2, gate, up, act }
);

/// Parameter indices in declaration order.
const WQ: usize = 0;
const WK: usize = 1;
const WV: usize = 2;
const WO: usize = 3;
const WG: usize = 4;
const WU: usize = 5;
const WD: usize = 6;
const NORM1: usize = 7;
const NORM2: usize = 8;

/// A Llama block (`model.layers.{index}`).
pub struct Block {
    cfg: LlamaConfig,
    prefix: String,
    be: Arc<dyn Backend>,
}

impl Block {
    /// Element counts of the views this unit needs, in `Params` order.
    fn lens(&self) -> Vec<usize> {
        crate::nn::spec_lens(&self.param_specs())
    }

    /// Block `index` of a model with `cfg`.
    pub fn new(cfg: LlamaConfig, index: usize, be: Arc<dyn Backend>) -> Self {
        Self {
            cfg,
            prefix: format!("model.layers.{index}."),
            be,
        }
    }

    fn lin(d_in: usize, d_out: usize) -> Linear {
        Linear {
            d_in,
            d_out,
            layout: WeightLayout::OutIn,
        }
    }

    /// (q width, kv width).
    fn widths(&self) -> (usize, usize) {
        let d = self.cfg.head_dim();
        (self.cfg.num_attention_heads * d, self.cfg.kv_heads() * d)
    }

    fn attn_shape(&self, batch: usize, seq: usize) -> AttentionShape {
        AttentionShape {
            batch,
            seq,
            q_heads: self.cfg.num_attention_heads,
            kv_heads: self.cfg.kv_heads(),
            head_dim: self.cfg.head_dim(),
        }
    }

    fn rope(&self, x: &mut [f32], heads: usize, b: usize, t: usize, dir: Rotation) {
        let (d, theta) = (self.cfg.head_dim(), self.cfg.rope_theta);
        self.be.rope(x, b, t, heads, d, theta, dir);
    }
}

fn view(stride: usize) -> RowView {
    RowView { stride, offset: 0 }
}

impl Module for Block {
    fn param_specs(&self) -> Vec<ParamSpec> {
        let (h, i) = (self.cfg.hidden_size, self.cfg.intermediate_size);
        let (qw, kvw) = self.widths();
        let w = Init::Normal {
            std: self.cfg.initializer_range,
        };
        let p = |n: &str, shape: Vec<usize>, init| ParamSpec {
            name: format!("{}{n}", self.prefix),
            shape,
            init,
        };
        vec![
            p("self_attn.q_proj.weight", vec![qw, h], w),
            p("self_attn.k_proj.weight", vec![kvw, h], w),
            p("self_attn.v_proj.weight", vec![kvw, h], w),
            p("self_attn.o_proj.weight", vec![h, qw], w),
            p("mlp.gate_proj.weight", vec![i, h], w),
            p("mlp.up_proj.weight", vec![i, h], w),
            p("mlp.down_proj.weight", vec![h, i], w),
            p("input_layernorm.weight", vec![h], Init::Ones),
            p("post_attention_layernorm.weight", vec![h], Init::Ones),
        ]
    }

    fn forward(&self, ctx: &mut Ctx<'_>, p: &Params<'_>, input: &Tensor) -> Result<Tensor> {
        crate::nn::check_views(&self.prefix, p, None, &self.lens())?;
        let (hd, im, be) = (self.cfg.hidden_size, self.cfg.intermediate_size, &*self.be);
        let (b, t) = (ctx.batch.batch, ctx.batch.seq);
        let n = check_rows("llama block", input, b * t, hd)?;
        let (qw, kvw) = self.widths();
        let eps = self.cfg.rms_norm_eps;
        let x = input.data.clone();
        let (mut rstd1, mut n1) = (vec![0.0; n], vec![0.0; n * hd]);
        be.rmsnorm_forward(&x, p.get(NORM1), eps, &mut n1, &mut rstd1);
        let (mut q, mut k, mut v) = (vec![0.0; n * qw], vec![0.0; n * kvw], vec![0.0; n * kvw]);
        Self::lin(hd, qw).forward(be, &n1, p.get(WQ), None, &mut q)?;
        Self::lin(hd, kvw).forward(be, &n1, p.get(WK), None, &mut k)?;
        Self::lin(hd, kvw).forward(be, &n1, p.get(WV), None, &mut v)?;
        self.rope(
            &mut q,
            self.cfg.num_attention_heads,
            b,
            t,
            Rotation::Forward,
        );
        self.rope(&mut k, self.cfg.kv_heads(), b, t, Rotation::Forward);
        let shape = self.attn_shape(b, t);
        let mut probs = vec![0.0; b * self.cfg.num_attention_heads * t * t];
        let mut att = vec![0.0; n * qw];
        let (qv, kv) = ((&q[..], view(qw)), (&k[..], view(kvw)));
        be.attention_forward(shape, qv, kv, (&v, view(kvw)), &mut probs, &mut att)?;
        let mut x2 = x.clone();
        Self::lin(qw, hd).forward_add(be, &att, p.get(WO), &mut x2)?;
        let (mut rstd2, mut n2) = (vec![0.0; n], vec![0.0; n * hd]);
        be.rmsnorm_forward(&x2, p.get(NORM2), eps, &mut n2, &mut rstd2);
        let (mut gate, mut up, mut act) = (vec![0.0; n * im], vec![0.0; n * im], vec![0.0; n * im]);
        Self::lin(hd, im).forward(be, &n2, p.get(WG), None, &mut gate)?;
        Self::lin(hd, im).forward(be, &n2, p.get(WU), None, &mut up)?;
        be.swiglu_forward(&gate, &up, &mut act);
        let mut out = x2.clone();
        Self::lin(im, hd).forward_add(be, &act, p.get(WD), &mut out)?;
        if ctx.training {
            let s = BlockSaved {
                x,
                rstd1,
                n1,
                q,
                k,
                v,
                probs,
                att,
                x2,
                rstd2,
                n2,
                gate,
                up,
                act,
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
        let (hd, im, be) = (self.cfg.hidden_size, self.cfg.intermediate_size, &*self.be);
        let (b, t) = (ctx.batch.batch, ctx.batch.seq);
        let n = check_rows("llama block backward", grad_output, b * t, hd)?;
        crate::nn::check_same_batch(&self.prefix, s.x.len(), ctx.batch, hd)?;
        let (qw, kvw) = self.widths();
        let dout = &grad_output.data;
        // MLP branch.
        let down = Self::lin(im, hd);
        let mut dact = vec![0.0; n * im];
        down.backward_input(be, dout, p.get(WD), &mut dact, Accumulate::Overwrite)?;
        down.backward_params(be, &s.act, dout, gr.get_mut(WD), None)?;
        let (mut dgate, mut dup) = (vec![0.0; n * im], vec![0.0; n * im]);
        be.swiglu_backward(&s.gate, &s.up, &dact, &mut dgate, &mut dup);
        drop(dact);
        let gu = Self::lin(hd, im);
        let mut dn2 = vec![0.0; n * hd];
        gu.backward_input(be, &dgate, p.get(WG), &mut dn2, Accumulate::Overwrite)?;
        gu.backward_input(be, &dup, p.get(WU), &mut dn2, Accumulate::Add)?;
        gu.backward_params(be, &s.n2, &dgate, gr.get_mut(WG), None)?;
        gu.backward_params(be, &s.n2, &dup, gr.get_mut(WU), None)?;
        drop((dgate, dup));
        let mut dx2 = vec![0.0; n * hd];
        be.rmsnorm_backward(
            &s.x2,
            p.get(NORM2),
            &s.rstd2,
            &dn2,
            &mut dx2,
            gr.get_mut(NORM2),
        );
        be.add_assign(&mut dx2, dout);
        // Attention branch.
        let o = Self::lin(qw, hd);
        let mut datt = vec![0.0; n * qw];
        o.backward_input(be, &dx2, p.get(WO), &mut datt, Accumulate::Overwrite)?;
        o.backward_params(be, &s.att, &dx2, gr.get_mut(WO), None)?;
        let (mut dq, mut dk, mut dv) = (vec![0.0; n * qw], vec![0.0; n * kvw], vec![0.0; n * kvw]);
        let (qv, kv, vv) = (
            (&s.q[..], view(qw)),
            (&s.k[..], view(kvw)),
            (&s.v[..], view(kvw)),
        );
        let grads = AttentionGrads::Split {
            dq: &mut dq,
            dk: &mut dk,
            dv: &mut dv,
        };
        be.attention_backward(self.attn_shape(b, t), qv, kv, vv, &s.probs, &datt, grads)?;
        self.rope(
            &mut dq,
            self.cfg.num_attention_heads,
            b,
            t,
            Rotation::Inverse,
        );
        self.rope(&mut dk, self.cfg.kv_heads(), b, t, Rotation::Inverse);
        let mut dn1 = dn2;
        Self::lin(hd, qw).backward_input(be, &dq, p.get(WQ), &mut dn1, Accumulate::Overwrite)?;
        Self::lin(hd, kvw).backward_input(be, &dk, p.get(WK), &mut dn1, Accumulate::Add)?;
        Self::lin(hd, kvw).backward_input(be, &dv, p.get(WV), &mut dn1, Accumulate::Add)?;
        Self::lin(hd, qw).backward_params(be, &s.n1, &dq, gr.get_mut(WQ), None)?;
        Self::lin(hd, kvw).backward_params(be, &s.n1, &dk, gr.get_mut(WK), None)?;
        Self::lin(hd, kvw).backward_params(be, &s.n1, &dv, gr.get_mut(WV), None)?;
        let mut dx = vec![0.0; n * hd];
        be.rmsnorm_backward(
            &s.x,
            p.get(NORM1),
            &s.rstd1,
            &dn1,
            &mut dx,
            gr.get_mut(NORM1),
        );
        be.add_assign(&mut dx, &dx2);
        Tensor::new(grad_output.shape.clone(), dx)
    }

    fn saved_bytes(&self, batch: usize, seq: usize) -> usize {
        let (n, hd, im) = (
            batch * seq,
            self.cfg.hidden_size,
            self.cfg.intermediate_size,
        );
        let (qw, kvw) = self.widths();
        // x, n1, x2, n2: n·hd each; q, att: n·qw; k, v: n·kvw; gate, up, act: n·im.
        let floats = 4 * n * hd + 2 * n * qw + 2 * n * kvw + 3 * n * im + 2 * n;
        (floats + batch * self.cfg.num_attention_heads * seq * seq) * 4
    }

    fn output_bytes(&self, batch: usize, seq: usize) -> usize {
        batch * seq * self.cfg.hidden_size * 4
    }
}
