//! The offload crate's error type.

/// Errors from the byte movers.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Buffers given to a kernel disagree in length.
    #[error("length mismatch in {op}: {detail}")]
    Length {
        /// The kernel.
        op: &'static str,
        /// Which lengths.
        detail: String,
    },
    /// An I/O failure naming the file, offset and tensor.
    #[error("{op} {path} at offset {offset} (tensor {tensor}): {source}")]
    Io {
        /// `read`, `write`, `open`, ...
        op: &'static str,
        /// The swap file.
        path: String,
        /// Byte offset.
        offset: u64,
        /// The tensor key.
        tensor: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// A swap block failed its checksum or was short.
    #[error("corrupt swap data in {path} at offset {offset} (tensor {tensor}): {reason}")]
    Corrupt {
        /// The swap file.
        path: String,
        /// Byte offset.
        offset: u64,
        /// The tensor key.
        tensor: String,
        /// What was wrong.
        reason: String,
    },
    /// An argument is out of range (the message says which and why).
    #[error("invalid argument to {op}: {detail}")]
    Invalid {
        /// The operation.
        op: &'static str,
        /// What was wrong.
        detail: String,
    },
    /// The machine cannot hold what the configuration asks for.
    #[error("resource: {0}")]
    Resource(String),
}

/// The offload crate's result alias.
pub type Result<T, E = Error> = std::result::Result<T, E>;
