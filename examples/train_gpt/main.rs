//! The main job: train a GPT (or Llama) on several local ranks with a ZeRO config, on the
//! built-in addition task (held-out exact-match accuracy at the end) or on a token file.
//!
//!     cargo run --release --example train_gpt -- --help

mod data;
mod run;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;

/// Train a GPT-2 or Llama model with ZeRO on local ranks.
#[derive(Parser, Debug, Clone)]
#[command(name = "train_gpt")]
pub struct Args {
    /// ZeRO config, TOML or DeepSpeed JSON [default: configs/default.toml, built in].
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Local ranks (threads in this process).
    #[arg(long, default_value_t = 2)]
    pub ranks: usize,
    /// Compute device: auto, cpu, cuda or cuda:N (overrides the config's `device`).
    #[arg(long)]
    pub device: Option<ferrozero::config::Device>,
    /// Cap on each rank's device memory, e.g. 40GB (10^9) or 40GiB (2^30) (overrides the
    /// config's `device_memory_limit`): a run that cannot fit is refused at start.
    #[arg(long, value_parser = parse_limit)]
    pub device_memory_limit: Option<ferrozero::config::ByteSize>,
    /// Model: a preset (addition, tiny, bench-15m, gpt2-124m, llama-tiny, llama-7b,
    /// llama-13b) or a Hugging Face config.json (GPT2LMHeadModel, LlamaForCausalLM,
    /// MistralForCausalLM or Qwen2ForCausalLM).
    #[arg(long, default_value = "addition")]
    pub model_config: String,
    /// Initial weights with Hugging Face names (GPT-2's Conv1D layout): a model directory
    /// (`model.safetensors` or `model.safetensors.index.json` + shards), an index, or one
    /// safetensors file; f32, bf16 or f16. Memory-mapped; each rank keeps only its part.
    #[arg(long)]
    pub init: Option<PathBuf>,
    /// LoRA: a PEFT adapter_config.json (new adapters) or adapter directory (start from its
    /// weights); the base model is frozen.
    #[arg(long)]
    pub peft: Option<PathBuf>,
    /// Freeze the parameters whose Hugging Face names match these globs, in order (the last
    /// matching pattern decides; a leading `!` thaws).
    #[arg(long, num_args = 1..)]
    pub freeze: Vec<String>,
    /// Training data: a .bin token file (`ferrozero::data`'s header, or raw little-endian u16
    /// ids), a .txt file (bytes, or tokens with --tokenizer) or a .jsonl file (with
    /// --tokenizer). Default: the built-in addition task.
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// A Hugging Face tokenizer.json for .txt and .jsonl data.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Share of the --data rows held out for an evaluation loss (0: none).
    #[arg(long, default_value_t = 0.0)]
    pub eval_fraction: f64,
    /// Held-out loss every N steps (with --eval-fraction).
    #[arg(long)]
    pub eval_every: Option<u64>,
    /// Sequence length for --data.
    #[arg(long, default_value_t = 128)]
    pub seq_len: usize,
    /// Digits per operand for the addition task.
    #[arg(long, default_value_t = 3)]
    pub digits: u32,
    /// Optimizer steps.
    #[arg(long, default_value_t = 1500)]
    pub steps: u64,
    /// Seed for the data order (the config's `seed` initialises the model).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Visit rows in a seeded random order instead of consecutively.
    #[arg(long)]
    pub shuffle: bool,
    /// Write one JSON object per optimizer step here.
    #[arg(long)]
    pub metrics: Option<PathBuf>,
    /// Write a chart of device memory by category per step (SVG) here at the end.
    #[arg(long)]
    pub memory_timeline: Option<PathBuf>,
    /// Checkpoint into this directory at the end (sharded, atomic; `ferrozero checkpoint
    /// consolidate DIR -o model.safetensors` turns it into Hugging Face weights).
    #[arg(long)]
    pub save: Option<PathBuf>,
    /// Also checkpoint every N steps (with --save).
    #[arg(long)]
    pub save_every: Option<u64>,
    /// Continue from the latest checkpoint in this directory (data position included).
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Held-out problems to evaluate at the end (addition task), or at most this many
    /// held-out rows per evaluation (--eval-fraction).
    #[arg(long, default_value_t = 1024)]
    pub eval_rows: usize,
    /// Log from every rank, prefixed, instead of rank 0 only.
    #[arg(long)]
    pub log_all_ranks: bool,
    /// Print one JSON line at the end for benchmarks: tokens/s over the steps after the first
    /// two (warm-up), peak ledger bytes per rank and the process's peak RSS.
    #[arg(long)]
    pub bench_json: bool,
    /// The device's peak dense TFLOP/s for `mfu` in the metrics and the benchmark line
    /// (overrides the config's `flops_profiler.peak_tflops`; known GPUs need none, the CPU
    /// reports no MFU without it).
    #[arg(long, value_parser = ferrozero::train::parse_peak_tflops)]
    pub peak_tflops: Option<f64>,
    /// No progress bar (logs a line every `steps_per_print` steps instead).
    #[arg(long)]
    pub no_progress: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    // Colour only on a terminal, and never with NO_COLOR set.
    ferrozero::logging::init();
    ferrozero::logging::exit_code(run::run(&args))
}

/// A positive size for `--device-memory-limit`, parsed as the config key is.
fn parse_limit(s: &str) -> Result<ferrozero::config::ByteSize, String> {
    match ferrozero::config::parse_size(s)? {
        0 => Err("the limit must be positive (leave the flag out for none)".into()),
        b => Ok(ferrozero::config::ByteSize(b)),
    }
}
