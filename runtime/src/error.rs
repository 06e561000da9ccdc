//! The runtime's one error type, with structured fields so callers can match on causes.

use std::time::Duration;

/// Everything that can go wrong in the runtime.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Two tensors or buffers that must agree in shape or length do not.
    #[error("shape mismatch in {op}: expected {expected}, got {got}")]
    Shape {
        /// The operation that checked.
        op: &'static str,
        /// What it needed.
        expected: String,
        /// What it got.
        got: String,
    },
    /// A collective failed: a peer died, timed out, or called a different collective.
    #[error("collective {op} failed on rank {rank} (peer {peer:?}) after {elapsed:?}: {reason}")]
    Comm {
        /// The collective, e.g. `all_reduce`.
        op: &'static str,
        /// The rank reporting the error.
        rank: usize,
        /// The peer at fault, when known.
        peer: Option<usize>,
        /// Time spent in the collective before it failed.
        elapsed: Duration,
        /// What went wrong.
        reason: String,
    },
    /// The configuration cannot be honoured for this model or world.
    #[error("configuration: {0}")]
    Config(String),
    /// An invalid argument to a runtime API.
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// A capability that this build or machine lacks (CUDA without a GPU, MPI not compiled in).
    #[error("unavailable: {what}: {why}")]
    Unavailable {
        /// The capability.
        what: &'static str,
        /// Why it is missing, in one line.
        why: String,
    },
    /// Training diverged in a way the engine must not hide (loss scale at its minimum).
    #[error("training stopped: {0}")]
    Training(String),
    /// Reading or writing a model or checkpoint file failed.
    #[error("{path}: {reason}")]
    File {
        /// The file.
        path: String,
        /// What went wrong.
        reason: String,
    },
    /// An I/O error with context.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A device (CUDA) call failed: which call, and the driver's or library's own words.
    #[error("device error in {op}: {detail}")]
    Device {
        /// The call that failed, e.g. `cuMemcpyHtoDAsync` or `cublasLtMatmul`.
        op: String,
        /// The library's error name and message (and the compile log for NVRTC).
        detail: String,
    },
    /// cuBLASLt has no algorithm for a product with this fused epilogue (its heuristic found
    /// none for these types, layouts and alignments): the backend runs the product and the
    /// epilogue as separate kernels instead, so a caller outside the backend never sees it.
    #[error("cuBLASLt has no algorithm for the {epilogue} epilogue: {detail}")]
    GemmRefused {
        /// cuBLASLt's name of the epilogue, e.g. `CUBLASLT_EPILOGUE_BGRADA`.
        epilogue: &'static str,
        /// The status and the product it was asked for.
        detail: String,
    },
    /// A device allocation was refused: by the configured device-memory limit, or by the
    /// device itself after the allocator's cache had been returned to the driver.
    #[error(
        "device memory: {detail}: requested {requested} bytes with {live} bytes live \
         (peak {peak}), limit {limit} bytes"
    )]
    DeviceMemory {
        /// Bytes the allocation asked for (after rounding to the allocator's size class).
        requested: u64,
        /// Bytes handed out and not yet returned when the request came.
        live: u64,
        /// The most bytes live at once since the last peak reset.
        peak: u64,
        /// The limit in force: the configured limit, or the device's total memory.
        limit: u64,
        /// What refused it, in the driver's words where the driver refused.
        detail: String,
    },
    /// A collective operation (a checkpoint save or load, or a whole job of thread ranks)
    /// failed on another rank (or on this one): the message names that rank and carries its
    /// own error text.
    #[error("{op} aborted: rank {rank} failed: {cause}")]
    RankFailed {
        /// The operation, e.g. `checkpoint load`.
        op: &'static str,
        /// The lowest rank that failed.
        rank: usize,
        /// That rank's error, as it printed it.
        cause: String,
    },
    /// Size-only elements (the memory estimate's step holds no values) reached code that
    /// needs values: a module computing with its own host loops, which runs on the CPU
    /// backend only, so no size-only run, and hence no estimate, can price it. The text names
    /// the unit and the operation.
    #[error("cannot run on a size-only device: {0}")]
    SizeOnly(String),
    /// An error from the offload crate.
    #[error(transparent)]
    Offload(#[from] ferrozero_offload::Error),
}

impl Error {
    /// This error as raised inside unit `unit`: a [`Error::SizeOnly`] names the unit, so a
    /// model the estimate cannot run is reported by the module that stops it; any other
    /// error is unchanged.
    pub fn in_unit(self, unit: &str) -> Self {
        match self {
            Error::SizeOnly(why) => Error::SizeOnly(format!("unit `{unit}`: {why}")),
            e => e,
        }
    }
}

/// The runtime's result alias.
pub type Result<T, E = Error> = std::result::Result<T, E>;
