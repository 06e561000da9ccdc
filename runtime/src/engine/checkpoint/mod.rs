//! Sharded, atomic checkpoints that resume bit-exactly and load at any world size and stage.
//!
//! On disk, `DIR/TAG/` holds one safetensors file per rank (that rank's canonical shard of
//! every group: parameters in the storage dtype, fp32 master, moments) and `meta.json`
//! (written by rank 0: config, counters, scaler, layout, per-file checksums). `DIR/latest`
//! names the newest complete tag. Every rank stores the shard `layout.shard_range(rank)`
//! whatever the stage, so the files do not depend on how the stage replicated state.
//!
//! Invariant: a tag directory becomes visible only by a rename after every file in it is
//! durable, and `latest` moves only after that rename, so a crash leaves the previous state.

mod agree;
mod consolidate;
mod fsio;
mod load;
mod meta;
mod peft_export;
mod reader;
mod save;
mod shard_file;
mod stream;

pub(in crate::engine) use agree::{agree, all_gather_text};
pub use consolidate::{consolidate, consolidate_dir, ConsolidateReport, OutputDType};
pub(in crate::engine) use load::{open_checked, restore_groups, same_kind};
pub use meta::{CheckpointMeta, FileMeta, FrozenBase, GroupMeta, SlotMeta, TensorKind};
pub use peft_export::{checkpoint_adapter, export_adapter, export_merged};
pub use reader::CheckpointReader;
pub(in crate::engine) use save::{check_tag, Saving};

/// Which checkpoint of a directory to load.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Tag {
    /// The tag that the directory's `latest` file names.
    Latest,
    /// A tag by name.
    Named(String),
}

/// What [`crate::engine::Engine::load_checkpoint`] restored, for the caller's data loader.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadedCheckpoint {
    /// The tag loaded.
    pub tag: String,
    /// Optimizer steps taken when it was saved.
    pub step: u64,
    /// The data position the caller passed to `save_checkpoint`.
    pub data_position: u64,
    /// World size it was saved with.
    pub saved_world_size: usize,
}
