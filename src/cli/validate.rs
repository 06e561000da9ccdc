//! `ferrozero validate FILE...`: load every file, report every diagnostic, and exit 0 (all
//! valid), 1 (some invalid) or 2 (some unreadable).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use ferrozero_config::{load, render_all, Diagnostic, LoadError, RenderStyle};
use serde::Serialize;

/// Output format of `validate`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum OutputFormat {
    /// rustc-style diagnostics on stderr.
    Human,
    /// One JSON array on stdout, an object per file.
    Json,
}

/// Arguments.
#[derive(clap::Args)]
pub struct Args {
    /// Config files (`.toml` or `.json`).
    #[arg(required = true)]
    files: Vec<PathBuf>,
    /// Also check `train_batch_size = micro × accumulation × world size` at this world size.
    #[arg(long)]
    world_size: Option<usize>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = OutputFormat::Human)]
    format: OutputFormat,
}

/// The verdict on one file.
#[derive(Serialize, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
#[serde(rename_all = "lowercase")]
enum Status {
    Valid,
    Invalid,
    Unreadable,
}

#[derive(Serialize)]
struct FileReport {
    file: String,
    status: Status,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
    diagnostics: Vec<Diagnostic>,
}

/// Validates one file; the batch rule is checked only when a world size is given.
fn check(path: &Path, world_size: Option<usize>) -> FileReport {
    let file = path.display().to_string();
    match load(path) {
        Ok(loaded) => {
            let mut diagnostics = loaded.warnings;
            if let Some(world) = world_size {
                diagnostics.extend(loaded.config.check_batch_size(world));
            }
            let status = if diagnostics.iter().any(Diagnostic::is_error) {
                Status::Invalid
            } else {
                Status::Valid
            };
            FileReport {
                file,
                status,
                error: None,
                diagnostics,
            }
        }
        Err(e @ LoadError::Invalid { .. }) => FileReport {
            file,
            status: Status::Invalid,
            error: None,
            diagnostics: e.diagnostics().to_vec(),
        },
        Err(e) => FileReport {
            file,
            status: Status::Unreadable,
            error: Some(e.to_string()),
            diagnostics: vec![],
        },
    }
}

/// Runs the subcommand.
pub fn run(args: Args) -> ExitCode {
    let reports: Vec<FileReport> = args
        .files
        .iter()
        .map(|f| check(f, args.world_size))
        .collect();
    match args.format {
        OutputFormat::Json => match serde_json::to_string_pretty(&reports) {
            Ok(s) => println!("{s}"),
            Err(e) => eprintln!("error: cannot encode the report: {e}"),
        },
        OutputFormat::Human => {
            let style = if ferrozero::logging::stderr_colour() {
                RenderStyle::Styled
            } else {
                RenderStyle::Plain
            };
            for r in &reports {
                match &r.error {
                    Some(e) => eprintln!("error: {e}\n"),
                    None => eprintln!("{}\n", render_all(&r.diagnostics, &r.file, style)),
                }
            }
        }
    }
    let worst = reports
        .iter()
        .map(|r| r.status)
        .max()
        .unwrap_or(Status::Valid);
    ExitCode::from(match worst {
        Status::Valid => 0,
        Status::Invalid => 1,
        Status::Unreadable => 2,
    })
}
