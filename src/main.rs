//! The `ferrozero` command-line tool: validate configs, inspect schemas, train, launch ranks,
//! benchmark the hot paths, estimate memory and manage checkpoints.

mod cli;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// ferrozero: ZeRO training in Rust.
#[derive(Parser)]
#[command(name = "ferrozero", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Validate one or more config files (exit 0 valid, 1 invalid, 2 unreadable).
    Validate(cli::validate::Args),
    /// Print the JSON Schema of the config format, or (`--format markdown`) the config reference.
    Schema(cli::schema::Args),
    /// Show or convert configs.
    Config(cli::config::Args),
    /// Fine-tune a Hugging Face model directory on a text or token file.
    Train(Box<cli::train::Args>),
    /// Start N ranks of a program (torchrun-style).
    Launch(cli::launch::Args),
    /// Inspect or consolidate a sharded checkpoint.
    Checkpoint(cli::checkpoint::Args),
    /// Per-rank peak memory for a model, config and world size, with a verdict.
    Estimate(Box<cli::estimate::Args>),
    /// What this machine and build can do (like ds_report).
    Report(cli::report::Args),
    /// Benchmarks of the hot paths.
    Bench {
        #[command(subcommand)]
        which: BenchCommand,
    },
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Collective bandwidth, nccl-tests style.
    Comm(cli::bench_comm::Args),
    /// CPU optimizer step throughput.
    Adam(cli::bench_adam::Args),
    /// The per-step passes over the whole gradient (accumulate, norm and overflow, zeroing).
    Grad(cli::bench_grad::Args),
    /// NVMe swap read/write bandwidth.
    Swap(cli::bench_swap::Args),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Validate(a) => cli::validate::run(a),
        Command::Schema(a) => cli::schema::run(a),
        Command::Config(a) => cli::config::run(a),
        Command::Train(a) => cli::train::run(*a),
        Command::Launch(a) => cli::launch::run(a),
        Command::Checkpoint(a) => cli::checkpoint::run(a),
        Command::Estimate(a) => cli::estimate::run(*a),
        Command::Report(a) => cli::report::run(a),
        Command::Bench { which } => match which {
            BenchCommand::Comm(a) => cli::bench_comm::run(a),
            BenchCommand::Adam(a) => cli::bench_adam::run(a),
            BenchCommand::Grad(a) => cli::bench_grad::run(a),
            BenchCommand::Swap(a) => cli::bench_swap::run(a),
        },
    }
}
