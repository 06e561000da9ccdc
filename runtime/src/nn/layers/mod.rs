//! The layers architectures are composed of: a decoder is a [`TokenEmbed`], one [`Block`] per
//! layer and an [`LmHead`], and a block is two [`Norm`]s, an [`Attention`] and an [`Mlp`]
//! around the residual stream. An architecture only declares its parameters (Hugging Face
//! names, in its checkpoints' order) into a [`ParamList`] and picks each layer's variant.
//!
//! Layers own no weights: each holds the indices of its parameters in its unit's [`Params`]
//! (what [`ParamList`] hands out as they are declared), so one unit's parameters may be laid
//! out in any order and a layer still reads its own by name.
//!
//! [`Params`]: crate::nn::Params

mod attention;
mod block;
mod dense;
mod embed;
mod head;
mod lora;
mod mlp;
mod norm;

pub use attention::Attention;
pub use block::Block;
pub use dense::Dense;
pub use embed::TokenEmbed;
pub use head::LmHead;
pub use lora::Lora;
pub use mlp::Mlp;
pub use norm::Norm;

use crate::backend::Backend;
use crate::nn::linear::{Linear, WeightLayout};
use crate::nn::{act, Grads, Init, Model, Module, ParamSpec, Params, Unit};
use crate::tensor::Storage;
use crate::{Error, Result};

/// A unit's parameters as they are declared, in layout order; each declaration returns the
/// index its view will have in the unit's `Params`.
#[derive(Debug, Clone, Default)]
pub struct ParamList {
    prefix: String,
    specs: Vec<ParamSpec>,
    /// Element counts of the shared parameters the unit reads after its own.
    shared: Vec<usize>,
}

impl ParamList {
    /// An empty list whose names all start with `prefix` (e.g. `transformer.h.0.`).
    pub fn new(prefix: impl Into<String>) -> Self {
        Self {
            prefix: prefix.into(),
            ..Self::default()
        }
    }

    /// The prefix, which also names the unit in errors.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The declared parameters.
    pub fn specs(&self) -> &[ParamSpec] {
        &self.specs
    }

    /// Checks that the engine lent exactly the views this unit declared (own, then shared),
    /// so a layout bug surfaces as an error naming `unit` instead of an index panic.
    pub(crate) fn check(
        &self,
        unit: &str,
        p: &Params<'_>,
        gr: Option<&mut Grads<'_>>,
    ) -> Result<()> {
        let own = self.specs.iter().map(ParamSpec::numel);
        let lens: Vec<usize> = own.chain(self.shared.iter().copied()).collect();
        let bad = |what: &str, got: Vec<usize>| Error::Shape {
            op: "parameter views",
            expected: format!("{unit}: {} {what} of lengths {lens:?}", lens.len()),
            got: format!("{got:?}"),
        };
        let got: Vec<usize> = (0..p.len()).map(|i| p.get(i).len()).collect();
        if got != lens {
            return Err(bad("parameters", got));
        }
        match gr.map(|g| (0..g.len()).map(|i| g.len_of(i)).collect::<Vec<_>>()) {
            Some(got) if got != lens => Err(bad("gradients", got)),
            _ => Ok(()),
        }
    }

    /// A shared parameter of `len` elements the unit reads (a tied table), and its index:
    /// shared parameters follow the unit's own, so declare them after those.
    pub fn shared(&mut self, len: usize) -> usize {
        self.shared.push(len);
        self.specs.len() + self.shared.len() - 1
    }

    /// The token table `[vocab, dim]`: declared as `{prefix}{name}` when the unit owns it
    /// (`own` names it), else read from the model's shared parameters (a tied table).
    pub fn table(&mut self, own: Option<(&str, Init)>, (vocab, dim): (usize, usize)) -> usize {
        match own {
            Some((name, init)) => self.add(name, vec![vocab, dim], init),
            None => self.shared(vocab * dim),
        }
    }

    /// Declares `{prefix}{name}` and returns its index.
    pub fn add(&mut self, name: &str, shape: Vec<usize>, init: Init) -> usize {
        self.specs.push(ParamSpec {
            name: format!("{}{name}", self.prefix),
            shape,
            init,
        });
        self.specs.len() - 1
    }

    /// Declares `{name}.weight`, shaped by `lin`'s layout, and with `bias` a zero-initialised
    /// `{name}.bias` right after it.
    pub fn dense(&mut self, name: &str, lin: Linear, init: Init, bias: bool) -> Dense {
        let shape = match lin.layout {
            WeightLayout::InOut => vec![lin.d_in, lin.d_out],
            WeightLayout::OutIn => vec![lin.d_out, lin.d_in],
        };
        let w = self.add(&format!("{name}.weight"), shape, init);
        let b = bias.then(|| self.add(&format!("{name}.bias"), vec![lin.d_out], Init::Zeros));
        Dense {
            lin,
            weight: w,
            bias: b,
        }
    }

    /// Declares a LayerNorm's `{name}.weight` (ones) and `{name}.bias` (zeros).
    pub fn layer_norm(&mut self, name: &str, width: usize, eps: f32) -> Norm {
        let weight = self.add(&format!("{name}.weight"), vec![width], Init::Ones);
        let bias = Some(self.add(&format!("{name}.bias"), vec![width], Init::Zeros));
        Norm { weight, bias, eps }
    }

    /// Declares an RMSNorm's `{name}.weight` (ones).
    pub fn rms_norm(&mut self, name: &str, width: usize, eps: f32) -> Norm {
        let weight = self.add(&format!("{name}.weight"), vec![width], Init::Ones);
        Norm {
            weight,
            bias: None,
            eps,
        }
    }
}

/// A decoder's units: `embed`, the `blocks` named `{block_name}.{i}`, and `head`. With
/// `tied`, the embedding table is a shared parameter both ends read.
pub fn decoder(
    tied: Option<ParamSpec>,
    embed: TokenEmbed,
    (block_name, blocks): (&str, Vec<Block>),
    head: LmHead,
) -> Model {
    let ends = if tied.is_some() { vec![0] } else { vec![] };
    let unit = |name: String, module: Box<dyn Module>, uses_shared| Unit {
        name,
        module,
        uses_shared,
    };
    let mut units = vec![unit("embed".into(), Box::new(embed), ends.clone())];
    for (i, b) in blocks.into_iter().enumerate() {
        units.push(unit(format!("{block_name}.{i}"), Box::new(b), vec![]));
    }
    units.push(unit("head".into(), Box::new(head), ends));
    let shared = tied.into_iter().collect();
    Model { shared, units }
}

/// A buffer of `len` elements for a new use, taken over from the dead `buf` when the sizes
/// agree (so the two uses never hold memory at once), else a fresh one after `buf` goes back.
fn reuse(be: &dyn Backend, buf: Storage, len: usize) -> Result<Storage> {
    if buf.len() == len {
        return Ok(buf);
    }
    be.recycle(buf);
    act(be, len)
}
