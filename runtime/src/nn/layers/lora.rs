//! A low-rank adapter on a linear layer, as PEFT's LoRA defines it: the layer's output gains
//! `scale · B (A x)`, with `A` (`lora_A.weight`, `[r, in]`) and `B` (`lora_B.weight`,
//! `[out, r]`) in PEFT's layout whatever the base weight's layout (GPT-2's Conv1D included),
//! and `scale = lora_alpha / r` (or `/ √r` with rsLoRA), applied inside the products.
//!
//! Nothing is kept between forward and backward: the rank-`r` intermediate `A x` is a
//! `r / out` fraction of the base product's work and is recomputed where backward needs it,
//! so a layer's saved activations are the same with or without its adapter. `lora_dropout`
//! drops the adapter's input only (the base product reads `x` as is), from a counter-based
//! mask that backward redraws.

use crate::backend::{Backend, Epilogue, MatmulShape, Transpose};
use crate::nn::{act, Ctx, Grads, Params};
use crate::tensor::{Storage, View, ViewMut};
use crate::Result;

/// The adapter of one linear layer: its two parameters' indices in the unit and its shape.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Lora {
    /// `lora_A.weight`'s index, `[r, d_in]`.
    pub a: usize,
    /// `lora_B.weight`'s index, `[d_out, r]`.
    pub b: usize,
    /// The rank.
    pub r: usize,
    /// The branch's scale (`lora_alpha / r`, or `lora_alpha / √r` with rsLoRA).
    pub scale: f32,
    /// The adapter's input dropout probability (`lora_dropout`).
    pub dropout: f32,
    /// The layer's input and output widths.
    pub dims: (usize, usize),
}

/// What an adapter's input dropout draws from in training: the unit's seed, and the run's
/// global index of the micro-batch's first sequence with the batch's sequence count, so a
/// sequence's mask follows it across ranks, micro-steps and batch sizes (as every dropout's
/// does: `Ctx::rng_row`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Draw {
    /// The unit's seed.
    pub seed: u64,
    /// The global index of the batch's first sequence.
    pub first: u64,
    /// Sequences in the batch.
    pub sequences: usize,
}

impl Draw {
    /// `ctx`'s draw when it trains, `None` in inference (no dropout).
    pub fn of(ctx: &Ctx<'_>) -> Option<Draw> {
        ctx.training.then_some(Draw {
            seed: ctx.rng_seed,
            first: ctx.rng_row,
            sequences: ctx.batch.batch,
        })
    }

    /// The counter offset of a mask over `len` elements of this batch.
    fn offset(&self, len: usize) -> u64 {
        self.first
            .wrapping_mul((len / self.sequences.max(1)) as u64)
    }
}

/// The dropout site of an adapter's input, mixed into the unit's seed with the layer's
/// input width and rank so two adapters of a unit draw different masks.
const SITE_LORA: u64 = 0x4c6f_5241;

fn shape(m: usize, n: usize, k: usize, ta: Transpose, tb: Transpose) -> MatmulShape {
    MatmulShape { m, n, k, ta, tb }
}

impl Lora {
    fn rows(&self, x: &View<'_>) -> usize {
        x.len() / self.dims.0.max(1)
    }

    /// The seed of this adapter's input mask, from the unit's.
    fn seed(&self, unit_seed: u64) -> u64 {
        let site = SITE_LORA ^ ((self.dims.0 as u64) << 20) ^ ((self.a as u64) << 8);
        crate::backend::rng::derive(unit_seed, site)
    }

    /// The adapter's input: `x`, or a dropped copy of it in training.
    fn input(&self, be: &dyn Backend, x: View<'_>, drop: Option<Draw>) -> Result<Option<Storage>> {
        match drop {
            Some(draw) if self.dropout > 0.0 => {
                let mut d = be.copy(x)?;
                let (seed, offset) = (self.seed(draw.seed), draw.offset(d.len()));
                be.dropout(seed, offset, self.dropout, d.view_mut())?;
                Ok(Some(d))
            }
            _ => Ok(None),
        }
    }

    /// `t = x' · Aᵀ` (`[rows, r]`), `x'` the adapter's input.
    fn down(&self, be: &dyn Backend, p: &Params<'_>, x: View<'_>) -> Result<Storage> {
        let rows = self.rows(&x);
        let mut t = act(be, rows * self.r)?;
        let s = shape(rows, self.r, self.dims.0, Transpose::No, Transpose::Yes);
        be.matmul(s, x, p.get(self.a), t.view_mut(), Epilogue::Store)?;
        Ok(t)
    }

    /// `y += scale · B (A x')`; `drop`: the batch's [`Draw`] when training (dropout applies).
    pub fn forward(
        &self,
        be: &dyn Backend,
        p: &Params<'_>,
        x: View<'_>,
        y: ViewMut<'_>,
        drop: Option<Draw>,
    ) -> Result<()> {
        let dropped = self.input(be, x, drop)?;
        let x = dropped.as_ref().map_or(x, Storage::view);
        let t = self.down(be, p, x)?;
        let rows = self.rows(&x);
        let s = shape(rows, self.dims.1, self.r, Transpose::No, Transpose::Yes);
        be.matmul(
            s,
            t.view(),
            p.get(self.b),
            y,
            Epilogue::ScaledAccumulate(self.scale),
        )?;
        be.recycle(t);
        dropped.into_iter().for_each(|d| be.recycle(d));
        Ok(())
    }

    /// `u = dy · B` (`[rows, r]`).
    fn up_grad(&self, be: &dyn Backend, p: &Params<'_>, dy: View<'_>) -> Result<Storage> {
        let rows = dy.len() / self.dims.1.max(1);
        let mut u = act(be, rows * self.r)?;
        let s = shape(rows, self.r, self.dims.1, Transpose::No, Transpose::No);
        be.matmul(s, dy, p.get(self.b), u.view_mut(), Epilogue::Store)?;
        Ok(u)
    }

    /// `dx += scale · (dy · B) · A`, through the input dropout's mask when there is one
    /// (`drop`: the batch's draw, as in forward).
    pub fn backward_input(
        &self,
        be: &dyn Backend,
        p: &Params<'_>,
        dy: View<'_>,
        dx: ViewMut<'_>,
        drop: Option<Draw>,
    ) -> Result<()> {
        let u = self.up_grad(be, p, dy)?;
        let rows = dy.len() / self.dims.1.max(1);
        let s = shape(rows, self.dims.0, self.r, Transpose::No, Transpose::No);
        let a = p.get(self.a);
        match drop {
            Some(draw) if self.dropout > 0.0 => {
                let mut v = be.zeros(be.act_dtype(), rows * self.dims.0)?;
                be.matmul(
                    s,
                    u.view(),
                    a,
                    v.view_mut(),
                    Epilogue::ScaledAccumulate(self.scale),
                )?;
                let (seed, offset) = (self.seed(draw.seed), draw.offset(v.len()));
                be.dropout(seed, offset, self.dropout, v.view_mut())?;
                be.add_assign(dx, v.view())?;
                be.recycle(v);
            }
            _ => be.matmul(s, u.view(), a, dx, Epilogue::ScaledAccumulate(self.scale))?,
        }
        be.recycle(u);
        Ok(())
    }

    /// `dA += scale · (dy · B)ᵀ · x'` and `dB += scale · dyᵀ · (A x')`.
    pub fn backward_params(
        &self,
        be: &dyn Backend,
        (p, gr): (&Params<'_>, &mut Grads<'_>),
        x: View<'_>,
        dy: View<'_>,
        drop: Option<Draw>,
    ) -> Result<()> {
        let dropped = self.input(be, x, drop)?;
        let x = dropped.as_ref().map_or(x, Storage::view);
        let rows = self.rows(&x);
        let (din, dout, r) = (self.dims.0, self.dims.1, self.r);
        let u = self.up_grad(be, p, dy)?;
        let scaled = Epilogue::ScaledAccumulate(self.scale);
        let sa = shape(r, din, rows, Transpose::Yes, Transpose::No);
        if let Some(da) = gr.get_mut(self.a) {
            be.matmul(sa, u.view(), x, da, scaled)?;
        }
        be.recycle(u);
        let t = self.down(be, p, x)?;
        let sb = shape(dout, r, rows, Transpose::Yes, Transpose::No);
        let scaled = Epilogue::ScaledAccumulate(self.scale);
        if let Some(db) = gr.get_mut(self.b) {
            be.matmul(sb, dy, t.view(), db, scaled)?;
        }
        be.recycle(t);
        dropped.into_iter().for_each(|d| be.recycle(d));
        Ok(())
    }
}
