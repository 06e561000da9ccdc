//! Hybrid sharding (DeepSpeed's MiCS, `mics_shard_size`; FSDP's `HYBRID_SHARD`):
//! sharded state is split inside a *shard group* of `G` consecutive ranks (a node) and
//! replicated across the `W / G` groups.
//!
//! [`HybridComm`] is the communicator the engine hands its sharded data to. Its ranks are the
//! shard group's: `rank()` and `world_size()` say where a shard lives, and `all_gather` runs
//! inside the group only (the per-unit parameter gathers stay on the fast intra-node links).
//! Reductions cover every rank of the world, hierarchically: first inside the shard group,
//! then across groups among the ranks holding the same shard (the *replica* group), so only
//! the gradient shards cross nodes. The sum order is therefore `(x0 + x1) + (x2 + x3)`, not
//! the flat `((x0 + x1) + x2) + x3`: results equal plain ZeRO at the same world size to
//! rounding, and are bitwise reproducible for a fixed world size and group size.
//!
//! The view forms (device buffers) take the same two steps through the inner communicators'
//! view forms, so device buffers stay where they are on both.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use ferrozero_config::resolved::CommBackend;

use super::{BufMut, BufRef, Communicator, ReduceOp};
use crate::tensor::{View, ViewMut};
use crate::{Error, Result};

/// Shard-group communicator for hybrid sharding; see the module documentation.
pub struct HybridComm {
    /// The `G` ranks that split the state between them.
    shard: Box<dyn Communicator>,
    /// The `W / G` ranks (one per group) that hold the same shard.
    replica: Box<dyn Communicator>,
    /// Payload bytes this rank reduced or broadcast across groups, shared with duplicates.
    crossed: Arc<AtomicU64>,
}

impl std::fmt::Debug for HybridComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HybridComm")
            .field("shard_rank", &self.shard.rank())
            .field("group_size", &self.shard.world_size())
            .field("replica_rank", &self.replica.rank())
            .field("replicas", &self.replica.world_size())
            .finish()
    }
}

/// Checks that `group_size` (the config key `key` names it) splits `world` into equal groups.
pub fn check_group_size(key: &str, group_size: usize, world: usize) -> Result<()> {
    if group_size > world {
        return Err(Error::Config(format!(
            "zero_optimization.{key} = {group_size} is larger than the world \
             size {world}: a shard group cannot have more ranks than the job (use the ranks per \
             node, at most {world})"
        )));
    }
    if group_size == 0 || !world.is_multiple_of(group_size) {
        return Err(Error::Config(format!(
            "zero_optimization.{key} = {group_size} must divide the world size \
             {world} (groups of consecutive ranks, one per node: use the ranks per node)"
        )));
    }
    Ok(())
}

impl HybridComm {
    /// Splits `world` into shard groups of `group_size` consecutive ranks (rank `r` is in
    /// group `r / G` at position `r % G`) and replica groups across them (collective).
    pub fn new(world: &dyn Communicator, group_size: usize) -> Result<Self> {
        check_group_size("mics_shard_size", group_size, world.world_size())?;
        let shard = world.split_blocks(group_size)?;
        let replica = world.split_strided(group_size)?;
        Ok(Self {
            shard,
            replica,
            crossed: Arc::new(AtomicU64::new(0)),
        })
    }

    /// The shard group alone (for sums over one copy of the sharded state, such as the
    /// gradient norm).
    pub fn shard_group(&self) -> &dyn Communicator {
        &*self.shard
    }

    /// Groups holding a copy of the state (`W / G`).
    pub fn replicas(&self) -> usize {
        self.replica.world_size()
    }

    /// Payload bytes this rank has reduced or broadcast across groups so far (this
    /// communicator and its duplicates together). A ring all-reduce over `R` groups sends
    /// `2 (R - 1) / R` times this over the inter-group links (nccl-tests' bus bytes).
    pub fn cross_group_bytes(&self) -> u64 {
        self.crossed.load(Ordering::Relaxed)
    }

    fn count(&self, elements: usize, elem_size: usize) {
        if self.replica.world_size() > 1 {
            let b = (elements * elem_size) as u64;
            self.crossed.fetch_add(b, Ordering::Relaxed);
        }
    }
}

impl Communicator for HybridComm {
    fn rank(&self) -> usize {
        self.shard.rank()
    }

    fn world_size(&self) -> usize {
        self.shard.world_size()
    }

    fn backend(&self) -> CommBackend {
        self.shard.backend()
    }

    fn deterministic(&self) -> bool {
        self.shard.deterministic() && self.replica.deterministic()
    }

    crate::comm::host_by_views!();

    /// Every rank of the world: once a rank passed the replica barrier, every group's
    /// members have entered their shard barrier.
    fn barrier(&self) -> Result<()> {
        self.shard.barrier()?;
        self.replica.barrier()
    }

    /// Sums (or averages, or maxes) over the whole world: inside the group, then across.
    fn all_reduce_view(&self, mut buf: ViewMut<'_>, op: ReduceOp) -> Result<()> {
        self.shard.all_reduce_view(buf.reborrow(), op)?;
        self.count(buf.len(), buf.dtype().size());
        self.replica.all_reduce_view(buf, op)
    }

    /// Reduce-scatter inside the group, then all-reduce of the shard across groups: every
    /// rank holding shard `r` gets the world's sum of it.
    fn reduce_scatter_view(
        &self,
        input: View<'_>,
        mut output: ViewMut<'_>,
        op: ReduceOp,
    ) -> Result<()> {
        self.shard
            .reduce_scatter_view(input, output.reborrow(), op)?;
        self.count(output.len(), output.dtype().size());
        self.replica.all_reduce_view(output, op)
    }

    /// Inside the group only: every group holds the same shards.
    fn all_gather_view(&self, input: View<'_>, output: ViewMut<'_>) -> Result<()> {
        self.shard.all_gather_view(input, output)
    }

    /// Inside the shard group, as the all-gather (a copy: nothing crosses groups).
    fn all_to_all(&self, input: BufRef<'_>, output: BufMut<'_>) -> Result<()> {
        self.shard.all_to_all(input, output)
    }

    fn all_to_all_view(&self, input: View<'_>, output: ViewMut<'_>) -> Result<()> {
        self.shard.all_to_all_view(input, output)
    }

    /// `root` is a position in the shard group; group 0's root's buffer reaches every rank.
    fn broadcast_view(&self, mut buf: ViewMut<'_>, root: usize) -> Result<()> {
        self.shard.broadcast_view(buf.reborrow(), root)?;
        self.count(buf.len(), buf.dtype().size());
        self.replica.broadcast_view(buf, 0)
    }

    fn fence(&self) -> Result<()> {
        self.shard.fence()?;
        self.replica.fence()
    }

    fn duplicate(&self) -> Result<Box<dyn Communicator>> {
        Ok(Box::new(Self {
            shard: self.shard.duplicate()?,
            replica: self.replica.duplicate()?,
            crossed: Arc::clone(&self.crossed),
        }))
    }

    fn split(&self, _color: usize, _key: usize) -> Result<Box<dyn Communicator>> {
        Err(Error::Invalid(
            "a hybrid-sharding communicator cannot be split further; split the world \
             communicator it was made from"
                .into(),
        ))
    }
}
