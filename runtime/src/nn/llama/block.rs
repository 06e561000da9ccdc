//! One Llama block: RMSNorm → GQA attention with RoPE → residual, RMSNorm → SwiGLU MLP →
//! residual. With `qkv_bias` (Qwen2) the q/k/v projections add their biases, declared after
//! the nine weights so the weights keep their indices.

use super::LlamaConfig;
use crate::backend::{
    Accumulate, AttentionGrads, AttentionShape, Backend, MemoryModel, Rotation, RowView,
};
use crate::nn::linear::{Linear, WeightLayout};
use crate::nn::saved::{saved_struct, take};
use crate::nn::{act, check_rows, stats, Ctx, Grads, Init, Module, ParamSpec, Params, Transients};
use crate::tensor::{DType, Tensor, View, ViewMut};
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
/// Bias of the projection at index `w` (`WQ`, `WK`, `WV`), when `qkv_bias`.
const fn bias_of(w: usize) -> usize {
    9 + w
}

/// A Llama block (`model.layers.{index}`).
pub struct Block {
    cfg: LlamaConfig,
    prefix: String,
}

impl Block {
    /// Element counts of the views this unit needs, in `Params` order.
    fn lens(&self) -> Vec<usize> {
        crate::nn::spec_lens(&self.param_specs())
    }

    /// Block `index` of a model with `cfg`.
    pub fn new(cfg: LlamaConfig, index: usize) -> Self {
        Self {
            cfg,
            prefix: format!("model.layers.{index}."),
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

    /// Rotates queries and keys (or their gradients, `Inverse`) in one call.
    fn rope(
        &self,
        be: &dyn Backend,
        (q, k): (ViewMut<'_>, ViewMut<'_>),
        b: usize,
        t: usize,
        dir: Rotation,
    ) -> Result<()> {
        be.rope_qk(q, k, self.attn_shape(b, t), &self.cfg.rope, dir)
    }

    /// `y = x · Wᵀ (+ b)` for projection `w` of q, k, v.
    fn project(
        &self,
        be: &dyn Backend,
        p: &Params<'_>,
        w: usize,
        x: View<'_>,
        y: ViewMut<'_>,
    ) -> Result<()> {
        let (qw, kvw) = self.widths();
        let out = if w == WQ { qw } else { kvw };
        let bias = self.cfg.qkv_bias.then(|| p.get(bias_of(w)));
        Self::lin(self.cfg.hidden_size, out).forward(be, x, p.get(w), bias, y)
    }

    /// `dW += dyᵀ · x` (and `db += Σ dy`) for projection `w` of q, k, v.
    fn project_grads(
        &self,
        be: &dyn Backend,
        gr: &mut Grads<'_>,
        w: usize,
        x: View<'_>,
        dy: View<'_>,
    ) -> Result<()> {
        let (qw, kvw) = self.widths();
        let lin = Self::lin(self.cfg.hidden_size, if w == WQ { qw } else { kvw });
        if self.cfg.qkv_bias {
            let (dw, db) = gr.pair_mut(w, bias_of(w));
            lin.backward_params(be, x, dy, dw, Some(db))
        } else {
            lin.backward_params(be, x, dy, gr.get_mut(w), None)
        }
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
        let mut specs = vec![
            p("self_attn.q_proj.weight", vec![qw, h], w),
            p("self_attn.k_proj.weight", vec![kvw, h], w),
            p("self_attn.v_proj.weight", vec![kvw, h], w),
            p("self_attn.o_proj.weight", vec![h, qw], w),
            p("mlp.gate_proj.weight", vec![i, h], w),
            p("mlp.up_proj.weight", vec![i, h], w),
            p("mlp.down_proj.weight", vec![h, i], w),
            p("input_layernorm.weight", vec![h], Init::Ones),
            p("post_attention_layernorm.weight", vec![h], Init::Ones),
        ];
        if self.cfg.qkv_bias {
            specs.push(p("self_attn.q_proj.bias", vec![qw], Init::Zeros));
            specs.push(p("self_attn.k_proj.bias", vec![kvw], Init::Zeros));
            specs.push(p("self_attn.v_proj.bias", vec![kvw], Init::Zeros));
        }
        specs
    }

    fn forward(&self, ctx: &mut Ctx<'_>, p: &Params<'_>, input: &Tensor) -> Result<Tensor> {
        crate::nn::check_views(&self.prefix, p, None, &self.lens())?;
        let (hd, im, be) = (self.cfg.hidden_size, self.cfg.intermediate_size, ctx.be);
        let (b, t) = (ctx.batch.batch, ctx.batch.seq);
        let n = check_rows("llama block", input, b * t, hd)?;
        let (qw, kvw) = self.widths();
        let eps = self.cfg.rms_norm_eps;
        // The norm keeps its own copy of the input (the caller reuses the input's buffer).
        let (mut x, mut rstd1, mut n1) = (act(be, n * hd)?, stats(be, n)?, act(be, n * hd)?);
        be.residual_rmsnorm_forward(
            input.view(),
            None,
            p.get(NORM1),
            eps,
            x.view_mut(),
            n1.view_mut(),
            rstd1.view_mut(),
        )?;
        let (mut q, mut k, mut v) = (act(be, n * qw)?, act(be, n * kvw)?, act(be, n * kvw)?);
        self.project(be, p, WQ, n1.view(), q.view_mut())?;
        self.project(be, p, WK, n1.view(), k.view_mut())?;
        self.project(be, p, WV, n1.view(), v.view_mut())?;
        self.rope(be, (q.view_mut(), k.view_mut()), b, t, Rotation::Forward)?;
        let mut att = act(be, n * qw)?;
        let probs = be.attention_forward(
            self.attn_shape(b, t),
            (q.view(), view(qw)),
            (k.view(), view(kvw)),
            (v.view(), view(kvw)),
            att.view_mut(),
        )?;
        let mut x2 = act(be, n * hd)?;
        let wo = (p.get(WO), None);
        Self::lin(qw, hd).forward_residual(be, att.view(), wo, x.view(), x2.view_mut())?;
        let (mut rstd2, mut n2) = (stats(be, n)?, act(be, n * hd)?);
        be.rmsnorm_forward(
            x2.view(),
            p.get(NORM2),
            eps,
            n2.view_mut(),
            rstd2.view_mut(),
        )?;
        let (mut gate, mut up) = (act(be, n * im)?, act(be, n * im)?);
        Self::lin(hd, im).forward(be, n2.view(), p.get(WG), None, gate.view_mut())?;
        Self::lin(hd, im).forward(be, n2.view(), p.get(WU), None, up.view_mut())?;
        let mut act_out = act(be, n * im)?;
        be.swiglu_forward(gate.view(), up.view(), act_out.view_mut())?;
        let mut out = act(be, n * hd)?;
        let wd = (p.get(WD), None);
        Self::lin(im, hd).forward_residual(be, act_out.view(), wd, x2.view(), out.view_mut())?;
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
                act: act_out,
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
        let (hd, im, be) = (self.cfg.hidden_size, self.cfg.intermediate_size, ctx.be);
        let (b, t) = (ctx.batch.batch, ctx.batch.seq);
        let n = check_rows("llama block backward", grad_output, b * t, hd)?;
        crate::nn::check_same_batch(&self.prefix, s.x.len(), ctx.batch, hd)?;
        let (qw, kvw) = self.widths();
        let dout = grad_output.view();
        // MLP branch.
        let down = Self::lin(im, hd);
        let mut dact = act(be, n * im)?;
        down.backward_input(be, dout, p.get(WD), dact.view_mut(), Accumulate::Overwrite)?;
        down.backward_params(be, s.act.view(), dout, gr.get_mut(WD), None)?;
        let (mut dgate, mut dup) = (act(be, n * im)?, act(be, n * im)?);
        be.swiglu_backward(
            s.gate.view(),
            s.up.view(),
            dact.view(),
            dgate.view_mut(),
            dup.view_mut(),
        )?;
        be.recycle(dact);
        let gu = Self::lin(hd, im);
        let mut dn2 = act(be, n * hd)?;
        gu.backward_input(
            be,
            dgate.view(),
            p.get(WG),
            dn2.view_mut(),
            Accumulate::Overwrite,
        )?;
        gu.backward_input(be, dup.view(), p.get(WU), dn2.view_mut(), Accumulate::Add)?;
        gu.backward_params(be, s.n2.view(), dgate.view(), gr.get_mut(WG), None)?;
        gu.backward_params(be, s.n2.view(), dup.view(), gr.get_mut(WU), None)?;
        be.recycle(dgate);
        be.recycle(dup);
        // The residual stream's gradient: through the norm, plus the output's around it.
        let mut dx2 = act(be, n * hd)?;
        be.rmsnorm_backward_residual(
            s.x2.view(),
            p.get(NORM2),
            s.rstd2.view(),
            dn2.view(),
            dout,
            dx2.view_mut(),
            gr.get_mut(NORM2),
        )?;
        // Attention branch.
        let o = Self::lin(qw, hd);
        let mut datt = act(be, n * qw)?;
        o.backward_input(
            be,
            dx2.view(),
            p.get(WO),
            datt.view_mut(),
            Accumulate::Overwrite,
        )?;
        o.backward_params(be, s.att.view(), dx2.view(), gr.get_mut(WO), None)?;
        let (mut dq, mut dk, mut dv) = (act(be, n * qw)?, act(be, n * kvw)?, act(be, n * kvw)?);
        let grads = AttentionGrads::Split {
            dq: dq.view_mut(),
            dk: dk.view_mut(),
            dv: dv.view_mut(),
        };
        be.attention_backward(
            self.attn_shape(b, t),
            (s.q.view(), view(qw)),
            (s.k.view(), view(kvw)),
            (s.v.view(), view(kvw)),
            s.att.view(),
            &s.probs,
            datt.view(),
            grads,
        )?;
        self.rope(be, (dq.view_mut(), dk.view_mut()), b, t, Rotation::Inverse)?;
        let mut dn1 = dn2;
        let (lq, lkv) = (Self::lin(hd, qw), Self::lin(hd, kvw));
        lq.backward_input(
            be,
            dq.view(),
            p.get(WQ),
            dn1.view_mut(),
            Accumulate::Overwrite,
        )?;
        lkv.backward_input(be, dk.view(), p.get(WK), dn1.view_mut(), Accumulate::Add)?;
        lkv.backward_input(be, dv.view(), p.get(WV), dn1.view_mut(), Accumulate::Add)?;
        self.project_grads(be, gr, WQ, s.n1.view(), dq.view())?;
        self.project_grads(be, gr, WK, s.n1.view(), dk.view())?;
        self.project_grads(be, gr, WV, s.n1.view(), dv.view())?;
        let mut dx = act(be, n * hd)?;
        be.rmsnorm_backward_residual(
            s.x.view(),
            p.get(NORM1),
            s.rstd1.view(),
            dn1.view(),
            dx2.view(),
            dx.view_mut(),
            gr.get_mut(NORM1),
        )?;
        for dead in [dx2, datt, dq, dk, dv, dn1] {
            be.recycle(dead);
        }
        s.recycle(be);
        Tensor::new(grad_output.shape.clone(), dx)
    }

    fn saved_bytes(&self, batch: usize, seq: usize, m: &MemoryModel) -> usize {
        let (n, hd, im) = (
            batch * seq,
            self.cfg.hidden_size,
            self.cfg.intermediate_size,
        );
        let (qw, kvw) = self.widths();
        // x, n1, x2, n2: n·hd each; q, att: n·qw; k, v: n·kvw; gate, up, act: n·im; two f32
        // per-row stats.
        4 * m.act_bytes(n * hd)
            + 2 * m.act_bytes(n * qw)
            + 2 * m.act_bytes(n * kvw)
            + 3 * m.act_bytes(n * im)
            + 2 * m.bytes(DType::F32, n)
            + m.attention_saved(self.attn_shape(batch, seq))
    }

    fn output_bytes(&self, batch: usize, seq: usize, m: &MemoryModel) -> usize {
        m.act_bytes(batch * seq * self.cfg.hidden_size)
    }

    fn transient_bytes(&self, batch: usize, seq: usize, m: &MemoryModel) -> Transients {
        let n = batch * seq;
        let (qw, kvw) = self.widths();
        let (hd, im) = (
            m.act_bytes(n * self.cfg.hidden_size),
            m.act_bytes(n * self.cfg.intermediate_size),
        );
        let attn = m.attention_transient(self.attn_shape(batch, seq));
        // Backward's crowded moments: dact, dgate and dup; dgate, dup and dn2; then dn2, dx2,
        // datt, dq, dk and dv around attention (dx, returned, is priced by the caller).
        let backward = [
            3 * im,
            2 * im + hd,
            2 * hd + 2 * m.act_bytes(n * qw) + 2 * m.act_bytes(n * kvw) + attn,
        ];
        Transients {
            forward: 0,
            backward: backward.into_iter().max().unwrap_or(0),
        }
    }

    fn attention_width(&self) -> usize {
        self.cfg.num_attention_heads * self.cfg.head_dim()
    }
}
