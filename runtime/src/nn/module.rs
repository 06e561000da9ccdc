//! The `Module` contract: what a layer or a user's own block must provide so that the engine
//! can partition, gather, run and differentiate it.
//!
//! A module never owns its weights. It declares [`ParamSpec`]s; the engine lays them out in
//! one flat buffer per unit (declaration order, no padding between parameters), gathers that
//! buffer when ZeRO-3 needs it, and passes slices as [`Params`]. Backward *accumulates* (+=)
//! into [`Grads`], which the engine zeroes at the start of each micro-step.
//!
//! Forward stores what backward needs in the unit's [`Saved`] slot. With activation
//! checkpointing the engine drops that slot after forward and runs forward again (same
//! [`Ctx`], same RNG seed) just before backward, so forward must be deterministic given
//! its inputs, `ctx.rng_seed` and `ctx.rng_row`.

use std::any::Any;
use std::sync::Arc;

use crate::backend::Backend;
use crate::tensor::{IdBuf, Ids, Storage, Tensor, View, ViewMut};
use crate::{Error, Result};

pub use crate::backend::IGNORE_INDEX;

/// How a parameter is initialised; the engine draws from a seeded RNG so that every world
/// size and stage starts from the same values.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// All zeros.
    Zeros,
    /// All ones.
    Ones,
    /// Normal(0, std).
    Normal {
        /// Standard deviation.
        std: f32,
    },
    /// Uniform(-bound, bound).
    Uniform {
        /// Half-width.
        bound: f32,
    },
}

/// A parameter a module needs.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamSpec {
    /// Name, relative to the unit (models use Hugging Face names in full, e.g.
    /// `transformer.h.0.attn.c_attn.weight`).
    pub name: String,
    /// Shape, row-major.
    pub shape: Vec<usize>,
    /// Initialiser.
    pub init: Init,
}

impl ParamSpec {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Read-only views of a unit's parameters, in [`Module::param_specs`] order followed by the
/// shared (tied) parameters the unit uses, in [`Unit::uses_shared`] order.
pub struct Params<'a> {
    views: Vec<View<'a>>,
}

impl<'a> Params<'a> {
    /// Views in declaration order.
    pub fn new(views: Vec<View<'a>>) -> Self {
        Self { views }
    }
    /// The i-th parameter.
    pub fn get(&self, i: usize) -> View<'a> {
        self.views[i]
    }
    /// Number of parameters.
    pub fn len(&self) -> usize {
        self.views.len()
    }
    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.views.is_empty()
    }
}

/// Gradient accumulators, in the same order as [`Params`]. Backward adds into them.
pub struct Grads<'a> {
    views: Vec<Option<ViewMut<'a>>>,
}

impl<'a> Grads<'a> {
    /// Views in declaration order, every parameter trainable.
    pub fn new(views: Vec<ViewMut<'a>>) -> Self {
        Self {
            views: views.into_iter().map(Some).collect(),
        }
    }
    /// Views in declaration order, `None` where the parameter is frozen.
    pub fn with_frozen(views: Vec<Option<ViewMut<'a>>>) -> Self {
        Self { views }
    }
    /// The i-th gradient accumulator; `None` when the parameter is frozen: its gradient is
    /// not wanted (a layer skips the product that would compute it; the input gradient
    /// still flows).
    pub fn get_mut(&mut self, i: usize) -> Option<ViewMut<'_>> {
        self.views[i].as_mut().map(ViewMut::reborrow)
    }
    /// The i-th gradient accumulator, for a module that does not support frozen parameters:
    /// an error naming the index when it is frozen.
    pub fn require(&mut self, i: usize) -> crate::Result<ViewMut<'_>> {
        self.get_mut(i).ok_or_else(|| frozen_error(i))
    }
    /// Two distinct accumulators at once (e.g. a norm's weight and bias); `i != j`.
    pub fn pair_mut(&mut self, i: usize, j: usize) -> (Option<ViewMut<'_>>, Option<ViewMut<'_>>) {
        assert_ne!(i, j, "Grads::pair_mut needs two distinct indices");
        let (lo, hi) = (i.min(j), i.max(j));
        let (head, tail) = self.views.split_at_mut(hi);
        let (a, b) = (
            head[lo].as_mut().map(ViewMut::reborrow),
            tail[0].as_mut().map(ViewMut::reborrow),
        );
        if i < j {
            (a, b)
        } else {
            (b, a)
        }
    }
    /// [`Grads::pair_mut`] for a module that does not support frozen parameters: an error
    /// naming the index when either is frozen.
    pub fn require_pair(
        &mut self,
        i: usize,
        j: usize,
    ) -> crate::Result<(ViewMut<'_>, ViewMut<'_>)> {
        if let Some(k) = [i, j].into_iter().find(|&k| !self.trains(k)) {
            return Err(frozen_error(k));
        }
        match self.pair_mut(i, j) {
            (Some(a), Some(b)) => Ok((a, b)),
            _ => Err(crate::Error::Invalid(format!(
                "parameters {i} and {j} lent no gradient"
            ))),
        }
    }
    /// Whether the i-th parameter trains (has a gradient accumulator).
    pub fn trains(&self, i: usize) -> bool {
        self.views[i].is_some()
    }
    /// The length of the i-th accumulator (0 for a frozen parameter).
    pub fn len_of(&self, i: usize) -> usize {
        self.views[i].as_ref().map_or(0, |v| v.len())
    }
    /// Number of gradients.
    pub fn len(&self) -> usize {
        self.views.len()
    }
    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.views.is_empty()
    }
}

/// The error for a module that computes a frozen parameter's gradient unconditionally.
fn frozen_error(i: usize) -> crate::Error {
    crate::Error::Invalid(format!(
        "parameter {i} of this module is frozen, and the module computes its gradient \
         unconditionally: it does not support freezing that parameter"
    ))
}

/// What a module keeps between forward and backward; the size feeds the memory ledger.
pub trait SavedState: Any + Send {
    /// Bytes held.
    fn bytes(&self) -> usize;
    /// Upcast for downcasting in backward.
    fn into_any(self: Box<Self>) -> Box<dyn Any>;
}

/// A unit's saved-activation slot.
pub type Saved = Option<Box<dyn SavedState>>;

/// One micro-batch of token data, shared by all units of a forward pass.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    /// Rows in the micro-batch.
    pub batch: usize,
    /// Sequence length.
    pub seq: usize,
    /// Input token ids, `batch * seq`, row-major.
    pub tokens: Vec<u32>,
    /// Target ids, `batch * seq`; [`IGNORE_INDEX`] contributes no loss.
    pub targets: Vec<i32>,
}

impl Batch {
    /// Targets that contribute to the loss.
    pub fn valid_targets(&self) -> usize {
        self.targets.iter().filter(|&&t| t != IGNORE_INDEX).count()
    }
}

/// A batch's token ids and targets where a backend reads them (uploaded once per micro-step).
#[derive(Debug)]
pub struct BatchIds {
    /// Token ids.
    pub tokens: IdBuf,
    /// Targets ([`IGNORE_INDEX`] for none).
    pub targets: IdBuf,
}

impl BatchIds {
    /// Copies the batch's ids to where `be` reads them. Token ids at or above 2^31 cannot be
    /// valid for any table and are refused here.
    pub fn new(be: &dyn Backend, batch: &Batch) -> Result<Self> {
        let tokens = batch
            .tokens
            .iter()
            .enumerate()
            .map(|(i, &t)| {
                i32::try_from(t).map_err(|_| {
                    Error::Invalid(format!(
                        "token id {t} at position {i} is not a valid token id"
                    ))
                })
            })
            .collect::<Result<Vec<i32>>>()?;
        Ok(Self {
            tokens: be.upload_ids(&tokens)?,
            targets: be.upload_ids(&batch.targets)?,
        })
    }
}

/// Per-call context: the backend, the batch (host values for shapes and counts, and its ids
/// on the backend's device), the mode, the RNG seed for dropout, and the saved slot.
pub struct Ctx<'a> {
    /// The device the unit computes on; layers allocate and compute only through it.
    pub be: &'a dyn Backend,
    /// The micro-batch being processed.
    pub batch: &'a Batch,
    /// The micro-batch's token ids and targets on the backend's device.
    pub ids: &'a BatchIds,
    /// Training (dropout on, state saved) or evaluation.
    pub training: bool,
    /// Seed for this unit of this run (not the step, micro-step or rank: those enter
    /// through `rng_row`); dropout masks derive from it.
    pub rng_seed: u64,
    /// The run's global index of the batch's first sequence (sequence `b` is `rng_row + b`):
    /// dropout counts its mask's elements from `rng_row` times the elements of a sequence,
    /// so a sequence draws the same mask whichever rank, micro-step or batch size holds it.
    pub rng_row: u64,
    /// The unit's saved state: forward fills it, backward takes it.
    pub saved: &'a mut Saved,
}

impl<'a> Ctx<'a> {
    /// A call on `be` for `(batch, ids)`, its randomness drawn from `(rng_seed, rng_row)`.
    pub fn new(
        be: &'a dyn Backend,
        (batch, ids): (&'a Batch, &'a BatchIds),
        training: bool,
        (rng_seed, rng_row): (u64, u64),
        saved: &'a mut Saved,
    ) -> Self {
        Ctx {
            be,
            batch,
            ids,
            training,
            rng_seed,
            rng_row,
            saved,
        }
    }
}

impl Ctx<'_> {
    /// A zero-filled activation buffer of `len` elements on this call's device, in the
    /// backend's activation dtype: what a module allocates instead of `vec![0.0; len]`.
    pub fn alloc(&self, len: usize) -> Result<Storage> {
        self.be.zeros(self.be.act_dtype(), len)
    }

    /// The batch's token ids.
    pub fn tokens(&self) -> Ids<'_> {
        self.ids.tokens.ids()
    }
    /// The batch's targets.
    pub fn targets(&self) -> Ids<'_> {
        self.ids.targets.ids()
    }

    /// The dropout counter of this batch's first element in a buffer of `per_sequence`
    /// elements a sequence: the offset
    /// [`ElementwiseOps::dropout`](crate::backend::ElementwiseOps::dropout) and
    /// [`AttnDropout`](crate::backend::AttnDropout) take. Wrapping: counters are 64-bit and
    /// need only differ, not be ordered.
    pub fn rng_offset(&self, per_sequence: usize) -> u64 {
        self.rng_row.wrapping_mul(per_sequence as u64)
    }
}

/// A layer or block with explicit forward and backward.
///
/// Data flow between the units of a [`Model`]: the first unit receives an empty tensor and
/// reads `ctx.batch.tokens`; each later unit receives its predecessor's output; the last unit
/// reads `ctx.batch.targets` and returns a one-element tensor holding the **sum** of the
/// token losses (ignored targets excluded). Backward of the last unit receives a one-element
/// `grad_output` = d(objective)/d(loss sum), which the engine sets to
/// `loss_scale / valid targets in the global batch`.
pub trait Module: Send + Sync {
    /// The parameters this module needs, in layout order.
    fn param_specs(&self) -> Vec<ParamSpec>;

    /// Computes the output and, when `ctx.training`, stores what backward needs in `ctx.saved`.
    fn forward(&self, ctx: &mut Ctx<'_>, params: &Params<'_>, input: &Tensor) -> Result<Tensor>;

    /// Accumulates parameter gradients into `grads` and returns the gradient of the input
    /// (an empty tensor for the first unit). Consumes `ctx.saved`.
    fn backward(
        &self,
        ctx: &mut Ctx<'_>,
        params: &Params<'_>,
        grads: &mut Grads<'_>,
        grad_output: &Tensor,
    ) -> Result<Tensor>;

    /// Forward then backward in one call: the output and the input gradient. The engine calls
    /// it for a model's last unit in training (`train_batch`), where `grad_output` (the loss
    /// scale over the global batch's targets) is known before forward and nothing reads the
    /// unit's saved state in between; so a loss head may compute each chunk's loss and
    /// gradients at once and keep nothing. `ctx.training` is true; `ctx.saved` is empty before
    /// and must be empty after. Overrides must give the same values as the default (forward
    /// then backward); on the CPU, the same bits.
    fn forward_backward(
        &self,
        ctx: &mut Ctx<'_>,
        params: &Params<'_>,
        grads: &mut Grads<'_>,
        input: &Tensor,
        grad_output: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let out = self.forward(ctx, params, input)?;
        let grad_input = self.backward(ctx, params, grads, grad_output)?;
        Ok((out, grad_input))
    }

    /// Query heads × head dim of the causal self-attention this module runs (0: none), the
    /// `C` of the `6·L·C·T` attention term in a model's FLOPs per token (`mfu`).
    fn attention_width(&self) -> usize {
        0
    }

    /// Evaluation hook for a model's last unit: the arg-max token at every position of the
    /// batch (teacher-forced), in host memory, so the engine can report accuracy. `None`: not
    /// a prediction head.
    fn predict(
        &self,
        _ctx: &mut Ctx<'_>,
        _params: &Params<'_>,
        _input: &Tensor,
    ) -> Result<Option<Vec<u32>>> {
        Ok(None)
    }
}

/// A unit: the granularity at which ZeRO-3 gathers and releases parameters (FSDP's wrap unit).
/// Cloning shares the module: modules hold no parameters and no state between calls, so a
/// model is cheap to hand to an engine more than once (the estimator runs the real step on a
/// size-only device with the model the run will train).
#[derive(Clone)]
pub struct Unit {
    /// Display name, e.g. `h.3`.
    pub name: String,
    /// The computation.
    pub module: Arc<dyn Module>,
    /// Indices into [`Model::shared`] of the tied parameters this unit also reads, appended
    /// after its own parameters in [`Params`] and [`Grads`].
    pub uses_shared: Vec<usize>,
}

/// A model: an ordered list of units plus parameters shared between units (GPT-2's token
/// embedding is read by the first unit and by the LM head in the last).
#[derive(Clone)]
pub struct Model {
    /// Tied parameters, owned by the engine in their own flat buffer.
    pub shared: Vec<ParamSpec>,
    /// Units in execution order.
    pub units: Vec<Unit>,
    /// Which parameters are frozen: they get no gradient, master copy or optimizer state,
    /// are stored in the run's compute dtype, and are sharded, gathered and offloaded like
    /// any other ([`Model::freeze`]).
    pub frozen: crate::nn::freeze::Freeze,
}

impl Model {
    /// A model of `units` and tied parameters `shared`, nothing frozen.
    pub fn new(shared: Vec<ParamSpec>, units: Vec<Unit>) -> Self {
        Self {
            shared,
            units,
            frozen: Default::default(),
        }
    }

    /// Freezes the parameters `frozen`'s rules name (after the rules already set), checked
    /// against this model's names: a rule that matches nothing, or freezing everything, is
    /// an error naming the rule.
    pub fn freeze(mut self, frozen: crate::nn::freeze::Freeze) -> crate::Result<Self> {
        let names = self.param_names();
        frozen.check(&names)?;
        let merged = self.frozen.then(frozen);
        merged.check(&names)?;
        self.frozen = merged;
        Ok(self)
    }

    /// Whether the parameter `name` is frozen.
    pub fn is_frozen(&self, name: &str) -> bool {
        self.frozen.is_frozen(name)
    }

    /// Every parameter's name: the units' in order, then the shared ones.
    pub fn param_names(&self) -> Vec<String> {
        let own = self.units.iter().flat_map(|u| u.module.param_specs());
        own.chain(self.shared.iter().cloned())
            .map(|p| p.name)
            .collect()
    }

    /// Parameters that train (shared parameters counted once).
    pub fn num_trainable_params(&self) -> usize {
        let own = self.units.iter().flat_map(|u| u.module.param_specs());
        own.chain(self.shared.iter().cloned())
            .filter(|p| !self.is_frozen(&p.name))
            .map(|p| p.numel())
            .sum()
    }

    /// The lowest unit whose backward matters: the first that reads a parameter that trains
    /// (its own, or a shared one it uses). Below it every parameter is frozen, so no gradient
    /// is needed there and backward stops above it, as autograd stops where nothing below
    /// requires a gradient. The unit count when nothing trains.
    pub fn backward_floor(&self) -> usize {
        let trains = |p: &ParamSpec| !self.is_frozen(&p.name);
        self.units
            .iter()
            .position(|u| {
                u.module.param_specs().iter().any(trains)
                    || u.uses_shared.iter().any(|&i| trains(&self.shared[i]))
            })
            .unwrap_or(self.units.len())
    }

    /// Total parameter count (shared parameters counted once).
    pub fn num_params(&self) -> usize {
        let own: usize = self
            .units
            .iter()
            .flat_map(|u| u.module.param_specs())
            .map(|p| p.numel())
            .sum();
        own + self.shared.iter().map(ParamSpec::numel).sum::<usize>()
    }
}
