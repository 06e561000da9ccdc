//! `ferrozero schema [--format json|markdown]`: print the JSON Schema of the config format (the
//! one committed as `configs/ferrozero.schema.json`), or the Markdown reference generated from it
//! (the one committed as `docs/config-reference.md`).

use std::process::ExitCode;

/// What to print.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SchemaFormat {
    /// The JSON Schema (2020-12), for editors.
    Json,
    /// The Markdown config reference, for people.
    Markdown,
}

/// Arguments.
#[derive(clap::Args)]
pub struct Args {
    /// Output format.
    #[arg(long, value_enum, default_value_t = SchemaFormat::Json)]
    format: SchemaFormat,
}

/// Runs the subcommand.
pub fn run(args: Args) -> ExitCode {
    match args.format {
        SchemaFormat::Json => print!("{}", ferrozero_config::json_schema()),
        SchemaFormat::Markdown => match ferrozero_config::reference::markdown() {
            Ok(md) => print!("{md}"),
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::from(1);
            }
        },
    }
    ExitCode::SUCCESS
}
