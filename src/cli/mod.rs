//! One module per subcommand; each defines its clap `Args` and a `run` returning the exit code.

pub mod bench_adam;
pub mod bench_comm;
pub mod bench_swap;
pub mod config;
pub mod estimate;
pub mod launch;
pub mod report;
pub mod schema;
pub mod validate;

/// Prints an error for a subcommand that this build cannot serve and returns exit code 2.
pub fn unavailable(what: &str) -> std::process::ExitCode {
    eprintln!("error: `ferrozero {what}` is not available in this build yet");
    std::process::ExitCode::from(2)
}
