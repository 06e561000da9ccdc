//! NVMe optimizer offload (ZeRO-Infinity's `offload_optimizer.device = "nvme"`): each group's
//! fp32 master weights and Adam moments live in the rank's swap directory as
//! `sub_group_size` tiles, stepped by the offload crate's pipelined tile driver (read ahead,
//! update, write behind) through a fixed pool of host buffers.

use std::path::Path;

use ferrozero_config::resolved::{AioConfig, OptimizerConfig, Precision, ResolvedConfig};
use ferrozero_offload::pool::{BufferPool, Pinning};
use ferrozero_offload::store::{AioSettings, NvmeStore, Overlap, Submit};

use crate::backend::Backend;

use crate::{Error, Result};

/// The rank's swap store and the host buffers its tiles move through.
pub struct NvmeOffload {
    /// The rank's own swap directory.
    pub store: NvmeStore,
    /// Host buffers, `buffer_count` of one tile each.
    pub pool: BufferPool,
    /// Parameters per tile.
    pub tile: usize,
}

/// The store settings for the `aio` section.
pub(super) fn aio_settings(a: &AioConfig) -> AioSettings {
    AioSettings {
        block_size: a.block_size,
        queue_depth: a.queue_depth,
        intra_op_parallelism: a.intra_op_parallelism,
        submit: if a.single_submit {
            Submit::Single
        } else {
            Submit::Batched
        },
        overlap: if a.overlap_events {
            Overlap::Overlapped
        } else {
            Overlap::Sequential
        },
        ..AioSettings::default()
    }
}

impl NvmeOffload {
    /// Opens `dir/rank{rank}` for a config whose optimizer state goes to NVMe, the store and
    /// the pool as the compute device `be` provides them. `largest` is the largest owned
    /// range of any group, so a tile never exceeds what a group needs.
    pub fn open(
        cfg: &ResolvedConfig,
        be: &dyn Backend,
        (dir, rank): (&Path, usize),
        largest: usize,
    ) -> Result<Self> {
        if !matches!(cfg.optimizer, OptimizerConfig::Adam { .. }) {
            return Err(Error::Config(
                "offload_optimizer.device = \"nvme\" supports Adam and AdamW".into(),
            ));
        }
        if cfg.precision == Precision::F32 {
            return Err(Error::Config(
                "offload_optimizer.device = \"nvme\" keeps the fp32 master weights on NVMe and needs bf16 or fp16 \
                 parameter copies in memory; enable [bf16] or [fp16]"
                    .into(),
            ));
        }
        let off = &cfg.zero.offload_optimizer;
        let (count, bytes, tile) = super::rules::nvme_pool(cfg, largest);
        let pinning = if off.pin_memory {
            Pinning::Locked
        } else {
            Pinning::Pageable
        };
        let pool = be.host_pool(count, bytes, pinning)?;
        let store = be.nvme_store(&dir.join(format!("rank{rank}")), &aio_settings(&cfg.aio))?;
        Ok(Self { store, pool, tile })
    }

    /// Host bytes the pool holds.
    pub fn pool_bytes(&self) -> u64 {
        (self.pool.buffer_count() * self.pool.buffer_size()) as u64
    }
}

/// Where the optimizer state lives beyond memory: nowhere (`Memory`), or the rank's NVMe
/// store (`offload_optimizer.device = "nvme"`), shared with the optimizer lane.
pub(super) enum OptimizerStore {
    /// The optimizer state is in memory.
    Memory,
    /// The rank's NVMe store.
    Nvme(std::sync::Arc<NvmeOffload>),
}

impl OptimizerStore {
    /// The NVMe store, if the state lives there.
    pub(super) fn get(&self) -> Option<&NvmeOffload> {
        self.shared().map(|n| &**n)
    }

    /// The NVMe store's shared handle, if the state lives there.
    pub(super) fn shared(&self) -> Option<&std::sync::Arc<NvmeOffload>> {
        match self {
            OptimizerStore::Nvme(n) => Some(n),
            OptimizerStore::Memory => None,
        }
    }
}
