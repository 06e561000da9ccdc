//! The NVMe store's I/O settings: DeepSpeed's `aio` section, as enums.

use crate::{Error, Result};

/// How requests reach the kernel (`single_submit`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Submit {
    /// Queue up to `queue_depth` requests, then submit them with one system call.
    Batched,
    /// One system call per request (`single_submit: true`).
    Single,
}

/// Whether new requests are issued while earlier ones complete (`overlap_events`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Overlap {
    /// Refill the queue as each request completes.
    Overlapped,
    /// Wait for the whole batch before issuing the next.
    Sequential,
}

/// Which I/O engine a store uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineChoice {
    /// io_uring when the kernel allows it, else the thread pool.
    Auto,
    /// io_uring or fail.
    IoUring,
    /// Blocking pread/pwrite on a pool of threads.
    Threads,
}

/// I/O settings for an [`super::NvmeStore`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AioSettings {
    /// Bytes per request and checksum block: a positive multiple of 4096.
    pub block_size: usize,
    /// Requests in flight per lane.
    pub queue_depth: usize,
    /// Lanes one tensor is split across.
    pub intra_op_parallelism: usize,
    /// `single_submit`.
    pub submit: Submit,
    /// `overlap_events`.
    pub overlap: Overlap,
    /// Engine selection.
    pub engine: EngineChoice,
}

impl Default for AioSettings {
    /// DeepSpeed's defaults (1 MiB blocks, queue depth 8, overlapped, batched submits).
    fn default() -> Self {
        AioSettings {
            block_size: 1 << 20,
            queue_depth: 8,
            intra_op_parallelism: 1,
            submit: Submit::Batched,
            overlap: Overlap::Overlapped,
            engine: EngineChoice::Auto,
        }
    }
}

impl AioSettings {
    /// Checks the values the store relies on.
    pub fn validate(&self) -> Result<()> {
        let bad = |detail: String| {
            Err(Error::Invalid {
                op: "NvmeStore::open",
                detail,
            })
        };
        if self.block_size == 0
            || !self.block_size.is_multiple_of(4096)
            || self.block_size > 1 << 30
        {
            return bad(format!(
                "aio.block_size {} must be a positive multiple of 4096 (O_DIRECT) up to 1 GiB",
                self.block_size
            ));
        }
        if !(1..=4096).contains(&self.queue_depth) {
            return bad(format!(
                "aio.queue_depth {} must be in 1..=4096",
                self.queue_depth
            ));
        }
        if !(1..=256).contains(&self.intra_op_parallelism) {
            return bad(format!(
                "aio.intra_op_parallelism {} must be in 1..=256",
                self.intra_op_parallelism
            ));
        }
        Ok(())
    }
}
