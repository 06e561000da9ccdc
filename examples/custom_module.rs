//! Bring your own layer: a user-defined [`Module`] with a hand-written backward, checked
//! against finite differences, then trained with ZeRO-2 on two local ranks.
//!
//!     cargo run --release --example custom_module
//!
//! What it shows, in order:
//! 1. [`ResidualMlp`], a residual feed-forward block `y = x + W2·gelu(W1·x + b1) + b2`. Like
//!    every ferrozero layer it owns no weights: it *declares* them ([`ParamSpec`]s) and the
//!    engine lends slices ([`Params`], [`Grads`]), which is what lets ZeRO shard, gather and
//!    release them without the layer noticing.
//! 2. [`gradcheck::check`] on the block before any training: a wrong backward is caught here,
//!    in a second, instead of as a loss curve that merely looks a bit off.
//! 3. A [`Model`] assembled from units: the library's token embedding first, two of our blocks,
//!    the library's RMSNorm + LM head + cross-entropy last. Each unit is what ZeRO-3 would
//!    gather and release as one piece.
//! 4. Training with a ZeRO-2 config written in code, on a synthetic task (every token must be
//!    mapped to `(7·token + 3) mod vocab`), checking that the loss fell.

use std::any::Any;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use ferrozero::config::{parse, Config, Format};
use ferrozero::engine::{Engine, EngineBuilder};
use ferrozero::runtime::backend::Rope;
use ferrozero::runtime::backend::{rng, Accumulate};
use ferrozero::runtime::comm::local::run_ranks;
use ferrozero::runtime::nn::gradcheck::{self, Options, Report};
use ferrozero::runtime::nn::linear::{Linear, WeightLayout};
use ferrozero::runtime::nn::llama::{self, LlamaConfig};
use ferrozero::runtime::nn::module::SavedState;
use ferrozero::runtime::nn::{
    init, Batch, Ctx, Grads, Init, Model, Module, ParamSpec, Params, Unit,
};
use ferrozero::runtime::tensor::{Storage, Tensor};
use ferrozero::runtime::{Error, Result};

/// Train a user-defined residual MLP block with ZeRO-2 on local ranks.
#[derive(Parser, Debug)]
#[command(name = "custom_module")]
struct Args {
    /// Local ranks (threads in this process).
    #[arg(long, default_value_t = 2)]
    ranks: usize,
    /// Optimizer steps.
    #[arg(long, default_value_t = 60)]
    steps: u64,
    /// Residual blocks between the embedding and the head.
    #[arg(long, default_value_t = 2)]
    blocks: usize,
    /// Model width.
    #[arg(long, default_value_t = 32)]
    width: usize,
    /// Hidden width inside each block.
    #[arg(long, default_value_t = 128)]
    inner: usize,
    /// Plant a bug in the block's backward, to see what a failing gradient check reports.
    #[arg(long, value_enum, default_value_t = Bug::None)]
    bug: Bug,
}

/// A deliberate mistake in [`ResidualMlp::backward`], for seeing gradcheck catch it.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
enum Bug {
    /// The correct backward.
    None,
    /// Forget the residual path's gradient: a classic slip that still trains, just worse.
    SkipResidual,
}

/// The vocabulary and sequence length of the synthetic task.
const VOCAB: usize = 64;
const SEQ: usize = 16;

/// ZeRO-2: optimizer state and gradients sharded across ranks, parameters replicated.
/// Written in code to show that a config need not be a file; it goes through the same
/// validation as one (a typo here is an error that names the key).
const CONFIG: &str = r#"
train_micro_batch_size_per_gpu = 8
gradient_accumulation_steps = 1
gradient_clipping = 1.0
seed = 7

[zero_optimization]
stage = 2
overlap_comm = true

[optimizer]
type = "AdamW"
params = { lr = 1e-2, betas = [0.9, 0.98], weight_decay = 0.0 }
"#;

// ---------------------------------------------------------------------------------------
// The user-defined module.
// ---------------------------------------------------------------------------------------

/// `y = x + W2·gelu(W1·x + b1) + b2` over the last dimension of `[batch, seq, width]`.
/// Weights are stored `[out, in]` like PyTorch's `nn.Linear`, so a Hugging Face-style
/// checkpoint of the same block would load unchanged.
struct ResidualMlp {
    prefix: String,
    width: usize,
    inner: usize,
    bug: Bug,
}

/// What forward keeps for backward: the input (for `dW1`) and the pre-activation (for
/// gelu's derivative and, recomputed, for `dW2`). Recomputing `gelu(pre)` in backward
/// costs one cheap pass and saves a third buffer of activations.
struct MlpSaved {
    x: Storage,
    pre: Storage,
}

impl SavedState for MlpSaved {
    fn bytes(&self) -> usize {
        (self.x.bytes() + self.pre.bytes()) as usize
    }
    fn into_any(self: Box<Self>) -> Box<dyn Any> {
        self
    }
}

impl ResidualMlp {
    fn fc1(&self) -> Linear {
        Linear {
            d_in: self.width,
            d_out: self.inner,
            layout: WeightLayout::OutIn,
        }
    }

    fn fc2(&self) -> Linear {
        Linear {
            d_in: self.inner,
            d_out: self.width,
            layout: WeightLayout::OutIn,
        }
    }

    /// Rows of the batch, after checking that `t` holds `rows × width` values: the engine
    /// passes whatever the previous unit produced, so a mismatch must be an error, not a panic.
    fn rows(&self, ctx: &Ctx<'_>, t: &Tensor, what: &'static str) -> Result<usize> {
        let rows = ctx.batch.batch * ctx.batch.seq;
        if t.numel() != rows * self.width {
            return Err(Error::Shape {
                op: what,
                expected: format!("{rows} rows of width {}", self.width),
                got: format!("shape {:?}", t.shape),
            });
        }
        Ok(rows)
    }

    /// Checks the lent views, so a layout mix-up surfaces as an error naming this block.
    fn check_views(&self, p: &Params<'_>) -> Result<()> {
        let want: Vec<usize> = self.param_specs().iter().map(ParamSpec::numel).collect();
        let got: Vec<usize> = (0..p.len()).map(|i| p.get(i).len()).collect();
        if got != want {
            return Err(Error::Shape {
                op: "residual MLP parameters",
                expected: format!("{}: views of lengths {want:?}", self.prefix),
                got: format!("{got:?}"),
            });
        }
        Ok(())
    }
}

impl Module for ResidualMlp {
    fn param_specs(&self) -> Vec<ParamSpec> {
        let spec = |name: &str, shape: Vec<usize>, init| ParamSpec {
            name: format!("{}.{name}", self.prefix),
            shape,
            init,
        };
        let w = Init::Normal { std: 0.02 };
        vec![
            spec("fc1.weight", vec![self.inner, self.width], w),
            spec("fc1.bias", vec![self.inner], Init::Zeros),
            spec("fc2.weight", vec![self.width, self.inner], w),
            spec("fc2.bias", vec![self.width], Init::Zeros),
        ]
    }

    fn forward(&self, ctx: &mut Ctx<'_>, p: &Params<'_>, input: &Tensor) -> Result<Tensor> {
        self.check_views(p)?;
        let rows = self.rows(ctx, input, "residual MLP forward")?;
        // Only backend operations and `ctx.alloc`: the same block runs on any device.
        let be = ctx.be;
        let mut pre = ctx.alloc(rows * self.inner)?;
        self.fc1()
            .forward(be, input.view(), p.get(0), Some(p.get(1)), pre.view_mut())?;
        let mut act = ctx.alloc(pre.len())?;
        be.gelu_forward(pre.view(), act.view_mut())?;
        let mut y = ctx.alloc(rows * self.width)?;
        self.fc2()
            .forward(be, act.view(), p.get(2), Some(p.get(3)), y.view_mut())?;
        be.add_assign(y.view_mut(), input.view())?;
        if ctx.training {
            let x = be.copy(input.view())?;
            *ctx.saved = Some(Box::new(MlpSaved { x, pre }));
        }
        Tensor::new(input.shape.clone(), y)
    }

    fn backward(
        &self,
        ctx: &mut Ctx<'_>,
        p: &Params<'_>,
        g: &mut Grads<'_>,
        dy: &Tensor,
    ) -> Result<Tensor> {
        self.check_views(p)?;
        let rows = self.rows(ctx, dy, "residual MLP backward")?;
        let s = take_saved(ctx, &self.prefix)?;
        if s.x.len() != dy.numel() {
            return Err(Error::Invalid(format!(
                "{}: backward got another batch than forward saw",
                self.prefix
            )));
        }
        let be = ctx.be;
        let mut act = ctx.alloc(s.pre.len())?;
        be.gelu_forward(s.pre.view(), act.view_mut())?;
        // Parameter gradients are added (+=) into the lent buffers, never assigned: the
        // contract lets every reader of a parameter (tied weights) add its own share.
        // `backward_params` adds by design.
        let (dw2, db2) = g.require_pair(2, 3)?;
        self.fc2()
            .backward_params(be, act.view(), dy.view(), dw2, Some(db2))?;
        let mut dact = act;
        self.fc2().backward_input(
            be,
            dy.view(),
            p.get(2),
            dact.view_mut(),
            Accumulate::Overwrite,
        )?;
        let mut dpre = ctx.alloc(rows * self.inner)?;
        be.gelu_backward(s.pre.view(), dact.view(), dpre.view_mut())?;
        let (dw1, db1) = g.require_pair(0, 1)?;
        self.fc1()
            .backward_params(be, s.x.view(), dpre.view(), dw1, Some(db1))?;
        // The residual path passes dy straight through; the branch adds its share.
        let mut dx = match self.bug {
            Bug::None => be.copy(dy.view())?,
            Bug::SkipResidual => ctx.alloc(dy.numel())?,
        };
        self.fc1()
            .backward_input(be, dpre.view(), p.get(0), dx.view_mut(), Accumulate::Add)?;
        Tensor::new(dy.shape.clone(), dx)
    }
}

/// Takes this block's saved state, or explains why backward cannot run.
fn take_saved(ctx: &mut Ctx<'_>, unit: &str) -> Result<Box<MlpSaved>> {
    let state = ctx.saved.take().ok_or_else(|| {
        Error::Invalid(format!("{unit}: backward without a training-mode forward"))
    })?;
    state
        .into_any()
        .downcast::<MlpSaved>()
        .map_err(|_| Error::Invalid(format!("{unit}: saved state belongs to another module")))
}

// ---------------------------------------------------------------------------------------
// Gradient check, model assembly, data, training.
// ---------------------------------------------------------------------------------------

/// Checks the block's backward against central finite differences. The parameters are
/// drawn at unit scale (weights `N(0, 1/fan_in)`, biases `N(0, 0.5²)`) rather than the tiny
/// training init, so that gelu's curvature and the biases really take part.
fn check_gradients(block: &ResidualMlp) -> Result<Report> {
    let batch = Batch {
        batch: 2,
        seq: 3,
        tokens: vec![0; 6],
        targets: vec![0; 6],
    };
    let mut params: Vec<Vec<f32>> = block
        .param_specs()
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let std = match s.shape[..] {
                [_, fan_in] => 1.0 / (fan_in as f32).sqrt(),
                _ => 0.5,
            };
            let mut v = vec![0.0; s.numel()];
            init::fill(&Init::Normal { std }, 100 + i as u64, &mut v);
            v
        })
        .collect();
    let x: Vec<f32> = (0..6 * block.width)
        .map(|i| rng::normal(11, i as u64) as f32)
        .collect();
    let input = Tensor::from_f32(vec![2, 3, block.width], x)?;
    gradcheck::check(block, &batch, &mut params, &input, &Options::default())
}

/// Prints the per-tensor comparison and a one-line verdict; a failed check is an error.
fn verdict(report: &Report) -> std::result::Result<(), String> {
    print!("{report}");
    if !report.passed() {
        return Err(
            "gradcheck FAILED: the block's backward disagrees with finite differences \
                    (see the failures column above)"
                .into(),
        );
    }
    let max_rel = report.tensors.iter().map(|t| t.max_rel).fold(0.0, f64::max);
    let max_abs = report.tensors.iter().map(|t| t.max_abs).fold(0.0, f64::max);
    let checked: usize = report.tensors.iter().map(|t| t.checked).sum();
    println!(
        "gradcheck passed: {checked} elements in {} tensors, max abs error {max_abs:.2e}, \
         max relative error {max_rel:.2e}",
        report.tensors.len()
    );
    Ok(())
}

/// The library's Llama embedding and RMSNorm + LM head read only the sizes below from a
/// `LlamaConfig`; attention settings are irrelevant to them.
fn ends_config(args: &Args) -> LlamaConfig {
    LlamaConfig {
        hidden_size: args.width,
        intermediate_size: args.inner,
        num_hidden_layers: args.blocks,
        num_attention_heads: 1,
        num_key_value_heads: None,
        head_dim: None,
        rms_norm_eps: 1e-6,
        rope: Rope::plain(10000.0),
        vocab_size: VOCAB,
        max_position_embeddings: SEQ,
        tie_word_embeddings: false,
        initializer_range: 0.02,
        qkv_bias: false,
        sliding_window: None,
        attention_dropout: 0.0,
    }
}

fn block(args: &Args, i: usize) -> ResidualMlp {
    ResidualMlp {
        prefix: format!("blocks.{i}"),
        width: args.width,
        inner: args.inner,
        bug: args.bug,
    }
}

/// embed → blocks.0 … blocks.{n-1} → head. Each unit is one flat buffer for ZeRO.
fn build_model(args: &Args) -> Model {
    let ends = ends_config(args);
    let unit = |name: String, module: Arc<dyn Module>| Unit {
        name,
        module,
        uses_shared: vec![],
    };
    let mut units = vec![unit("embed".into(), Arc::new(llama::embed(&ends)))];
    for i in 0..args.blocks {
        units.push(unit(format!("blocks.{i}"), Arc::new(block(args, i))));
    }
    units.push(unit("head".into(), Arc::new(llama::head(&ends))));
    Model::new(vec![], units)
}

/// Rows `first..first + rows` of the task: random tokens, each to be mapped to
/// `(7·token + 3) mod VOCAB` (7 is coprime with 64, so the map is a permutation).
fn task_batch(first: u64, rows: usize) -> Batch {
    let n = rows * SEQ;
    let tokens: Vec<u32> = (0..n as u64)
        .map(|i| (rng::bits(3, first * SEQ as u64 + i) % VOCAB as u64) as u32)
        .collect();
    let targets = tokens
        .iter()
        .map(|&t| ((7 * t + 3) % VOCAB as u32) as i32)
        .collect();
    Batch {
        batch: rows,
        seq: SEQ,
        tokens,
        targets,
    }
}

/// Trains for `steps` and returns (first loss, last loss). Each rank reads its own rows.
fn train(engine: &mut Engine, steps: u64) -> Result<(f64, f64)> {
    let mb = engine.config().train_micro_batch_size_per_gpu;
    let (world, rank) = (engine.world_size() as u64, engine.rank() as u64);
    let (mut first, mut last) = (f64::NAN, f64::NAN);
    for step in 0..steps {
        let batch = task_batch((step * world + rank) * mb as u64, mb);
        let r = engine.train_batch(&[batch])?;
        if step == 0 {
            first = r.loss;
        }
        last = r.loss;
        if rank == 0 && (step % 10 == 0 || step + 1 == steps) {
            println!("step {:>4}  loss {:.4}", r.step, r.loss);
        }
    }
    Ok((first, last))
}

fn config() -> std::result::Result<Config, String> {
    let loaded = parse(CONFIG, Format::Toml, "custom_module (in code)")
        .map_err(|e| format!("the ZeRO config is invalid:\n{e}"))?;
    Ok(loaded.config)
}

fn run(args: &Args) -> std::result::Result<(), String> {
    if [args.width, args.inner, args.blocks, args.ranks].contains(&0) || args.steps == 0 {
        return Err("--width, --inner, --blocks, --ranks and --steps must be positive".into());
    }
    verdict(&check_gradients(&block(args, 0)).map_err(|e| e.to_string())?)?;
    let config = config()?;
    let losses = run_ranks(args.ranks, Duration::from_secs(300), |comm| {
        // Rank 0 speaks for all: the others would repeat the same summary lines.
        let _quiet = (comm.rank() != 0).then(|| {
            tracing::subscriber::set_default(tracing::subscriber::NoSubscriber::default())
        });
        let mut engine = EngineBuilder::new(build_model(args))
            .config(config.clone())
            .comm(comm)
            .hidden_size(args.width)
            .sequence_length(SEQ)
            .build()?;
        train(&mut engine, args.steps)
    })
    .map_err(|e| e.to_string())?;
    // The loss is the global batch's mean, identical on every rank; rank 0's will do.
    let (first, last) = losses[0];
    // "Fell" means by half at least: noise alone never does that on this task. A NaN
    // compares false, so a diverged run counts as not falling.
    let fell = last < 0.5 * first;
    if !fell {
        return Err(format!(
            "loss did not fall: first {first:.4}, last {last:.4}"
        ));
    }
    println!("loss fell: first {first:.4} -> last {last:.4}");
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse();
    // The engine logs its summary (stage, placement, bytes per rank) through `tracing`.
    // Colour only on a terminal, and never with NO_COLOR set.
    ferrozero::logging::init();
    ferrozero::logging::exit_code(run(&args))
}
