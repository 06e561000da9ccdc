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
pub use lora::{Draw, Lora};
pub use mlp::Mlp;
pub use norm::Norm;

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::backend::Backend;
use crate::nn::linear::{Linear, WeightLayout};
use crate::nn::{act, Grads, Init, Model, Module, ParamSpec, Params, Unit};
use crate::tensor::Storage;
use crate::{Error, Result};

/// One linear layer's LoRA adapter as a model is built with it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdapterSpec {
    /// The rank.
    pub r: usize,
    /// The branch's scale (`lora_alpha / r`, or `/ √r` with rsLoRA).
    pub scale: f32,
    /// The adapter's input dropout (`lora_dropout`).
    pub dropout: f32,
    /// `lora_A.weight`'s initialiser (`lora_B.weight` starts at zero, as in PEFT).
    pub init_a: Init,
}

/// LoRA adapters by the Hugging Face name of the linear layer they go on (e.g.
/// `transformer.h.0.attn.c_attn`); a model built with them declares each adapter's
/// `{module}.lora_A.weight` and `{module}.lora_B.weight` right after the layer's own.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Adapters {
    by_module: BTreeMap<String, AdapterSpec>,
}

impl Adapters {
    /// Puts `spec` on the layer named `module`.
    pub fn insert(&mut self, module: impl Into<String>, spec: AdapterSpec) {
        self.by_module.insert(module.into(), spec);
    }

    /// Whether no layer has one.
    pub fn is_empty(&self) -> bool {
        self.by_module.is_empty()
    }

    /// The layers' names, sorted.
    pub fn modules(&self) -> impl Iterator<Item = &str> {
        self.by_module.keys().map(String::as_str)
    }

    /// Fails, naming them, when some adapters' layers are not among `model`'s parameters:
    /// a name that matches nothing must not train nothing in silence.
    pub fn check_placed(&self, model: &Model) -> Result<()> {
        let names: std::collections::HashSet<String> = model
            .units
            .iter()
            .flat_map(|u| u.module.param_specs())
            .map(|s| s.name)
            .collect();
        let missing: Vec<&str> = self
            .modules()
            .filter(|m| !names.contains(&format!("{m}.lora_A.weight")))
            .collect();
        match missing.is_empty() {
            true => Ok(()),
            false => Err(Error::Invalid(format!(
                "LoRA adapters for {missing:?} match no linear layer of this model"
            ))),
        }
    }
}

/// A unit's parameters as they are declared, in layout order; each declaration returns the
/// index its view will have in the unit's `Params`.
#[derive(Debug, Clone, Default)]
pub struct ParamList {
    prefix: String,
    specs: Vec<ParamSpec>,
    /// Element counts of the shared parameters the unit reads after its own.
    shared: Vec<usize>,
    /// The adapters linear layers declared here get, by full name.
    adapters: Option<Arc<Adapters>>,
}

impl ParamList {
    /// An empty list whose names all start with `prefix` (e.g. `transformer.h.0.`).
    pub fn new(prefix: impl Into<String>) -> Self {
        Self {
            prefix: prefix.into(),
            ..Self::default()
        }
    }

    /// This list with `adapters` put on the linear layers it declares from now on.
    pub fn with_adapters(mut self, adapters: &Arc<Adapters>) -> Self {
        self.adapters = (!adapters.is_empty()).then(|| adapters.clone());
        self
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
        // A frozen parameter lends no gradient (length 0 here).
        let Some(g) = gr else { return Ok(()) };
        let want: Vec<usize> = (lens.iter().enumerate())
            .map(|(i, &n)| if i < g.len() && g.trains(i) { n } else { 0 })
            .collect();
        let got: Vec<usize> = (0..g.len()).map(|i| g.len_of(i)).collect();
        match got == want {
            true => Ok(()),
            false => Err(bad("gradients", got)),
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
        let lora = self.lora(name, lin);
        Dense {
            lin,
            weight: w,
            bias: b,
            lora,
        }
    }

    /// Declares `{name}.lora_A.weight` `[r, in]` and `{name}.lora_B.weight` `[out, r]` (zeros)
    /// when an adapter goes on the layer `{prefix}{name}`.
    fn lora(&mut self, name: &str, lin: Linear) -> Option<Lora> {
        let full = format!("{}{name}", self.prefix);
        let spec = *self.adapters.as_ref()?.by_module.get(&full)?;
        let a = self.add(
            &format!("{name}.lora_A.weight"),
            vec![spec.r, lin.d_in],
            spec.init_a,
        );
        let b = self.add(
            &format!("{name}.lora_B.weight"),
            vec![lin.d_out, spec.r],
            Init::Zeros,
        );
        Some(Lora {
            a,
            b,
            r: spec.r,
            scale: spec.scale,
            dropout: spec.dropout,
            dims: (lin.d_in, lin.d_out),
        })
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
    let unit = |name: String, module: Arc<dyn Module>, uses_shared| Unit {
        name,
        module,
        uses_shared,
    };
    let mut units = vec![unit("embed".into(), Arc::new(embed), ends.clone())];
    for (i, b) in blocks.into_iter().enumerate() {
        units.push(unit(format!("{block_name}.{i}"), Arc::new(b), vec![]));
    }
    units.push(unit("head".into(), Arc::new(head), ends));
    let shared = tied.into_iter().collect();
    Model::new(shared, units)
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
