//! The token embedding every decoder starts with: `table[token]`, plus a learned position
//! table's rows when the architecture has one (GPT-2), then embedding dropout when it has that.

use super::ParamList;
use crate::backend::{rng, Accumulate};
use crate::nn::saved::{saved_struct, take};
use crate::nn::{act, check_rows, check_tokens, Ctx, Grads, Init, Module, ParamSpec, Params};
use crate::tensor::{Tensor, ViewMut};
use crate::{Error, Result};

const SITE_EMBED: u64 = 0;

saved_struct!(
    /// The embedding keeps nothing (tokens come from the batch); the marker proves forward ran.
    EmbedSaved {}
);

/// `embed`: the first unit, reading the batch's tokens.
#[derive(Debug, Clone)]
pub struct TokenEmbed {
    params: ParamList,
    dim: usize,
    /// The longest sequence: the position table's rows, or the positions RoPE was made for.
    max_seq: usize,
    /// Whether parameter 0 is a learned `[max_seq, dim]` position table.
    positions: bool,
    /// The table's index: after the position table, declared here or shared.
    table: usize,
    /// Embedding dropout's probability (GPT-2's `embd_pdrop`); `None`: the architecture has
    /// none.
    pub dropout: Option<f32>,
    /// An attention window the sequence must fit in (Mistral's): windowed attention is not
    /// implemented, and within the window it is full causal attention.
    pub window: Option<usize>,
}

impl TokenEmbed {
    /// An embedding of `vocab` tokens into `dim` columns for sequences of up to `max_seq`
    /// tokens. `positions` (name and initialiser) declares a learned position table;
    /// `own_table` declares the token table after it, and `None` reads the unit's first
    /// shared parameter (a table tied to the head).
    pub fn new(
        (dim, vocab, max_seq): (usize, usize, usize),
        positions: Option<(&str, Init)>,
        own_table: Option<(&str, Init)>,
    ) -> Self {
        let mut params = ParamList::new("");
        if let Some((name, init)) = positions {
            params.add(name, vec![max_seq, dim], init);
        }
        let table = params.table(own_table, (vocab, dim));
        Self {
            params,
            dim,
            max_seq,
            positions: positions.is_some(),
            table,
            dropout: None,
            window: None,
        }
    }

    /// Embedding dropout over a `[batch·seq, dim]` buffer: forward's output, or backward's
    /// gradient under the same mask.
    fn drop(&self, ctx: &Ctx<'_>, pdrop: f32, x: ViewMut<'_>) -> Result<()> {
        let seed = rng::derive(ctx.rng_seed, SITE_EMBED);
        let offset = ctx.rng_offset(ctx.batch.seq * self.dim);
        ctx.be.dropout(seed, offset, pdrop, x)
    }

    /// Refuses a sequence longer than the window.
    fn check_window(&self, seq: usize) -> Result<()> {
        match self.window {
            Some(w) if seq > w => Err(Error::Invalid(format!(
                "sequence length {seq} exceeds the model's sliding_window {w}: sliding-window \
                 attention is not implemented (within the window it is full causal attention); \
                 use a sequence length of at most {w}"
            ))),
            _ => Ok(()),
        }
    }
}

impl Module for TokenEmbed {
    fn param_specs(&self) -> Vec<ParamSpec> {
        self.params.specs().to_vec()
    }

    fn forward(&self, ctx: &mut Ctx<'_>, p: &Params<'_>, _input: &Tensor) -> Result<Tensor> {
        self.params.check("embed", p, None)?;
        let (b, t, d, be) = (ctx.batch.batch, ctx.batch.seq, self.dim, ctx.be);
        check_tokens(ctx.batch, self.max_seq)?;
        self.check_window(t)?;
        let mut out = act(be, b * t * d)?;
        let table = p.get(self.table);
        be.embedding_forward(
            ctx.tokens(),
            table,
            d,
            out.view_mut(),
            Accumulate::Overwrite,
        )?;
        if self.positions {
            be.position_forward(p.get(0), b, t, out.view_mut())?;
        }
        if let Some(pdrop) = self.dropout {
            self.drop(ctx, pdrop, out.view_mut())?;
        }
        if ctx.training {
            *ctx.saved = Some(Box::new(EmbedSaved {}));
        }
        Tensor::new(vec![b, t, d], out)
    }

    fn backward(
        &self,
        ctx: &mut Ctx<'_>,
        p: &Params<'_>,
        gr: &mut Grads<'_>,
        grad_output: &Tensor,
    ) -> Result<Tensor> {
        self.params.check("embed", p, Some(gr))?;
        take::<EmbedSaved>(ctx.saved, "embed")?;
        let (b, t, d, be) = (ctx.batch.batch, ctx.batch.seq, self.dim, ctx.be);
        check_rows("embed backward", grad_output, b * t, d)?;
        // Dropout's gradient is the same mask over a copy of the incoming gradient.
        let copy = match self.dropout {
            Some(pdrop) => {
                let mut g = be.copy(grad_output.view())?;
                self.drop(ctx, pdrop, g.view_mut())?;
                Some(g)
            }
            None => None,
        };
        let g = copy.as_ref().map_or(grad_output.view(), |c| c.view());
        // Token ids have no gradient: a frozen table's backward is nothing at all.
        if let Some(dtable) = gr.get_mut(self.table) {
            be.embedding_backward(ctx.tokens(), g, d, dtable)?;
        }
        if let Some(dpos) = gr.get_mut(0).filter(|_| self.positions) {
            be.position_backward(g, b, t, dpos)?;
        }
        Ok(Tensor::default())
    }
}
