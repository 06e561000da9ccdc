//! The parameters' flow: how a unit's full parameters come to be and go again (the stage's
//! gather and release, the one-rank uploads, hpZ's secondary partition, NVMe shards).

use super::hpz::Hpz;
use super::param_upload::ParamUploads;
use super::places::Places;
use super::stage::Stage;
use super::swap::Swap;

/// Everything between a group's parameter shard and the full parameters a unit computes with.
pub(super) struct ParamFlow {
    /// Which of parameters, gradients and optimizer state are full or sharded.
    pub(super) stage: Box<dyn Stage>,
    /// Stage 3 at one rank: shards copied to the device without a collective (waited for by
    /// the engine's drop, before the groups free the shards they read).
    pub(super) uploads: ParamUploads,
    /// ZeRO++ hpZ's secondary parameter partition and group (see `hpz`).
    pub(super) hpz: Hpz,
    /// Stage-3 parameter shards on NVMe, or off.
    pub(super) swap: Swap,
    /// Which groups each unit reads, and where each of its parameters sits.
    pub(super) places: Places,
}
