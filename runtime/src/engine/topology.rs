//! Which communicator carries what: the world (scalars, the batch's token count), the shard
//! group (sharded state; hybrid sharding's [`HybridComm`] when `mics_shard_size`
//! splits the world), and the check that the communicator is the one `comms.backend` names.

use ferrozero_config::resolved::{CommBackend, ResolvedConfig, ZeroStage};

use crate::comm::hybrid::HybridComm;
use crate::comm::Communicator;
use crate::{Error, Result};

/// The name `comms.backend` uses for a backend.
pub fn backend_name(b: CommBackend) -> &'static str {
    match b {
        CommBackend::Local => "local",
        CommBackend::Mpi => "mpi",
        CommBackend::Nccl => "nccl",
    }
}

/// How a job gets a communicator of each backend, for error messages.
fn how_to_get(b: CommBackend) -> &'static str {
    match b {
        CommBackend::Local => {
            "ranks as threads of one process: comm::local::run_ranks (what train_gpt --ranks N does)"
        }
        CommBackend::Mpi => {
            "one process per rank: build with --features mpi, start with mpirun or ferrozero launch, \
             and pass comm::mpi::MpiComm::world(..) to EngineBuilder::comm"
        }
        CommBackend::Nccl => {
            "one process per GPU: build with --features cuda, start with ferrozero launch, and \
             pass comm::nccl::NcclComm::from_env(..) to EngineBuilder::comm (ranks sharing one \
             GPU use comms.backend = \"local\" with device = \"cuda\")"
        }
    }
}

/// Refuses a communicator other than the one the config names, saying why and what works.
pub(super) fn check_backend(cfg: &ResolvedConfig, comm: &dyn Communicator) -> Result<()> {
    let (want, have) = (cfg.comms.backend, comm.backend());
    if want == have {
        let ordered = cfg.comms.reduction == ferrozero_config::resolved::CommReduction::RankOrdered;
        if ordered && !comm.deterministic() {
            return Err(Error::Config(
                "comms.reduction = \"rank_ordered\" but the communicator given sums in its \
                 library's own order; create it from the config (NcclOptions::from_config, \
                 MpiComm::with_reduction)"
                    .into(),
            ));
        }
        return Ok(());
    }
    Err(Error::Config(format!(
        "comms.backend = \"{}\" but this rank was given a {} communicator; a {} job needs {}; \
         or set comms.backend = \"{}\" to run on the communicator given",
        backend_name(want),
        backend_name(have),
        backend_name(want),
        how_to_get(want),
        backend_name(have),
    )))
}

/// The hybrid-sharding communicator when `mics_shard_size` splits the world into
/// several groups (collective), groups of one rank included (every rank's state replicated,
/// DeepSpeed's `mics_shard_size = 1`); flat when it is 0 or the whole world (plain ZeRO).
fn open_hybrid(cfg: &ResolvedConfig, comm: &dyn Communicator) -> Result<Sharding> {
    let g = cfg.zero.mics_shard_size;
    let world = comm.world_size();
    if g == 0 {
        return Ok(Sharding::Flat);
    }
    crate::comm::hybrid::check_group_size("mics_shard_size", g, world)?;
    if g == world {
        return Ok(Sharding::Flat);
    }
    if cfg.zero.stage == ZeroStage::Stage0 && comm.rank() == 0 {
        tracing::warn!(
            "mics_shard_size = {g} at stage 0 shards nothing: it only makes the gradient \
             all-reduce hierarchical (inside groups of {g}, then across them)"
        );
    }
    HybridComm::new(comm, g).map(Sharding::Hybrid)
}

/// How sharded state is split across the world.
pub(super) enum Sharding {
    /// Across the whole world (plain ZeRO).
    Flat,
    /// Across each shard group of hybrid sharding (`mics_shard_size`).
    Hybrid(HybridComm),
}

/// The engine's communicators: the world, and the shard group's when hybrid sharding
/// splits it.
pub(super) struct Comms {
    /// All ranks (wrapped by the observers that time collectives).
    pub(super) world: Box<dyn Communicator>,
    /// Flat, or the shard-group communicator when hybrid sharding splits the world.
    pub(super) hybrid: Sharding,
    /// Cross-group payload bytes at the end of the last step (reports carry the difference).
    pub(super) cross_mark: u64,
}

impl Comms {
    /// The communicators of `cfg`'s topology over `world` (collective with hybrid sharding).
    pub(super) fn open(cfg: &ResolvedConfig, world: Box<dyn Communicator>) -> Result<Self> {
        check_backend(cfg, world.as_ref())?;
        let hybrid = open_hybrid(cfg, world.as_ref())?;
        Ok(Self {
            world,
            hybrid,
            cross_mark: 0,
        })
    }

    /// The communicator sharded state is split across.
    pub(super) fn shards(&self) -> &dyn Communicator {
        match &self.hybrid {
            Sharding::Hybrid(h) => h,
            Sharding::Flat => &*self.world,
        }
    }

    /// Copies of the sharded state across the world: `world / mics_shard_size` with
    /// hybrid sharding, else 1.
    pub(super) fn replicas(&self) -> usize {
        match &self.hybrid {
            Sharding::Hybrid(h) => h.replicas(),
            Sharding::Flat => 1,
        }
    }

    /// ` (hybrid: R groups of G)` when hybrid sharding is on, for the summary.
    pub(super) fn hybrid_summary(&self) -> String {
        match &self.hybrid {
            Sharding::Hybrid(h) => format!(
                " (hybrid sharding: {} groups of {})",
                h.replicas(),
                h.world_size()
            ),
            Sharding::Flat => String::new(),
        }
    }

    /// The ranks one copy of the sharded state is split across (for sums over that copy).
    pub(super) fn one_copy(&self) -> &dyn Communicator {
        match &self.hybrid {
            Sharding::Hybrid(h) => h.shard_group(),
            Sharding::Flat => &*self.world,
        }
    }

    /// Bytes this rank sent across shard groups since the last call, as a ring collective
    /// over the replicas sends them (`2 (R - 1) / R` of the reduced payload); `hpz`: the
    /// parameter bytes hpZ's forward gathers brought from other groups, counted instead.
    pub(super) fn take_cross_group_bytes(&mut self, hpz: u64) -> u64 {
        let Sharding::Hybrid(h) = &self.hybrid else {
            return hpz;
        };
        let total = h.cross_group_bytes();
        let payload = total - std::mem::replace(&mut self.cross_mark, total);
        let r = h.replicas() as u64;
        payload * 2 * (r - 1) / r
    }
}
