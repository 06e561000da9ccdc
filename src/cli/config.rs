//! `ferrozero config show FILE [--resolved]` and `ferrozero config convert FILE --to toml|json`.

use std::path::PathBuf;
use std::process::ExitCode;

use ferrozero_config::{
    load, render_all, Diagnostic, LoadError, Loaded, RenderStyle, ResolveContext,
};
use serde::Serialize;

/// A text format for printing configs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum TextFormat {
    /// TOML.
    Toml,
    /// JSON.
    Json,
}

/// Arguments.
#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    action: Action,
}

#[derive(clap::Subcommand)]
enum Action {
    /// Print a config with every default filled in; `--resolved` also resolves "auto" values and
    /// the batch rule for a world size, listing each decision.
    Show {
        /// The config file.
        file: PathBuf,
        /// Resolve for a run (needs `--world-size`).
        #[arg(long, requires = "world_size")]
        resolved: bool,
        /// Data-parallel world size.
        #[arg(long)]
        world_size: Option<usize>,
        /// The model's hidden size, for "auto" bucket sizes.
        #[arg(long)]
        hidden_size: Option<usize>,
        /// Micro-batch for an "auto" train_micro_batch_size_per_gpu.
        #[arg(long)]
        micro_batch: Option<usize>,
        /// Output format.
        #[arg(long, value_enum, default_value_t = TextFormat::Toml)]
        format: TextFormat,
    },
    /// Convert a config (e.g. a DeepSpeed ds_config.json) to TOML or JSON, defaults filled in.
    Convert {
        /// The config file.
        file: PathBuf,
        /// Target format.
        #[arg(long, value_enum)]
        to: TextFormat,
    },
}

fn style() -> RenderStyle {
    if ferrozero::logging::stderr_colour() {
        RenderStyle::Styled
    } else {
        RenderStyle::Plain
    }
}

fn report(err: &LoadError) -> ExitCode {
    eprintln!("{}", err.render(style()));
    ExitCode::from(if err.is_unreadable() { 2 } else { 1 })
}

fn print_warnings(file: &str, warnings: &[Diagnostic]) {
    if !warnings.is_empty() {
        eprintln!("{}\n", render_all(warnings, file, style()));
    }
}

fn encode<T: Serialize>(value: &T, format: TextFormat) -> Result<String, String> {
    match format {
        TextFormat::Toml => toml::to_string_pretty(value).map_err(|e| e.to_string()),
        TextFormat::Json => serde_json::to_string_pretty(value)
            .map(|s| s + "\n")
            .map_err(|e| e.to_string()),
    }
}

fn emit(text: Result<String, String>) -> ExitCode {
    match text {
        Ok(s) => {
            print!("{s}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: cannot encode the config: {e}");
            ExitCode::from(1)
        }
    }
}

/// Runs the subcommand.
pub fn run(args: Args) -> ExitCode {
    match args.action {
        Action::Show {
            file,
            resolved,
            world_size,
            hidden_size,
            micro_batch,
            format,
        } => {
            let loaded = match load(&file) {
                Ok(l) => l,
                Err(e) => return report(&e),
            };
            print_warnings(&file.display().to_string(), &loaded.warnings);
            match (resolved, world_size) {
                (true, Some(world_size)) => {
                    let ctx = ResolveContext {
                        world_size,
                        hidden_size,
                        micro_batch_hint: micro_batch,
                    };
                    show_resolved(&loaded, &ctx, format)
                }
                _ => emit(encode(&loaded.config, format)),
            }
        }
        Action::Convert { file, to } => match load(&file) {
            Ok(l) => {
                print_warnings(&file.display().to_string(), &l.warnings);
                emit(encode(&l.config, to))
            }
            Err(e) => report(&e),
        },
    }
}

fn show_resolved(loaded: &Loaded, ctx: &ResolveContext, format: TextFormat) -> ExitCode {
    let resolution = match loaded.config.resolve_explained(ctx) {
        Ok(r) => r,
        Err(e) => return report(&e),
    };
    for d in &resolution.decisions {
        eprintln!("resolved {} = {} ({})", d.path, d.value, d.rule);
    }
    emit(encode(&resolution.config, format))
}
