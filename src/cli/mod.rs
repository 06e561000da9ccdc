//! One module per subcommand; each defines its clap `Args` and a `run` returning the exit code.

pub mod bench_adam;
pub mod bench_comm;
pub mod bench_grad;
pub mod bench_swap;
pub mod checkpoint;
pub mod config;
pub mod estimate;
pub mod launch;
pub mod report;
pub mod schema;
pub mod train;
pub mod validate;

/// The worker threads a benchmark asked for, or every core this process may use.
pub(crate) fn threads_or_all(threads: Option<usize>) -> usize {
    threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}
