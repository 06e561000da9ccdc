//! `ferrozero estimate`: per-rank peak memory for a model, a config and a world size, with a
//! verdict against the device size and this host's RAM, and the cheapest change that fits
//! when it does not. The figures come from the same estimator the engine's pre-flight uses.
//!
//! Exit codes: 0 fits, 1 does not fit, 2 bad input.

use std::path::PathBuf;
use std::process::ExitCode;

use ferrozero_config::resolved::{
    CommDataType, OffloadTarget, Precision, ResolvedConfig, ZeroStage,
};
use ferrozero_config::{parse, Device, Format, ResolveContext};
use ferrozero_runtime::engine::estimate::shape::{self, ModelShape};
use ferrozero_runtime::engine::estimate::{memory_model, suggest, Budget, Estimate, Placement};
use ferrozero_runtime::engine::host_limits::HostRamNeed;
use ferrozero_runtime::engine::ledger::Category;
use ferrozero_runtime::engine::optimizer_overlap::{overlap_on_host, OptimizerOverlap};
use serde_json::{json, Value};

/// Arguments.
#[derive(clap::Args)]
pub struct Args {
    /// Model preset: gpt2-124m, bench-15m, tiny-gpt2, llama-7b, llama-13b, tiny-llama.
    #[arg(long, conflicts_with_all = ["model_config", "params"])]
    model: Option<String>,
    /// A Hugging Face config.json (GPT-2 or Llama-shaped).
    #[arg(long, conflicts_with = "params")]
    model_config: Option<PathBuf>,
    /// Parameter count of a Llama-shaped model, e.g. 7e9 (with --layers and --hidden).
    #[arg(long, requires_all = ["layers", "hidden"])]
    params: Option<f64>,
    /// Layers (with --params).
    #[arg(long)]
    layers: Option<usize>,
    /// Width (with --params).
    #[arg(long)]
    hidden: Option<usize>,
    /// Vocabulary size (with --params).
    #[arg(long, default_value_t = 32000)]
    vocab: usize,
    /// A ferrozero TOML or DeepSpeed JSON config (default: bf16, AdamW, stage 0).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Override the config's ZeRO stage.
    #[arg(long, value_parser = clap::value_parser!(u8).range(0..=3))]
    stage: Option<u8>,
    /// Nodes.
    #[arg(long, default_value_t = 1)]
    nodes: usize,
    /// GPUs (ranks) per node.
    #[arg(long, default_value_t = 1)]
    gpus_per_node: usize,
    /// Rows per micro-batch (default: the config's train_micro_batch_size_per_gpu).
    #[arg(long)]
    micro_batch: Option<usize>,
    /// Tokens per row (default: the model's longest sequence).
    #[arg(long)]
    seq_len: Option<usize>,
    /// Device memory per GPU: 40GB (10^9), 40GiB (2^30), or bytes (default: the config's
    /// `device_memory_limit`, else 40GB).
    #[arg(long)]
    device_memory: Option<String>,
    /// Host memory per node (default: this machine's RAM), same units.
    #[arg(long)]
    host_memory: Option<String>,
    /// The device to price: cpu, cuda or cuda:N (default: the config's `device`, with `auto`
    /// priced as a GPU, which this command sizes). No GPU is opened: its figures come from
    /// the backend's description.
    #[arg(long)]
    device: Option<String>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// Price a LoRA run: a PEFT adapter_config.json (or an adapter directory holding one); the
    /// base is frozen.
    #[arg(long)]
    peft: Option<PathBuf>,
    /// Price a run with these parameters frozen (glob rules on Hugging Face names, in order;
    /// a leading `!` thaws).
    #[arg(long, num_args = 1.., conflicts_with = "peft")]
    freeze: Vec<String>,
}

/// Runs the subcommand.
pub fn run(args: Args) -> ExitCode {
    match plan(&args) {
        Ok(p) => report(&args, &p),
        Err(msg) => {
            eprintln!("error: {msg}");
            ExitCode::from(2)
        }
    }
}

/// Everything the report needs, decided from the arguments.
struct Plan {
    shape: ModelShape,
    cfg: ResolvedConfig,
    micro: usize,
    seq: usize,
    budget: Budget,
    host_ram: u64,
    /// The optimizer overlap the run gets on this host (bounded or off when the speculative
    /// overlap's snapshots do not fit), which `est` prices.
    overlap: OptimizerOverlap,
    est: Estimate,
    /// Why the device priced is that one.
    device_why: String,
}

fn plan(args: &Args) -> Result<Plan, String> {
    let shape = model(args)?;
    if args.nodes == 0 || args.gpus_per_node == 0 {
        return Err("--nodes and --gpus-per-node must be at least 1".into());
    }
    let world = args.nodes * args.gpus_per_node;
    let (cfg, device_why) = config(args, world, shape.hidden)?;
    let micro = args
        .micro_batch
        .unwrap_or(cfg.train_micro_batch_size_per_gpu);
    let seq = args.seq_len.unwrap_or(shape.max_seq);
    if micro == 0 || seq == 0 {
        return Err("--micro-batch and --seq-len must be at least 1".into());
    }
    if seq > shape.max_seq {
        return Err(format!(
            "--seq-len {seq} exceeds the model's longest sequence {}",
            shape.max_seq
        ));
    }
    let device = match &args.device_memory {
        Some(s) => parse_size(s)?,
        None => cfg.device_memory_limit.unwrap_or(DEFAULT_DEVICE_BYTES),
    };
    let host_ram = match &args.host_memory {
        Some(s) => parse_size(s)?,
        None => super::report::ram_bytes()
            .ok_or("cannot read this host's RAM from /proc/meminfo; pass --host-memory")?,
    };
    let budget = Budget {
        device_bytes: device,
        host_bytes: host_ram / args.gpus_per_node as u64,
    };
    let in_ram = ferrozero_runtime::backend::memory_is_host_ram(cfg.device);
    let ranks = (args.gpus_per_node as u64, in_ram);
    let (overlap, est) = overlap_on_host(&shape.model, &cfg, (micro, seq), ranks, host_ram)
        .map_err(|e| e.to_string())?;
    Ok(Plan {
        shape,
        cfg,
        micro,
        seq,
        budget,
        host_ram,
        overlap,
        est,
        device_why,
    })
}

fn model(args: &Args) -> Result<ModelShape, String> {
    let r = match (&args.model, &args.model_config, args.params) {
        (Some(name), _, _) => shape::preset(name),
        (_, Some(path), _) => shape::hf_config(path),
        (_, _, Some(p)) => shape::from_size(
            p,
            args.layers.unwrap_or(0),
            args.hidden.unwrap_or(0),
            args.vocab,
            args.seq_len.unwrap_or(4096),
        ),
        _ => return Err("name a model: --model, --model-config or --params".into()),
    };
    let shape = r.map_err(|e| e.to_string())?;
    let tuned = match (&args.peft, args.freeze.is_empty()) {
        (Some(path), _) => {
            let file = match path.is_dir() {
                true => path.join(ferrozero_runtime::nn::peft::ADAPTER_CONFIG_FILE),
                false => path.clone(),
            };
            let lora = ferrozero_runtime::nn::peft::LoraConfig::from_file(&file);
            lora.and_then(|l| shape.with_peft(&l))
        }
        (None, false) => ferrozero_runtime::nn::freeze::Freeze::new(&args.freeze)
            .and_then(|f| shape.with_frozen(f)),
        (None, true) => Ok(shape),
    };
    tuned.map_err(|e| e.to_string())
}

/// A 40 GB card (A100 40GB), the budget this tool was written for.
const DEFAULT_DEVICE_BYTES: u64 = 40_000_000_000;

const DEFAULT_CONFIG: &str = r#"{
  "train_micro_batch_size_per_gpu": 1,
  "bf16": {"enabled": true},
  "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
  "zero_optimization": {"stage": 0}
}"#;

/// The resolved config (world size, device and stage as the arguments say) and why its device
/// is the one priced, for the report's first lines.
fn config(args: &Args, world: usize, hidden: usize) -> Result<(ResolvedConfig, String), String> {
    let loaded = match &args.config {
        Some(p) => ferrozero_config::load(p),
        None => parse(DEFAULT_CONFIG, Format::Json, "built-in default"),
    }
    .map_err(|e| e.to_string())?;
    let ctx = ResolveContext {
        world_size: world,
        hidden_size: Some(hidden),
        micro_batch_hint: args.micro_batch,
    };
    let mut cfg = loaded.config.resolve(&ctx).map_err(|e| e.to_string())?;
    let why;
    (cfg.device, why) = match &args.device {
        Some(d) => (
            d.parse().map_err(|e| format!("--device {d}: {e}"))?,
            "--device".to_string(),
        ),
        None if cfg.device == Device::Auto => (
            Device::Cuda(None),
            "the config's device = \"auto\", priced as a GPU (this command sizes one, whatever \
             this machine has; --device cpu prices the CPU)"
                .to_string(),
        ),
        None => (
            cfg.device,
            format!("the config's device = \"{}\"", cfg.device),
        ),
    };
    if let Some(s) = args.stage {
        cfg.zero.stage = match s {
            0 => ZeroStage::Stage0,
            1 => ZeroStage::Stage1,
            2 => ZeroStage::Stage2,
            _ => ZeroStage::Stage3,
        };
    }
    Ok((cfg, why))
}

/// Sizes are parsed as the config's `device_memory_limit` is, so a flag and a key agree.
pub use ferrozero_config::parse_size;

/// Bytes as GiB with two decimals (MiB below 1 GiB).
pub fn human(b: u64) -> String {
    let g = b as f64 / 1024f64.powi(3);
    if g >= 1.0 {
        format!("{g:.2} GiB")
    } else {
        format!("{:.1} MiB", b as f64 / 1024f64.powi(2))
    }
}

fn placement_json(p: &Placement) -> Value {
    let m: serde_json::Map<String, Value> = p
        .by_category
        .iter()
        .map(|&(c, b)| (c.name().to_string(), json!(b)))
        .collect();
    Value::Object(m)
}

fn offload_name(t: &OffloadTarget) -> String {
    match t {
        OffloadTarget::None => "none".into(),
        OffloadTarget::Cpu => "cpu".into(),
        OffloadTarget::Nvme(p) => format!("nvme ({})", p.display()),
    }
}

fn precision_name(p: &Precision) -> &'static str {
    match p {
        Precision::F32 => "f32",
        Precision::Bf16 => "bf16",
        Precision::Fp16(_) => "fp16",
    }
}

fn report(args: &Args, p: &Plan) -> ExitCode {
    let fits = p.budget.fits(&p.est);
    let sug = (!fits).then(|| suggest(&p.shape.model, &p.cfg, p.micro, p.seq, p.budget));
    if args.json {
        println!("{}", json_report(p, fits, &sug));
    } else {
        print_table(args, p, fits, &sug);
    }
    if fits {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

fn json_report(p: &Plan, fits: bool, sug: &Option<Option<suggest::Suggestion>>) -> Value {
    let e = &p.est;
    let suggestion = match sug {
        Some(Some(s)) => json!({
            "changes": s.changes.iter().map(|c| c.to_string()).collect::<Vec<_>>(),
            "device_bytes": s.estimate.device.peak_bytes,
            "host_bytes": s.estimate.host_total_bytes(),
        }),
        Some(None) => json!("nothing in the candidate list fits"),
        None => Value::Null,
    };
    json!({
        "model": p.shape.description,
        "num_params": e.num_params,
        "world_size": e.world_size,
        "stage": e.stage,
        "precision": precision_name(&p.cfg.precision),
        "device": p.cfg.device.to_string(),
        "device_reason": p.device_why,
        "device_figures": memory_model(&p.cfg).to_string(),
        "micro_batch": e.micro_batch,
        "seq_len": e.seq_len,
        "per_rank": {
            "device_bytes": e.device.peak_bytes,
            "host_bytes": e.host.peak_bytes,
            "nvme_bytes": e.nvme.peak_bytes,
            "pinned_host_bytes": e.pinned_host_bytes,
            "mlocked_host_bytes": e.mlocked_host_bytes,
            "other_host_bytes": e.other_host_bytes,
            "swap_buffer_bytes": e.swap_buffer_bytes,
            "page_locked_bytes": e.page_locked,
            "reduced_bytes_per_step": e.reduced_bytes_per_step,
            "categories": {
                "device": placement_json(&e.device),
                "host": placement_json(&e.host),
                "nvme": placement_json(&e.nvme),
            },
            "activations": {
                "without_checkpointing": e.activations.without_checkpointing,
                "with_checkpointing": e.activations.with_checkpointing,
            },
        },
        "budget": {
            "device_bytes": p.budget.device_bytes,
            "host_bytes_per_rank": p.budget.host_bytes,
            "host_ram_bytes": p.host_ram,
        },
        "optimizer_overlap": p.overlap.name(),
        "optimizer_overlap_reason": p.overlap.reason(),
        "snapshot_bytes_per_rank": e.snapshot_host_bytes,
        "snapshot_share": snapshot_share(e),
        "fits": fits,
        "suggestion": suggestion,
    })
}

/// The share of the optimizer state a speculative overlap snapshots (0 without one): about
/// the share of the host's step that can run behind backward when the speculation holds.
fn snapshot_share(e: &Estimate) -> f64 {
    let all: u64 = e.snapshot_group_bytes.iter().sum();
    e.snapshot_host_bytes as f64 / all.max(1) as f64
}

fn print_table(args: &Args, p: &Plan, fits: bool, sug: &Option<Option<suggest::Suggestion>>) {
    let (e, z) = (&p.est, &p.cfg.zero);
    println!("priced for: {} ({})", p.cfg.device, p.device_why);
    println!(
        "model: {} ({:.3} B params), micro-batch {} x {} tokens",
        p.shape.description,
        e.num_params as f64 / 1e9,
        e.micro_batch,
        e.seq_len
    );
    println!(
        "world: {} node(s) x {} GPU(s) = {} ranks; ZeRO stage {}, {}, optimizer offload {}, \
         param offload {}, activation checkpointing {}",
        args.nodes,
        args.gpus_per_node,
        e.world_size,
        e.stage,
        precision_name(&p.cfg.precision),
        offload_name(&z.offload_optimizer.target),
        offload_name(&z.offload_param.target),
        match &p.cfg.activation_checkpointing {
            None => "off",
            Some(a) if a.cpu_checkpointing => "on (CPU)",
            Some(_) => "on",
        }
    );
    println!("device: {} ({})", p.cfg.device, memory_model(&p.cfg));
    if p.cfg.zero.offload_optimizer.target != OffloadTarget::None {
        println!(
            "optimizer overlap: {}; snapshots {} per rank ({:.0}% of the optimizer state): {}",
            p.overlap.name(),
            human(e.snapshot_host_bytes),
            100.0 * snapshot_share(e),
            p.overlap.reason()
        );
    }
    println!(
        "\nper rank (peaks) {:>14} {:>14} {:>14}",
        "device", "host", "nvme"
    );
    for c in Category::ALL {
        println!(
            "  {:<15} {:>14} {:>14} {:>14}",
            c.name(),
            human(e.device.category(c)),
            human(e.host.category(c)),
            human(e.nvme.category(c))
        );
    }
    println!(
        "  {:<15} {:>14} {:>14} {:>14}",
        "peak total",
        human(e.device.peak_bytes),
        human(e.host.peak_bytes),
        human(e.nvme.peak_bytes)
    );
    println!(
        "\nhost: pinned {} (swap buffers {}), other {}; mlocked (counts against \
         RLIMIT_MEMLOCK) {}",
        human(e.pinned_host_bytes),
        human(e.swap_buffer_bytes),
        human(e.other_host_bytes),
        human(e.mlocked_host_bytes)
    );
    if e.page_locked.total() > 0 {
        let p = &e.page_locked;
        println!(
            "page-locked by the device: {} (parameter store {}, staging {} of which snapshots {}, \
             upload ring {}); host RAM, not RLIMIT_MEMLOCK (the driver's registrations are not \
             charged to it)",
            human(p.total()),
            human(p.parameters),
            human(p.staging),
            human(p.snapshots),
            human(p.ring)
        );
    }
    println!(
        "activations: {} without checkpointing, {} with",
        human(e.activations.without_checkpointing),
        human(e.activations.with_checkpointing)
    );
    println!(
        "gradient reductions: {} per rank per step (communication_data_type: {})",
        human(e.reduced_bytes_per_step),
        p.cfg
            .comms
            .data_type
            .map_or("the training precision", |d| match d {
                CommDataType::Fp32 => "fp32",
                CommDataType::Fp16 => "fp16",
                CommDataType::Bf16 => "bf16",
            })
    );
    print_verdict(args, p, fits, sug);
}

fn print_verdict(args: &Args, p: &Plan, fits: bool, sug: &Option<Option<suggest::Suggestion>>) {
    let e = &p.est;
    let dev_ok = e.device.peak_bytes <= p.budget.device_bytes;
    println!(
        "\ndevice: {} of {} per GPU: {}",
        human(e.device.peak_bytes),
        human(p.budget.device_bytes),
        if dev_ok { "fits" } else { "DOES NOT FIT" }
    );
    // Page-locked staging and ring besides the host state, each buffer counted once.
    let node_host = HostRamNeed::of(e, args.gpus_per_node as u64).total();
    println!(
        "host: {} per node ({} ranks) of {} RAM: {}",
        human(node_host),
        args.gpus_per_node,
        human(p.host_ram),
        if node_host <= p.host_ram {
            "fits"
        } else {
            "DOES NOT FIT"
        }
    );
    if let Some(limit) = super::report::memlock_limit() {
        // Only mlock is charged against the limit; the device's registrations are not.
        let locked = e.mlocked_host_bytes * args.gpus_per_node as u64;
        if locked > limit {
            println!(
                "warning: {} of mlocked host memory per node exceeds RLIMIT_MEMLOCK ({}); \
                 raise it (ulimit -l) or set pin_memory = false",
                human(locked),
                human(limit)
            );
        }
    }
    match sug {
        None if fits => println!("verdict: fits"),
        Some(Some(s)) => {
            println!("verdict: does not fit; cheapest change that fits:");
            for c in &s.changes {
                println!("  - {c}");
            }
            println!(
                "  then: device {}, host {} per rank",
                human(s.estimate.device.peak_bytes),
                human(s.estimate.host_total_bytes())
            );
        }
        _ => println!(
            "verdict: does not fit, and no combination of checkpointing, stage 3, offload and \
             micro-batch 1 fits: add GPUs or nodes"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_config_resolves() {
        let loaded = parse(DEFAULT_CONFIG, Format::Json, "default").unwrap();
        let cfg = loaded.config.resolve(&ResolveContext::new(8)).unwrap();
        assert_eq!(cfg.world_size, 8);
        assert_eq!(cfg.precision, Precision::Bf16);
    }
}
