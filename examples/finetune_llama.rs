//! Fine-tune a Llama from a safetensors checkpoint with ZeRO-3 and CPU offload, then turn the
//! sharded training checkpoint back into one Hugging Face weights file.
//!
//!     cargo run --release --example finetune_llama
//!
//! The life cycle it walks through, as you would with a downloaded model:
//! 1. Start from Hugging Face-named weights. Without `--init`, the example writes a stand-in
//!    "pretrained" file first, so it runs offline; with `--init DIR` (a model directory, an
//!    index or one `.safetensors` file) it uses yours
//!    (a `--model-config config.json` describes its shape).
//! 2. Load them into the engine (`ModelWeights::open` + `Engine::load_parameters`): every rank reads
//!    the full values and keeps only what its stage stores (under ZeRO-3 a shard each).
//! 3. Fine-tune with ZeRO stage 3, optimizer state and parameters offloaded to host memory, on
//!    local ranks, on a synthetic next-token task (counting with a per-row stride).
//! 4. Save a sharded checkpoint (one file per rank), consolidate it offline into
//!    `model.safetensors`, reload that file and check it equals the live parameters bit for bit:
//!    what you ship is exactly what you trained.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use ferrozero::config::{Config, Format};
use ferrozero::data::{self, DataOptions, Rows};
use ferrozero::engine::{Engine, EngineBuilder, NamedTensor};
use ferrozero::runtime::backend::rng;
use ferrozero::runtime::comm::local::run_ranks;
use ferrozero::runtime::engine::checkpoint::{consolidate, OutputDType, Tag};
use ferrozero::runtime::nn::hf::{Architecture, HfModel, ModelConfig};
use ferrozero::runtime::nn::llama::{self, LlamaConfig};
use ferrozero::runtime::nn::peft::{is_adapter_param, PeftRun};
use ferrozero::runtime::nn::weights::{self, ModelWeights, Naming, ParamSource};
use ferrozero::runtime::nn::{init, Model, ParamSpec};
use ferrozero::runtime::tensor::DType;
use ferrozero::train::micro_batches;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Fine-tune a Llama with ZeRO-3 + CPU offload and consolidate the result.
#[derive(Parser, Debug)]
#[command(name = "finetune_llama")]
struct Args {
    /// A Hugging Face Llama `config.json`; default: the tiny preset (2 layers, width 32).
    #[arg(long)]
    model_config: Option<PathBuf>,
    /// Weights to start from (safetensors, Hugging Face names); default: a stand-in file
    /// written into --out.
    #[arg(long)]
    init: Option<PathBuf>,
    /// ZeRO config (TOML or DeepSpeed JSON); default: stage 3 with CPU offload, in code.
    /// Presets for a 40 GB GPU: `configs/llama7b_40gb.toml`, `configs/llama13b_40gb_nvme.toml`.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Compute device: auto, cpu, cuda or cuda:N (overrides the config's `device`).
    #[arg(long)]
    device: Option<ferrozero::config::Device>,
    /// Local ranks (threads in this process).
    #[arg(long, default_value_t = 2)]
    ranks: usize,
    /// Optimizer steps.
    #[arg(long, default_value_t = 60)]
    steps: u64,
    /// Tokens per training row (at most the model's max_position_embeddings).
    #[arg(long, default_value_t = 32)]
    seq_len: usize,
    /// Print the loss every N steps.
    #[arg(long, default_value_t = 10)]
    print_every: u64,
    /// Fine-tune on this file instead of the synthetic task: .txt or .jsonl (with
    /// --tokenizer) or a .bin token file, read by `ferrozero::data`.
    #[arg(long)]
    data: Option<PathBuf>,
    /// The model's tokenizer.json, for --data text.
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Output directory (checkpoints, model.safetensors); default: a fresh temporary one.
    #[arg(long)]
    out: Option<PathBuf>,
    /// LoRA: a PEFT adapter_config.json (new adapters) or adapter directory (start from its
    /// weights); the base model is frozen, and `adapter/` in --out gets the trained adapter
    /// as PEFT writes it.
    #[arg(long)]
    peft: Option<PathBuf>,
}

/// ZeRO-3: parameters, gradients and optimizer state sharded across ranks; both the
/// parameter shards and the optimizer state live in (pinned) host memory, the ZeRO-Offload
/// setup for models larger than the devices. bf16 compute with fp32 master weights.
const CONFIG: &str = r#"
train_micro_batch_size_per_gpu = 8
gradient_accumulation_steps = 1
gradient_clipping = 1.0
seed = 1234

[zero_optimization]
stage = 3
overlap_comm = true

[zero_optimization.offload_param]
device = "cpu"
pin_memory = true

[zero_optimization.offload_optimizer]
device = "cpu"
pin_memory = true

[bf16]
enabled = true

[optimizer]
type = "AdamW"
params = { lr = 5e-3, betas = [0.9, 0.98], weight_decay = 0.0 }
"#;

/// The seed of the stand-in pretrained weights: unlike the config's `seed`, so that loading
/// them visibly replaces the engine's own initialisation.
const PRETRAINED_SEED: u64 = 2024;

fn model_config(args: &Args) -> Result<LlamaConfig, BoxError> {
    let cfg = match &args.model_config {
        Some(p) => LlamaConfig::from_json_file(p)?,
        None => LlamaConfig::preset("tiny")?,
    };
    if args.seq_len < 2 || args.seq_len > cfg.max_position_embeddings {
        return Err(format!(
            "--seq-len {} must be between 2 and the model's max_position_embeddings ({})",
            args.seq_len, cfg.max_position_embeddings
        )
        .into());
    }
    Ok(cfg)
}

fn zero_config(args: &Args) -> Result<Config, BoxError> {
    let loaded = match &args.config {
        Some(p) => ferrozero::config::load(p),
        None => ferrozero::config::parse(CONFIG, Format::Toml, "finetune_llama (in code)"),
    }
    .map_err(|e| format!("the ZeRO config is invalid:\n{e}"))?;
    for w in &loaded.warnings {
        eprintln!("{}", w.render(ferrozero::config::RenderStyle::Plain));
    }
    let mut config = loaded.config;
    if let Some(d) = args.device {
        config.device = d;
    }
    Ok(config)
}

/// Every parameter the model declares, in layout order (units, then tied parameters).
fn param_specs(model: &Model) -> Vec<ParamSpec> {
    model
        .units
        .iter()
        .flat_map(|u| u.module.param_specs())
        .chain(model.shared.iter().cloned())
        .collect()
}

/// Writes a stand-in for a downloaded checkpoint: every parameter drawn from its declared
/// initialiser with another seed, under its Hugging Face name.
fn write_pretrained(cfg: &LlamaConfig, path: &Path) -> Result<(), BoxError> {
    let specs = param_specs(&llama::build(cfg)?);
    let values: Vec<Vec<f32>> = specs
        .iter()
        .map(|s| {
            let mut v = vec![0.0; s.numel()];
            init::fill(&s.init, init::param_seed(PRETRAINED_SEED, &s.name), &mut v);
            v
        })
        .collect();
    let tensors: Vec<(&str, &[usize], &[f32])> = specs
        .iter()
        .zip(&values)
        .map(|(s, v)| (s.name.as_str(), s.shape.as_slice(), v.as_slice()))
        .collect();
    weights::save(path, &tensors, DType::F32)?;
    println!(
        "wrote stand-in pretrained weights: {} ({} tensors)",
        path.display(),
        specs.len()
    );
    Ok(())
}

/// Maps the model's weights (a model directory, an index with its shards, or one safetensors
/// file) and checks them against the model: a missing name or a wrong shape is an error naming
/// the file and tensor; buffers some exports carry (rotary caches) are ignored.
fn read_init(cfg: &LlamaConfig, path: &Path) -> Result<ModelWeights, BoxError> {
    let specs = param_specs(&llama::build(cfg)?);
    let expected: Vec<(&str, &[usize])> = specs
        .iter()
        .map(|s| (s.name.as_str(), s.shape.as_slice()))
        .collect();
    let model = ModelWeights::open(path, Naming::Exact)?;
    model.check(&expected)?;
    Ok(model)
}

/// Row `r` of the task: `x, x+k, x+2k, ...` modulo the vocabulary, with a start `x` and a
/// stride `k` in 1..=3 drawn per row. After two tokens the rest is determined, so a model
/// that learns to read the stride from its context drives the loss far below `ln(vocab)`.
fn task_row(row: u64, seq: usize, vocab: usize, tokens: &mut Vec<u32>, targets: &mut Vec<i32>) {
    let start = rng::bits(17, 2 * row) % vocab as u64;
    let stride = 1 + rng::bits(17, 2 * row + 1) % 3;
    let at = |t: usize| ((start + stride * t as u64) % vocab as u64) as u32;
    tokens.extend((0..seq).map(at));
    targets.extend((1..=seq).map(|t| at(t) as i32));
}

/// The synthetic task as rows, for the library's batching.
struct Counting {
    seq: usize,
    vocab: usize,
}

impl Rows for Counting {
    fn seq_len(&self) -> usize {
        self.seq
    }
    fn vocab(&self) -> usize {
        self.vocab
    }
    fn len(&self) -> u64 {
        // An endless stream: row k is drawn from k.
        u64::MAX
    }
    fn row(&self, k: u64) -> (Vec<u32>, Vec<i32>) {
        let (mut tokens, mut targets) = (Vec::new(), Vec::new());
        task_row(k, self.seq, self.vocab, &mut tokens, &mut targets);
        (tokens, targets)
    }
}

/// The rows to fine-tune on: `--data` through the library's data path (a .txt or .jsonl file
/// with `--tokenizer`, or a .bin token file), else the synthetic task.
fn rows(args: &Args, cfg: &LlamaConfig) -> Result<Box<dyn Rows>, BoxError> {
    let Some(path) = &args.data else {
        return Ok(Box::new(Counting {
            seq: args.seq_len,
            vocab: cfg.vocab_size,
        }));
    };
    let opts = DataOptions {
        seq_len: args.seq_len,
        vocab: cfg.vocab_size,
        tokenizer: args.tokenizer.as_deref(),
        eos: None,
        eval_fraction: 0.0,
        cache: true,
    };
    Ok(Box::new(data::open(path, &opts)?.train))
}

/// Fine-tunes and returns the first and last loss (global means, the same on every rank).
fn train(
    engine: &mut Engine,
    args: &Args,
    rows: &dyn Rows,
) -> ferrozero::runtime::Result<(f64, f64)> {
    let (mut first, mut last) = (f64::NAN, f64::NAN);
    let every = args.print_every.max(1);
    for step in 0..args.steps {
        let r = engine.train_batch(&micro_batches(engine, rows, step))?;
        if step == 0 {
            first = r.loss;
        }
        last = r.loss;
        if engine.rank() == 0 && (step % every == 0 || step + 1 == args.steps) {
            println!("step {:>4}  loss {:.4}  lr {:.1e}", r.step, r.loss, r.lr);
        }
    }
    Ok((first, last))
}

/// What rank 0 brings back from the ranks.
struct Trained {
    first_loss: f64,
    last_loss: f64,
    live: Vec<NamedTensor>,
}

/// Runs the ranks: build, load the initial weights, fine-tune, checkpoint, and read the live
/// parameters (a collective, so every rank takes part; rank 0 keeps them).
fn fine_tune(
    args: &Args,
    cfg: &LlamaConfig,
    zero: &Config,
    init: &ModelWeights,
    ckpt_dir: &Path,
    lora: Option<&PeftRun>,
) -> Result<Trained, BoxError> {
    let rows = rows(args, cfg)?;
    let out = run_ranks(args.ranks, Duration::from_secs(300), |comm| {
        // Rank 0 speaks for all: the others would repeat the same summary lines.
        let _quiet = (comm.rank() != 0).then(|| {
            tracing::subscriber::set_default(tracing::subscriber::NoSubscriber::default())
        });
        let model = match lora {
            Some(run) => run.build()?,
            None => llama::build(cfg)?,
        };
        let mut engine = EngineBuilder::new(model)
            .config(zero.clone())
            .comm(comm)
            .hidden_size(cfg.hidden_size)
            .sequence_length(args.seq_len)
            .build()?;
        // Under LoRA the base weights load around the adapters, which start as PEFT starts
        // them or from the adapter directory.
        engine.load_parameters_where(init, &|n| lora.is_none() || !is_adapter_param(n))?;
        if let Some(start) = lora.map(PeftRun::start_values).filter(|s| !s.is_empty()) {
            engine.set_parameters(&start)?;
        }
        let (first_loss, last_loss) = train(&mut engine, args, &*rows)?;
        let tag = format!("step-{}", args.steps);
        let path = engine.save_checkpoint(ckpt_dir, &tag, args.steps)?;
        if engine.rank() == 0 {
            println!("saved sharded checkpoint: {}", path.display());
        }
        let live = engine.parameters()?;
        Ok((engine.rank() == 0).then_some(Trained {
            first_loss,
            last_loss,
            live,
        }))
    })?;
    out.into_iter()
        .next()
        .flatten()
        .ok_or_else(|| "rank 0 returned no parameters".into())
}

/// Compares two parameter sets bit for bit; returns (tensors, elements) or what differs.
fn compare(live: &[NamedTensor], file: &[NamedTensor]) -> Result<(usize, usize), String> {
    let by_name: HashMap<&str, &NamedTensor> = file.iter().map(|t| (t.name.as_str(), t)).collect();
    if by_name.len() != live.len() {
        return Err(format!(
            "the file holds {} tensors, the engine {}",
            by_name.len(),
            live.len()
        ));
    }
    let mut elements = 0;
    for t in live {
        let f = by_name
            .get(t.name.as_str())
            .ok_or_else(|| format!("`{}` is missing from the file", t.name))?;
        if f.shape != t.shape {
            return Err(format!(
                "`{}`: shape {:?} in the file, {:?} live",
                t.name, f.shape, t.shape
            ));
        }
        let differ = t
            .data
            .iter()
            .zip(&f.data)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        if differ > 0 {
            return Err(format!(
                "`{}`: {differ} of {} values differ",
                t.name,
                t.data.len()
            ));
        }
        elements += t.data.len();
    }
    Ok((live.len(), elements))
}

fn out_dir(args: &Args) -> Result<PathBuf, BoxError> {
    let dir = match &args.out {
        Some(d) => d.clone(),
        None => {
            std::env::temp_dir().join(format!("ferrozero-finetune-llama-{}", std::process::id()))
        }
    };
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    Ok(dir)
}

/// The weights to start from: `--init` (read before anything is written, so a bad file
/// leaves no output behind), or stand-in weights written into `out` and read back.
fn initial_weights(args: &Args, cfg: &LlamaConfig) -> Result<(ModelWeights, PathBuf), BoxError> {
    let given = args.init.as_ref().map(|p| read_init(cfg, p)).transpose()?;
    let out = out_dir(args)?;
    println!("outputs in {}", out.display());
    let (init, path) = match (given, &args.init) {
        (Some(init), Some(p)) => (init, p.clone()),
        _ => {
            let p = out.join("pretrained.safetensors");
            write_pretrained(cfg, &p)?;
            (read_init(cfg, &p)?, p)
        }
    };
    println!(
        "loaded {} tensors from {}",
        init.names().count(),
        path.display()
    );
    Ok((init, out))
}

/// Prints the loss verdict; a NaN compares false, so a diverged run counts as not falling.
fn loss_fell(t: &Trained) -> bool {
    let (first, last) = (t.first_loss, t.last_loss);
    let fell = last < first;
    if fell {
        println!("loss fell: first {first:.4} -> last {last:.4}");
    } else {
        println!("loss did NOT fall: first {first:.4} -> last {last:.4}");
    }
    fell
}

/// Consolidates the latest checkpoint into `model.safetensors` and checks it against the
/// live parameters, bit for bit.
fn consolidate_and_check(
    ckpt_dir: &Path,
    out: &Path,
    live: &[NamedTensor],
) -> Result<(), BoxError> {
    let model_file = out.join("model.safetensors");
    // f32: the fp32 master weights as they are (bf16 would halve the file for shipping,
    // but then it could not be compared bit for bit with what the engine holds).
    let rep = consolidate(ckpt_dir, &Tag::Latest, &model_file, OutputDType::F32)?;
    println!(
        "consolidated {} tensors ({} bytes) into {}",
        rep.tensors,
        rep.bytes,
        model_file.display()
    );
    let (tensors, params) = compare(live, &weights::load(&model_file, Naming::Exact)?)
        .map_err(|e| format!("consolidated weights do NOT match live parameters: {e}"))?;
    println!("consolidated weights match live parameters: {tensors} tensors, {params} params");
    Ok(())
}

fn run(args: &Args) -> Result<(), BoxError> {
    if args.ranks == 0 || args.steps == 0 {
        return Err("--ranks and --steps must be at least 1".into());
    }
    let cfg = model_config(args)?;
    let zero = zero_config(args)?;
    let base = HfModel {
        architecture: Architecture::Llama,
        config: ModelConfig::Llama(cfg.clone()),
    };
    // Read and checked against the model before anything is written.
    let lora = args
        .peft
        .as_ref()
        .map(|p| PeftRun::open(p, &base))
        .transpose()?;
    let (init, out) = initial_weights(args, &cfg)?;
    let ckpt_dir = out.join("checkpoints");
    let trained = fine_tune(args, &cfg, &zero, &init, &ckpt_dir, lora.as_ref())?;
    let fell = loss_fell(&trained);
    // The checkpoint is worth consolidating either way; the verdict comes last.
    consolidate_and_check(&ckpt_dir, &out, &trained.live)?;
    if let Some(run) = &lora {
        let dir = out.join("adapter");
        run.write(&dir, &trained.live, DType::F32)?;
        println!(
            "wrote the trained adapter as PEFT writes it: {}",
            dir.display()
        );
    }
    if !fell {
        return Err("the loss did not fall during fine-tuning".into());
    }
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse();
    // The engine logs its summary (stage, placement, bytes per rank) through `tracing`.
    // Colour only on a terminal, and never with NO_COLOR set.
    ferrozero::logging::init();
    ferrozero::logging::exit_code(run(&args))
}
