//! `ferrozero bench comm` (not built yet: answers with a clear error).

use std::process::ExitCode;

/// Arguments.
#[derive(clap::Args)]
pub struct Args {}

/// Runs the subcommand.
pub fn run(_args: Args) -> ExitCode {
    super::unavailable("bench comm")
}
