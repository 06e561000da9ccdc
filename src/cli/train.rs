//! `ferrozero train`: fine-tune a Hugging Face model directory on a text or token file with a
//! ZeRO config, on local ranks (threads) or as one rank of a `ferrozero launch` job.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use ferrozero::config::{Config, Device, Format, RenderStyle};
use ferrozero::data::{self, DataOptions, Rows, Shuffled};
use ferrozero::engine::EngineBuilder;
use ferrozero::train::{self, ModelDir, TrainOptions, Tuning};
use ferrozero_runtime::comm::Communicator;
use ferrozero_runtime::engine::checkpoint::Tag;
use ferrozero_runtime::Result;

/// The config a run without `--config` uses, built in so that no file is read from the
/// working directory.
pub const DEFAULT_CONFIG: &str = include_str!("../../configs/default.toml");

/// Arguments.
#[derive(clap::Args)]
pub struct Args {
    /// Model directory: config.json, model.safetensors and (for text data) tokenizer.json.
    #[arg(long)]
    model: PathBuf,
    /// Training data: .txt (one document), .jsonl (a "text" field per line) or pre-tokenized .bin.
    #[arg(long)]
    data: PathBuf,
    /// ZeRO config, TOML or DeepSpeed JSON [default: the built-in configs/default.toml].
    #[arg(long)]
    config: Option<PathBuf>,
    /// Write the trained model here as a model directory (weights, config, tokenizer files);
    /// with --peft, a PEFT adapter directory (adapter_config.json, adapter_model.safetensors).
    #[arg(long)]
    output: Option<PathBuf>,
    /// LoRA: a PEFT adapter_config.json (new adapters) or a PEFT adapter directory (start
    /// from its weights); the base model is frozen.
    #[arg(long)]
    peft: Option<PathBuf>,
    /// With --peft and --output: write the model with the adapters merged in (PEFT's
    /// merge_and_unload) instead of the adapter directory.
    #[arg(long, requires = "peft")]
    merge: bool,
    /// Freeze the parameters whose Hugging Face names match these globs, in order (the last
    /// matching pattern decides; a leading `!` thaws), e.g. --freeze '*' '!model.layers.31.*'.
    #[arg(long, num_args = 1..)]
    freeze: Vec<String>,
    /// Compute device: auto, cpu, cuda or cuda:N (overrides the config's `device`).
    #[arg(long)]
    device: Option<Device>,
    /// Local ranks (threads in this process); 1 per process under `ferrozero launch`.
    #[arg(long, default_value_t = 1)]
    ranks: usize,
    /// Optimizer steps [default: one epoch].
    #[arg(long, conflicts_with = "epochs")]
    steps: Option<u64>,
    /// Passes over the training rows.
    #[arg(long)]
    epochs: Option<u64>,
    /// Tokens per row [default: the model's positions, at most 512].
    #[arg(long)]
    seq_len: Option<usize>,
    /// Held-out loss every N steps (it is always reported at the end).
    #[arg(long)]
    eval_every: Option<u64>,
    /// Share of the rows held out for evaluation (0 for none).
    #[arg(long, default_value_t = 0.05)]
    eval_fraction: f64,
    /// At most this many held-out rows per evaluation.
    #[arg(long, default_value_t = 256)]
    eval_rows: usize,
    /// Checkpoint into this directory at the end (and every --save-every steps).
    #[arg(long)]
    save: Option<PathBuf>,
    /// Also checkpoint every N steps (with --save).
    #[arg(long)]
    save_every: Option<u64>,
    /// Continue from the latest checkpoint in this directory (data position included).
    #[arg(long)]
    resume: Option<PathBuf>,
    /// One JSON object per step and per evaluation here.
    #[arg(long)]
    metrics: Option<PathBuf>,
    /// Visit rows in a seeded random order instead of consecutively.
    #[arg(long)]
    shuffle: bool,
    /// Seed of the row order.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Do not cache tokenized text next to the data.
    #[arg(long)]
    no_cache: bool,
    /// No progress bar (a log line every `steps_per_print` steps instead).
    #[arg(long)]
    no_progress: bool,
    /// The device's peak dense TFLOP/s for `mfu` in the metrics (overrides the config's
    /// `flops_profiler.peak_tflops`; known GPUs need none, the CPU reports no MFU without it).
    #[arg(long, value_parser = ferrozero::train::parse_peak_tflops)]
    peak_tflops: Option<f64>,
}

/// Runs the subcommand.
pub fn run(args: Args) -> ExitCode {
    ferrozero::logging::init();
    ferrozero::logging::exit_code(train_job(&args))
}

fn zero_config(args: &Args) -> std::result::Result<Config, String> {
    let loaded = match &args.config {
        Some(p) => ferrozero::config::load(p),
        None => ferrozero::config::parse(DEFAULT_CONFIG, Format::Toml, "built-in default.toml"),
    }
    .map_err(|e| e.to_string())?;
    for w in &loaded.warnings {
        eprintln!("{}", w.render(RenderStyle::Plain));
    }
    let mut config = loaded.config;
    if let Some(d) = args.device {
        config.device = d;
    }
    if let Some(p) = args.peak_tflops {
        config.flops_profiler.peak_tflops = Some(p);
    }
    Ok(config)
}

fn train_job(args: &Args) -> std::result::Result<(), Box<dyn std::error::Error>> {
    let model = train::load_model(&args.model)?;
    let positions = model.spec.max_seq();
    let seq = args.seq_len.unwrap_or(positions.min(512));
    if seq < 1 || seq > positions {
        return Err(format!(
            "--seq-len {seq} must be between 1 and the model's {positions} positions"
        )
        .into());
    }
    // Read and checked before the corpus: a typo in the config costs no tokenization.
    let config = zero_config(args)?;
    let tuning = Tuning::from_args(args.peft.as_deref(), &args.freeze, &model.spec)?;
    let tokenizer = model.tokenizer();
    let corpus = data::open(
        &args.data,
        &DataOptions {
            seq_len: seq,
            vocab: model.spec.vocab(),
            tokenizer: Some(&tokenizer),
            eos: model.eos,
            eval_fraction: args.eval_fraction,
            cache: !args.no_cache,
        },
    )?;
    println!(
        "data: {} tokens{}, {} training rows and {} held out of {seq} tokens",
        corpus.tokens,
        if corpus.from_cache { " (cached)" } else { "" },
        corpus.train.len(),
        corpus.eval.as_ref().map_or(0, |e| e.len())
    );
    let rows: Arc<dyn Rows> = if args.shuffle {
        let n = corpus.train.len();
        Arc::new(Shuffled {
            inner: corpus.train.clone(),
            n,
            seed: args.seed,
        })
    } else {
        Arc::new(corpus.train.clone())
    };
    let eval = corpus.eval.clone();
    let job = |comm: Box<dyn Communicator>| {
        rank(
            args,
            (&model, &tuning),
            &config,
            &*rows,
            eval.as_ref().map(|e| e as &dyn Rows),
            comm,
        )
    };
    train::run_job(&config, args.ranks, job)?;
    Ok(())
}

fn rank(
    args: &Args,
    (model, tuning): (&ModelDir, &Tuning),
    config: &Config,
    rows: &dyn Rows,
    eval: Option<&dyn Rows>,
    comm: Box<dyn Communicator>,
) -> Result<()> {
    let quiet = comm.rank() != 0;
    let _guard = quiet
        .then(|| tracing::subscriber::set_default(tracing::subscriber::NoSubscriber::default()));
    let mut engine = EngineBuilder::new(tuning.build(&model.spec)?)
        .config(config.clone())
        .comm(comm)
        .hidden_size(model.spec.hidden())
        .sequence_length(rows.seq_len())
        .build()?;
    tuning.load(&mut engine, &model.weights)?;
    engine.set_model_files(tuning.model_files(&model.files, &model.dir));
    let first = match &args.resume {
        Some(dir) => engine.load_checkpoint(dir, &Tag::Latest)?.data_position,
        None => 0,
    };
    let steps = match args.steps {
        Some(s) => s,
        None => train::steps_for_epochs(&engine, rows, args.epochs.unwrap_or(1)),
    };
    let opts = TrainOptions {
        steps,
        progress: !args.no_progress,
        metrics: args.metrics.clone(),
        save: args.save.clone(),
        save_every: args.save_every,
        eval_every: args.eval_every,
        eval_rows: args.eval_rows,
        ..Default::default()
    };
    let summary = train::train(&mut engine, &opts, rows, eval, first)?;
    if let Some(out) = &args.output {
        tuning.write_output(&engine, out, &model.files, args.merge)?;
        if engine.rank() == 0 {
            println!("wrote {}", out.display());
        }
    }
    if engine.rank() == 0 {
        if let (Some(a), Some(b)) = (summary.losses.first(), summary.losses.last()) {
            println!(
                "trained {} steps: loss {a:.4} -> {b:.4}",
                summary.losses.len()
            );
        }
    }
    Ok(())
}
