//! Log output of the `ferrozero` tool and the examples: ANSI colour only when the stream is a
//! terminal, and never when `NO_COLOR` is set to a non-empty value (<https://no-color.org>),
//! so that `train_gpt ... > log 2>&1` writes plain text. Metrics files never go through here.

use std::ffi::OsStr;
use std::io::IsTerminal;

/// The colour rule: a terminal, and `NO_COLOR` unset or empty.
pub fn colour_allowed(is_terminal: bool, no_color: Option<&OsStr>) -> bool {
    is_terminal && no_color.is_none_or(OsStr::is_empty)
}

/// Whether text written to stderr may carry colour, by [`colour_allowed`].
pub fn stderr_colour() -> bool {
    colour_allowed(
        std::io::stderr().is_terminal(),
        std::env::var_os("NO_COLOR").as_deref(),
    )
}

/// Installs the `tracing` subscriber the tools and examples log through: to stderr, level
/// from `RUST_LOG` (default `info`), coloured by [`stderr_colour`]. Does nothing if one is
/// installed already.
pub fn init() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_target(false)
        .with_ansi(stderr_colour())
        .with_writer(std::io::stderr)
        .try_init();
}

/// The exit code of a run that ended with `r`; an error is printed to stderr first.
pub fn exit_code(r: Result<(), impl std::fmt::Display>) -> std::process::ExitCode {
    r.map_or_else(
        |e| {
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        },
        |()| std::process::ExitCode::SUCCESS,
    )
}

#[cfg(test)]
mod tests {
    use super::{colour_allowed, exit_code};
    use std::ffi::OsStr;
    use std::process::ExitCode;

    #[test]
    fn a_run_that_failed_exits_with_failure() {
        assert_eq!(exit_code(Ok::<(), String>(())), ExitCode::SUCCESS);
        assert_eq!(exit_code(Err("no such file")), ExitCode::FAILURE);
    }

    #[test]
    fn colour_only_on_a_terminal_without_no_color() {
        assert!(colour_allowed(true, None));
        assert!(colour_allowed(true, Some(OsStr::new(""))));
        assert!(!colour_allowed(true, Some(OsStr::new("1"))));
        assert!(
            !colour_allowed(true, Some(OsStr::new("0"))),
            "any non-empty value"
        );
        assert!(!colour_allowed(false, None));
        assert!(!colour_allowed(false, Some(OsStr::new("1"))));
    }
}
