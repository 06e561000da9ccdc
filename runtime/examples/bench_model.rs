//! Full training-step throughput of a GPT-2-style model on the CPU backend's layers, without the
//! engine: forward, backward, an AdamW update of every parameter (the CPU backend's fused
//! optimizer, as the engine runs it) and gradient zeroing, printed as one JSON line. For claims
//! against PyTorch use `train_gpt` through `../shared/bench/gpt_ab.sh`, which times the whole
//! engine the way users compare; this isolates the layers and the optimizer from the engine's
//! bookkeeping.
//!
//! `cargo run --release -p ferrozero-runtime --example bench_model -- [--preset bench-15m]
//!  [--batch 8] [--seq 128] [--steps 10] [--warmup 2] [--threads 2]`

use std::time::Instant;

use ferrozero_offload::optim::{AdamHyper, WeightDecay};
use ferrozero_runtime::backend::{Backend, UpdateRule};
use ferrozero_runtime::nn::gpt2::{self, Gpt2Config};
use ferrozero_runtime::nn::{init, Batch, BatchIds, Ctx, Grads, Model, Params, Saved, Unit};
use ferrozero_runtime::tensor::{Tensor, View, ViewMut};

struct Args {
    preset: String,
    batch: usize,
    seq: usize,
    steps: usize,
    warmup: usize,
    threads: usize,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        preset: "bench-15m".into(),
        batch: 8,
        seq: 128,
        steps: 10,
        warmup: 2,
        threads: 2,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let val = it.next().ok_or(format!("{flag} needs a value"))?;
        let num = || {
            val.parse::<usize>()
                .map_err(|e| format!("{flag} {val}: {e}"))
        };
        match flag.as_str() {
            "--preset" => a.preset = val.clone(),
            "--batch" => a.batch = num()?,
            "--seq" => a.seq = num()?,
            "--steps" => a.steps = num()?.max(1),
            "--warmup" => a.warmup = num()?,
            "--threads" => a.threads = num()?.max(1),
            other => return Err(format!("unknown flag {other}")),
        }
    }
    Ok(a)
}

/// Engine-like parameter and gradient buffers: per unit, per parameter, plus shared.
struct Buffers {
    units: Vec<Vec<Vec<f32>>>,
    shared: Vec<Vec<f32>>,
}

fn buffers(model: &Model, fill: bool) -> Buffers {
    let make = |spec: &ferrozero_runtime::nn::ParamSpec| {
        let mut v = vec![0.0; spec.numel()];
        if fill {
            init::fill(&spec.init, init::param_seed(0, &spec.name), &mut v);
        }
        v
    };
    Buffers {
        units: model
            .units
            .iter()
            .map(|u| u.module.param_specs().iter().map(make).collect())
            .collect(),
        shared: model.shared.iter().map(make).collect(),
    }
}

/// AdamW as `gpt_ab.sh` configures it on both sides.
const ADAMW: AdamHyper = AdamHyper {
    lr: 3e-4,
    beta1: 0.9,
    beta2: 0.95,
    eps: 1e-8,
    weight_decay: 0.1,
    decay: WeightDecay::Decoupled,
    bias_correction: true,
};

/// Every buffer, units first, in the same order for weights, gradients and moments.
fn all_mut(b: &mut Buffers) -> impl Iterator<Item = &mut Vec<f32>> {
    b.units.iter_mut().flatten().chain(b.shared.iter_mut())
}

/// One training step: forward and backward, then AdamW on every parameter and the gradients
/// zeroed for the next step, as the engine does.
fn train_step(
    be: &dyn Backend,
    model: &Model,
    s: &mut State,
    batch: &Batch,
    t: u64,
) -> ferrozero_runtime::Result<f32> {
    let loss = step(be, model, &s.w, &mut s.g, batch)?;
    let rule = UpdateRule::Adam(ADAMW);
    let moments = all_mut(&mut s.m).zip(all_mut(&mut s.v));
    for ((w, g), (m, v)) in all_mut(&mut s.w).zip(all_mut(&mut s.g)).zip(moments) {
        be.optimizer_update(
            &rule,
            t,
            1.0,
            ViewMut::from(&mut w[..]),
            View::from(&g[..]).into(),
            ViewMut::from(&mut m[..]),
            ViewMut::from(&mut v[..]),
            None,
        )?;
        g.fill(0.0);
    }
    Ok(loss)
}

impl Buffers {
    /// Unit `u`'s parameters: its own, then the shared tables it uses.
    fn params(&self, unit: &Unit, u: usize) -> Params<'_> {
        let own = self.units[u].iter().map(|v| View::from(&v[..]));
        let shared = unit
            .uses_shared
            .iter()
            .map(|&s| View::from(&self.shared[s][..]));
        Params::new(own.chain(shared).collect())
    }
}

/// Weights, gradients and the two moments.
struct State {
    w: Buffers,
    g: Buffers,
    m: Buffers,
    v: Buffers,
}

/// Bytes the units saved for backward in the last forward, as measured by their saved state.
static SAVED_BYTES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

fn step(
    be: &dyn Backend,
    model: &Model,
    w: &Buffers,
    g: &mut Buffers,
    batch: &Batch,
) -> ferrozero_runtime::Result<f32> {
    let ids = BatchIds::new(be, batch)?;
    let mut slots: Vec<Saved> = model.units.iter().map(|_| None).collect();
    let mut x = Tensor::default();
    for (u, unit) in model.units.iter().enumerate() {
        let mut ctx = Ctx::new(be, (batch, &ids), true, (u as u64, 0), &mut slots[u]);
        x = unit.module.forward(&mut ctx, &w.params(unit, u), &x)?;
    }
    let saved = slots.iter().flatten().map(|s| s.bytes()).sum();
    SAVED_BYTES.store(saved, std::sync::atomic::Ordering::Relaxed);
    let loss = x.to_vec_f32()?[0] / batch.valid_targets() as f32;
    let mut gy = Tensor::scalar(1.0 / batch.valid_targets() as f32);
    for (u, unit) in model.units.iter().enumerate().rev() {
        let mut own: Vec<ViewMut<'_>> = g.units[u]
            .iter_mut()
            .map(|v| ViewMut::from(&mut v[..]))
            .collect();
        // Only the first and last units use the (single) shared table, never both at once.
        let mut shared = g.shared.iter_mut();
        for _ in &unit.uses_shared {
            own.extend(shared.next().map(|v| ViewMut::from(&mut v[..])));
        }
        let mut ctx = Ctx::new(be, (batch, &ids), true, (u as u64, 0), &mut slots[u]);
        gy = unit
            .module
            .backward(&mut ctx, &w.params(unit, u), &mut Grads::new(own), &gy)?;
    }
    Ok(loss)
}

/// CPU seconds (user + system) used by this process so far, from `/proc/self/stat`; on a
/// shared, oversubscribed machine this tracks work better than wall time. `None` off Linux.
fn process_cpu_s() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the parenthesised command name; utime and stime are the 12th and 13th.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    Some(ticks / 100.0)
}

fn main() {
    let args = parse().unwrap_or_else(|e| {
        eprintln!("bench_model: {e}");
        std::process::exit(2);
    });
    let cfg = Gpt2Config::preset(&args.preset).unwrap_or_else(|e| {
        eprintln!("bench_model: {e}");
        std::process::exit(2);
    });
    let model = gpt2::build(&cfg).expect("preset is valid");
    let mut state = State {
        w: buffers(&model, true),
        g: buffers(&model, false),
        m: buffers(&model, false),
        v: buffers(&model, false),
    };
    let n = args.batch * args.seq;
    let tokens: Vec<u32> = (0..n)
        .map(|i| ((i * 7919 + 13) % cfg.vocab_size) as u32)
        .collect();
    let targets = (0..n)
        .map(|i| ((i * 104_729 + 5) % cfg.vocab_size) as i32)
        .collect();
    let batch = Batch {
        batch: args.batch,
        seq: args.seq,
        tokens,
        targets,
    };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(args.threads)
        .build()
        .expect("thread pool");
    let be = ferrozero_runtime::backend::cpu();
    let mut times = Vec::new();
    let mut loss = 0.0;
    let mut cpu0 = None;
    pool.install(|| {
        for i in 0..args.warmup + args.steps {
            if i == args.warmup {
                cpu0 = process_cpu_s();
            }
            let t0 = Instant::now();
            loss = train_step(&*be, &model, &mut state, &batch, i as u64 + 1).expect("step runs");
            if i >= args.warmup {
                times.push(t0.elapsed().as_secs_f64());
            }
        }
    });
    let cpu = match (cpu0, process_cpu_s()) {
        (Some(a), Some(b)) => format!("{:.3}", (b - a) / args.steps as f64),
        _ => "null".into(),
    };
    let total: f64 = times.iter().sum();
    times.sort_by(f64::total_cmp);
    let saved = SAVED_BYTES.load(std::sync::atomic::Ordering::Relaxed);
    println!(
        "{{\"bench\": \"ferrozero_train_step\", \"what\": \"forward, backward, AdamW, zero grads (layers and optimizer, no engine)\", \"preset\": \"{}\", \"params\": {}, \"threads\": {}, \"micro_batch\": {}, \"seq\": {}, \"steps\": {}, \"tokens_per_s\": {:.1}, \"step_s_median\": {:.4}, \"loss\": {:.4}, \"saved_activation_bytes\": {}, \"cpu_s_per_step\": {}}}",
        args.preset, model.num_params(), args.threads, args.batch, args.seq, args.steps,
        (n * times.len()) as f64 / total, times[times.len() / 2], loss, saved, cpu
    );
}
