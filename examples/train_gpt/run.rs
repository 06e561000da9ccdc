//! Each rank's job on the library's training loop, and the addition task's evaluation.

use std::sync::Arc;

use ferrozero::data::{self, DataOptions, Rows, Shuffled};
use ferrozero::engine::{Engine, EngineBuilder};
use ferrozero::runtime::comm::Communicator;
use ferrozero::runtime::engine::checkpoint::Tag;
use ferrozero::runtime::nn::hf::HfModel;
use ferrozero::runtime::nn::weights::{ModelFiles, ModelWeights};
use ferrozero::runtime::nn::IGNORE_INDEX;
use ferrozero::train::{self, TrainOptions};

use crate::data::Addition;
use crate::Args;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The config a run without `--config` uses: built in, so the example runs from anywhere.
const DEFAULT_CONFIG: &str = include_str!("../../configs/default.toml");

/// The data the run trains on, and the held-out rows for the addition task.
struct Data {
    train: Arc<dyn Rows>,
    eval: Option<Arc<dyn Rows>>,
    heldout: Option<Addition>,
}

fn data(args: &Args, vocab: usize) -> Result<Data, BoxError> {
    let Some(path) = &args.data else {
        let train = Addition {
            digits: args.digits,
            seed: args.seed,
        };
        return Ok(Data {
            train: Arc::new(train),
            eval: None,
            heldout: Some(Addition {
                digits: args.digits,
                seed: args.seed ^ 0x5eed_0fc0_ffee,
            }),
        });
    };
    let corpus = data::open(
        path,
        &DataOptions {
            seq_len: args.seq_len,
            vocab,
            tokenizer: args.tokenizer.as_deref(),
            eos: None,
            eval_fraction: args.eval_fraction,
            cache: true,
        },
    )?;
    let train: Arc<dyn Rows> = if args.shuffle {
        Arc::new(Shuffled {
            n: corpus.train.len(),
            inner: corpus.train,
            seed: args.seed,
        })
    } else {
        Arc::new(corpus.train)
    };
    Ok(Data {
        train,
        eval: corpus.eval.map(|e| Arc::new(e) as Arc<dyn Rows>),
        heldout: None,
    })
}

fn zero_config(args: &Args) -> Result<ferrozero::config::Config, BoxError> {
    let loaded = match &args.config {
        Some(p) => ferrozero::config::load(p),
        None => ferrozero::config::parse(
            DEFAULT_CONFIG,
            ferrozero::config::Format::Toml,
            "built-in configs/default.toml",
        ),
    }
    .map_err(|e| e.to_string())?;
    for w in &loaded.warnings {
        eprintln!("{}", w.render(ferrozero::config::RenderStyle::Plain));
    }
    let mut config = loaded.config;
    if let Some(d) = args.device {
        config.device = d;
    }
    if let Some(l) = args.device_memory_limit {
        config.device_memory_limit = Some(l);
    }
    if let Some(p) = args.peak_tflops {
        config.flops_profiler.peak_tflops = Some(p);
    }
    Ok(config)
}

/// Runs the whole job: one thread per rank (or this process as one rank of a launched job),
/// rank 0 reports.
pub fn run(args: &Args) -> Result<(), BoxError> {
    let spec = train::model::parse(&args.model_config)?;
    let data = data(args, spec.vocab())?;
    if data.train.vocab() > spec.vocab() || data.train.seq_len() > spec.max_seq() {
        return Err(format!(
            "the data needs vocabulary {} and {} positions; the model has {} and {}",
            data.train.vocab(),
            data.train.seq_len(),
            spec.vocab(),
            spec.max_seq()
        )
        .into());
    }
    let config = zero_config(args)?;
    let tuning = train::Tuning::from_args(args.peft.as_deref(), &args.freeze, &spec)?;
    // Mapped, not read: each rank copies out only what its stage keeps.
    let init = match &args.init {
        Some(p) => Some(open_init(p, &spec)?),
        None => None,
    };
    let rank_body = |comm: Box<dyn Communicator>| {
        let quiet = comm.rank() != 0 && !args.log_all_ranks;
        let _guard = quiet.then(|| {
            tracing::subscriber::set_default(tracing::subscriber::NoSubscriber::default())
        });
        let _span = tracing::info_span!("rank", r = comm.rank()).entered();
        let model = tuning.build(&spec)?;
        let mut engine = EngineBuilder::new(model)
            .config(config.clone())
            .comm(comm)
            .hidden_size(spec.hidden())
            .sequence_length(data.train.seq_len())
            .build()?;
        match &init {
            Some((init, files)) => {
                tuning.load(&mut engine, init)?;
                let dir = args.init.as_deref().unwrap_or(std::path::Path::new("."));
                engine.set_model_files(tuning.model_files(files, dir));
            }
            None => tuning.start(&mut engine)?,
        }
        let first = match &args.resume {
            Some(dir) => {
                let l = engine.load_checkpoint(dir, &Tag::Latest)?;
                tracing::info!(
                    "resumed {} from {} (saved with {} ranks) at step {}",
                    l.tag,
                    dir.display(),
                    l.saved_world_size,
                    l.step
                );
                l.data_position
            }
            None => 0,
        };
        let opts = TrainOptions {
            steps: args.steps,
            progress: !args.no_progress,
            metrics: args.metrics.clone(),
            memory_timeline: args.memory_timeline.clone(),
            save: args.save.clone(),
            save_every: args.save_every,
            eval_every: args.eval_every,
            eval_rows: args.eval_rows,
            bench_json: args.bench_json,
        };
        let eval = data.eval.as_deref();
        train::train(&mut engine, &opts, &*data.train, eval, first)?;
        if let Some(h) = &data.heldout {
            evaluate(&mut engine, h, args.eval_rows)?;
        }
        Ok(())
    };
    train::run_job(&config, args.ranks, rank_body)?;
    Ok(())
}

/// `--init`: a model directory, an index or a single safetensors file, under the
/// architecture's own names (GPT-2's missing `transformer.` prefix added), and the directory's
/// `config.json` and tokenizer files for the checkpoints to carry.
fn open_init(
    path: &std::path::Path,
    spec: &HfModel,
) -> Result<(ModelWeights, ModelFiles), BoxError> {
    let model = ModelWeights::open(path, spec.naming())?;
    let files = match path.is_dir() {
        true => ModelFiles::from_dir(path)?,
        false => ModelFiles::default(),
    };
    Ok((model, files))
}

/// Held-out loss and exact-match accuracy (every answer digit right, teacher-forced, which
/// equals greedy decoding's exact match).
fn evaluate(engine: &mut Engine, task: &Addition, rows: usize) -> ferrozero::runtime::Result<()> {
    let (world, rank) = (engine.world_size(), engine.rank());
    let per_rank = rows.div_ceil(world);
    let mb = 64;
    let (mut loss, mut tokens, mut exact, mut seen) = (0.0, 0.0, 0.0, 0.0);
    let answer = task.answer_positions();
    let mut first = (rank * per_rank) as u64;
    let end = first + per_rank as u64;
    while first < end {
        let n = mb.min((end - first) as usize);
        let b = task.batch(first, n);
        let e = engine.evaluate(&b)?;
        loss += e.loss_sum;
        tokens += e.tokens as f64;
        if let Some(p) = &e.predictions {
            for r in 0..n {
                let row = r * b.seq;
                exact += answer.clone().all(|i| {
                    b.targets[row + i] == IGNORE_INDEX || p[row + i] as i32 == b.targets[row + i]
                }) as u8 as f64;
            }
        }
        seen += n as f64;
        first += n as u64;
    }
    let (loss, tokens, exact, seen) = (
        engine.sum_across_ranks(loss)?,
        engine.sum_across_ranks(tokens)?,
        engine.sum_across_ranks(exact)?,
        engine.sum_across_ranks(seen)?,
    );
    if rank == 0 {
        let acc = exact / seen.max(1.0);
        tracing::info!("held-out: loss {:.4} over {} answer tokens, exact-match accuracy {:.1}% ({} of {} problems)", loss / tokens.max(1.0), tokens, 100.0 * acc, exact, seen);
        println!(
            "heldout_loss={:.4} heldout_accuracy={:.4}",
            loss / tokens.max(1.0),
            acc
        );
    }
    Ok(())
}
