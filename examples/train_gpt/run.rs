//! The training loop each rank runs, rank 0's progress bar and metrics, and the evaluation.

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferrozero::engine::{Engine, EngineBuilder, StepReport};
use ferrozero::runtime::comm::local::run_ranks;
use ferrozero::runtime::comm::Communicator;
use ferrozero::runtime::engine::checkpoint::Tag;
use ferrozero::runtime::engine::timeline::{Pool, Timeline};
use ferrozero::runtime::nn::weights;
use ferrozero::runtime::nn::IGNORE_INDEX;
use indicatif::{ProgressBar, ProgressStyle};

use crate::data::{Addition, Rows, Shuffled, TokenFile};
use crate::Args;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The data the run trains on, and the held-out rows for the addition task.
struct Data {
    train: Arc<dyn Rows>,
    heldout: Option<Addition>,
}

fn data(args: &Args) -> Result<Data, String> {
    let Some(path) = &args.data else {
        let train = Addition {
            digits: args.digits,
            seed: args.seed,
        };
        return Ok(Data {
            train: Arc::new(train),
            heldout: Some(Addition {
                digits: args.digits,
                seed: args.seed ^ 0x5eed_0fc0_ffee,
            }),
        });
    };
    let f = TokenFile::open(path, args.seq_len)?;
    let train: Arc<dyn Rows> = if args.shuffle {
        Arc::new(Shuffled {
            n: f.rows(),
            inner: f,
            seed: args.seed,
        })
    } else {
        Arc::new(f)
    };
    Ok(Data {
        train,
        heldout: None,
    })
}

/// Runs the whole job: one thread per rank, rank 0 reports.
pub fn run(args: &Args) -> Result<(), BoxError> {
    let spec = crate::model::parse(&args.model_config)?;
    let data = data(args)?;
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
    let loaded = ferrozero::config::load(&args.config).map_err(|e| e.to_string())?;
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
    let init = match &args.init {
        Some(p) => Some(weights::load(p, spec.naming())?),
        None => None,
    };
    let rank_body = |comm: Box<dyn Communicator>| {
        let quiet = comm.rank() != 0 && !args.log_all_ranks;
        let _guard = quiet.then(|| {
            tracing::subscriber::set_default(tracing::subscriber::NoSubscriber::default())
        });
        let _span = tracing::info_span!("rank", r = comm.rank()).entered();
        let model = spec.build()?;
        let mut engine = EngineBuilder::new(model)
            .config(config.clone())
            .comm(comm)
            .hidden_size(spec.hidden())
            .sequence_length(data.train.seq_len())
            .build()?;
        if let Some(init) = &init {
            load_init(&mut engine, init)?;
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
        train(&mut engine, args, &*data.train, first).map_err(to_runtime)?;
        if let Some(h) = &data.heldout {
            evaluate(&mut engine, h, args.eval_rows)?;
        }
        Ok(())
    };
    if config.comms.backend == ferrozero::config::Backend::Nccl {
        return nccl_rank(args, &config, rank_body);
    }
    run_ranks(args.ranks, Duration::from_secs(600), rank_body)?;
    Ok(())
}

/// `comms.backend = "nccl"`: this process is one rank of a job `ferrozero launch` started.
#[cfg(feature = "cuda")]
fn nccl_rank(
    args: &Args,
    config: &ferrozero::config::Config,
    body: impl Fn(Box<dyn Communicator>) -> ferrozero::runtime::Result<()>,
) -> Result<(), BoxError> {
    use ferrozero::runtime::comm::nccl::{NcclComm, NcclOptions};
    if args.ranks != 1 {
        return Err(format!(
            "--ranks {} with comms.backend = \"nccl\": each process is one rank; start \
             {} processes with `ferrozero launch --nproc-per-node {}`",
            args.ranks, args.ranks, args.ranks
        )
        .into());
    }
    let opts = NcclOptions {
        timeout: Duration::from_secs(config.comms.timeout),
        deterministic: config.comms.reduction == ferrozero::config::Reduction::RankOrdered,
    };
    let comm = NcclComm::from_env(opts)?;
    body(Box::new(comm))?;
    Ok(())
}

/// Without the CUDA build there is no NCCL: the local ranks run and the engine refuses the
/// mismatch with what would work.
#[cfg(not(feature = "cuda"))]
fn nccl_rank(
    args: &Args,
    _config: &ferrozero::config::Config,
    body: impl Fn(Box<dyn Communicator>) -> ferrozero::runtime::Result<()> + Sync,
) -> Result<(), BoxError> {
    run_ranks(args.ranks, Duration::from_secs(600), body)?;
    Ok(())
}

fn to_runtime(e: BoxError) -> ferrozero::runtime::Error {
    ferrozero::runtime::Error::Invalid(e.to_string())
}

/// Sets the parameters that the file provides (names checked against the model).
fn load_init(
    engine: &mut Engine,
    file: &[ferrozero::engine::NamedTensor],
) -> ferrozero::runtime::Result<()> {
    let names: std::collections::HashSet<String> = engine
        .model()
        .units
        .iter()
        .flat_map(|u| u.module.param_specs())
        .chain(engine.model().shared.clone())
        .map(|p| p.name)
        .collect();
    let picked: Vec<_> = file
        .iter()
        .filter(|t| names.contains(&t.name))
        .cloned()
        .collect();
    if picked.len() != names.len() {
        let have: std::collections::HashSet<&str> =
            picked.iter().map(|t| t.name.as_str()).collect();
        let mut missing: Vec<&str> = names
            .iter()
            .map(String::as_str)
            .filter(|n| !have.contains(n))
            .collect();
        missing.sort();
        return Err(ferrozero::runtime::Error::Invalid(format!(
            "--init file lacks {} parameters, e.g. {:?}",
            missing.len(),
            &missing[..missing.len().min(5)]
        )));
    }
    engine.set_parameters(&picked)
}

/// Row numbers: steps, then accumulation micro-steps, then ranks, then the micro-batch.
fn micro_batches(
    engine: &Engine,
    rows: &dyn Rows,
    step: u64,
) -> Vec<ferrozero::runtime::nn::Batch> {
    let cfg = engine.config();
    let (gas, world, mb) = (
        cfg.gradient_accumulation_steps as u64,
        engine.world_size() as u64,
        cfg.train_micro_batch_size_per_gpu,
    );
    (0..gas)
        .map(|m| {
            rows.batch(
                ((step * gas + m) * world + engine.rank() as u64) * mb as u64,
                mb,
            )
        })
        .collect()
}

/// Trains from data position (step) `first` up to `args.steps`, checkpointing into `--save`
/// every `--save-every` steps and at the end.
fn train(engine: &mut Engine, args: &Args, rows: &dyn Rows, first: u64) -> Result<(), BoxError> {
    let lead = engine.rank() == 0;
    let bar = (lead && !args.no_progress).then(|| progress(args.steps));
    let mut metrics = match (&args.metrics, lead) {
        (Some(p), true) => Some(std::io::BufWriter::new(std::fs::File::create(p)?)),
        _ => None,
    };
    let every = engine.config().steps_per_print.max(1) as u64;
    let start = Instant::now();
    let mut tokens_total = 0u64;
    let (mut warm_tokens, mut warm_secs) = (0.0, 0.0);
    let mut timeline = Timeline::new();
    for step in first..args.steps {
        let batches = micro_batches(engine, rows, step);
        let t = Instant::now();
        let r = engine.train_batch(&batches)?;
        let dt = t.elapsed().as_secs_f64();
        let input_tokens =
            engine.sum_across_ranks(batches.iter().map(|b| (b.batch * b.seq) as f64).sum())?;
        tokens_total += input_tokens as u64;
        if step >= 2 {
            warm_tokens += input_tokens;
            warm_secs += dt;
        }
        let tps = input_tokens / dt.max(1e-9);
        // On a GPU its allocator's peak is the truth; on the CPU the ledger's.
        let measured = r.device_memory.map(|m| m.peak);
        let peak_dev =
            engine.max_across_ranks(measured.unwrap_or(r.memory.peak_device_bytes) as f64)?;
        let peak_host = engine.max_across_ranks(r.memory.peak_host_bytes as f64)?;
        timeline.record(r.step, &r.memory);
        if let Some(m) = metrics.as_mut() {
            writeln!(m, "{}", metrics_line(&r, tps, peak_dev, peak_host))?;
        }
        let mut line = format!(
            "loss {:.4} lr {:.2e} scale {} | {:.0} tok/s | peak {:.1} MiB/rank",
            r.loss,
            r.lr,
            r.loss_scale,
            tps,
            peak_dev / 1048576.0
        );
        if r.swap != Default::default() {
            let gb = |b: u64| b as f64 / 1e9;
            line += &format!(
                " | {dt:.1} s/step, NVMe read {:.2} GB, written {:.2} GB (rank {})",
                gb(r.swap.read_bytes),
                gb(r.swap.written_bytes),
                engine.rank()
            );
        }
        let print_now = lead && (step + 1) % every == 0;
        match &bar {
            Some(b) => {
                b.set_message(line);
                b.inc(1);
            }
            None if print_now => tracing::info!("step {} {line}", r.step),
            None => {}
        }
        if print_now && engine.config().wall_clock_breakdown {
            let t = &r.timings;
            let ms = |s: f64| s * 1e3;
            tracing::info!(
                "step {} time (ms): forward {:.1} | backward {:.1} | reduce {:.1} | gather {:.1} | optimizer {:.1}",
                r.step,
                ms(t.forward),
                ms(t.backward),
                ms(t.reduce),
                ms(t.gather),
                ms(t.optimizer)
            );
        }
        let done = step + 1;
        if let Some(dir) = &args.save {
            if done == args.steps || args.save_every.is_some_and(|n| n > 0 && done % n == 0) {
                let path = engine.save_checkpoint(dir, &format!("step-{done}"), done)?;
                if lead {
                    tracing::info!("checkpoint {}", path.display());
                }
            }
        }
    }
    if let Some(b) = bar {
        b.finish();
    }
    if let (Some(path), true) = (&args.memory_timeline, lead) {
        std::fs::write(path, timeline.to_svg(Pool::Device))?;
        tracing::info!("memory timeline: {}", path.display());
    }
    let peak_dev = engine.max_across_ranks(
        engine
            .ledger()
            .peak_total(ferrozero::runtime::engine::ledger::Location::Device) as f64,
    )?;
    if lead && args.bench_json {
        let cfg = engine.config();
        println!(
            "{}",
            serde_json::json!({
                "bench": "ferrozero_gpt_train", "stage": cfg.zero.stage.number(), "ranks": engine.world_size(),
                "offload_optimizer": format!("{:?}", cfg.zero.offload_optimizer.target),
                "params": engine.model().num_params(), "steps": args.steps,
                "tokens_per_s": warm_tokens / warm_secs.max(1e-9),
                "peak_device_bytes_per_rank": peak_dev as u64, "process_vmhwm_mib": vmhwm_mib(),
            })
        );
    }
    if lead {
        let secs = start.elapsed().as_secs_f64();
        tracing::info!(
            "trained {} steps in {secs:.1}s: {:.0} tokens/s over all ranks",
            args.steps,
            tokens_total as f64 / secs
        );
    }
    Ok(())
}

fn progress(steps: u64) -> ProgressBar {
    let b = ProgressBar::new(steps);
    b.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} [{elapsed}<{eta}] {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    b
}

fn metrics_line(r: &StepReport, tps: f64, peak_dev: f64, peak_host: f64) -> String {
    let by_cat: serde_json::Map<String, serde_json::Value> = r
        .memory
        .peak_device_by_category
        .iter()
        .map(|(c, b)| (format!("{c:?}").to_lowercase(), serde_json::json!(b)))
        .collect();
    serde_json::json!({
        "step": r.step, "loss": r.loss, "lr": r.lr, "loss_scale": r.loss_scale, "skipped": r.skipped,
        "grad_norm": if r.grad_norm.is_finite() { serde_json::json!(r.grad_norm) } else { serde_json::Value::Null },
        "tokens_per_s": tps, "peak_device_bytes": peak_dev as u64, "peak_host_bytes": peak_host as u64,
        "peak_device_bytes_by_category": by_cat,
        "ledger_peak_device_bytes": r.memory.peak_device_bytes,
        "device_memory_limit": r.memory.device_memory_limit,
        "device_allocator": r.device_memory,
        "swap_read_bytes": r.swap.read_bytes, "swap_written_bytes": r.swap.written_bytes,
        "cross_group_bytes": r.cross_group_bytes,
    })
    .to_string()
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

/// The process's peak resident set (VmHWM) in MiB; NaN where /proc is unavailable.
fn vmhwm_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map_or(f64::NAN, |kb| kb / 1024.0)
}
