//! `ferrozero schema`: print the JSON Schema of the config format (the one committed as
//! `configs/ferrozero.schema.json`).

use std::process::ExitCode;

/// Arguments.
#[derive(clap::Args)]
pub struct Args {}

/// Runs the subcommand.
pub fn run(_args: Args) -> ExitCode {
    print!("{}", ferrozero_config::json_schema());
    ExitCode::SUCCESS
}
