//! The engine's assembly: the config checked against the communicator, the observers and
//! communicators opened, the parameter groups built and placed, and every part in its
//! starting state.

use std::sync::Arc;

use ferrozero_config::resolved::ResolvedConfig;

use super::build::{optimizer_location, GroupPlan};
use super::core::Engine;
use super::grad_flow::GradFlow;
use super::group::Group;
use super::ledger::{Category, Ledger, Location};
use super::loss_scale::LossScaler;
use super::micro::MicroState;
use super::nvme::{NvmeOffload, OptimizerStore};
use super::observe::Observers;
use super::optimizer::Optimizer;
use super::optimizer_overlap::{OptimizerLane, OptimizerOverlap};
use super::overlap::CommOverlap;
use super::param_flow::ParamFlow;
use super::param_swap::ParamSwap;
use super::places::Places;
use super::rules;
use super::schedule::Schedule;
use super::stage::{self, Stage};
use super::step_state::StepState;
use super::swap::Swap;
use super::topology::Comms;
use crate::backend::Backend;
use crate::comm::Communicator;
use crate::nn::Model;
use crate::{Error, Result};

/// The engine of `model` on this rank of `comm`, computing on `be`, with the config's
/// optimizer overlap unless `decided` is set.
pub(super) fn assemble(
    model: Model,
    cfg: ResolvedConfig,
    comm: Box<dyn Communicator>,
    be: Arc<dyn Backend>,
    decided: Option<OptimizerOverlap>,
) -> Result<Engine> {
    let mut cfg = cfg;
    cfg.zero.sub_group_size = super::build::effective_sub_group_size(&cfg, &model);
    if cfg.world_size != comm.world_size() {
        return Err(Error::Config(format!(
            "config was resolved for world size {} but the communicator has {} ranks",
            cfg.world_size,
            comm.world_size()
        )));
    }
    let (mut obs, comm) = Observers::open(&cfg, comm)?;
    let (be, model) = obs.instrument(be, model);
    super::lamb::check(&cfg, &*be)?;
    let comm = Comms::open(&cfg, comm)?;
    let shards = comm.shards();
    let stage = stage::for_stage(cfg.zero.stage);
    let optimizer = Optimizer::new(cfg.optimizer.clone());
    let mut ledger = Ledger::with_device_limit(cfg.device_memory_limit);
    let at = (&model, &*be);
    let nvme = open_nvme(&cfg, at, stage.as_ref(), shards, comm.world.rank())?;
    if let Some(n) = &nvme {
        ledger.alloc(Location::Host, Category::CommBuffers, n.pool_bytes());
    }
    let mut param_swap = open_param_swap(&cfg, comm.world.as_ref(), &be)?;
    let plan = GroupPlan {
        stage: stage.as_ref(),
        cfg: &cfg,
        world: shards.world_size(),
        rank: shards.rank(),
        moments: optimizer.moments(),
        nvme: nvme.as_ref(),
        be: &*be,
    };
    let (specs, places) = Places::plan(&model);
    let groups = specs
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let spec = (&s.specs[..], s.frozen);
            plan.build(i, spec, param_swap.store_mut(), &mut ledger)
        })
        .collect::<Result<Vec<Group>>>()?;
    // The resident state alone may already exceed the cap: refuse at initialize.
    ledger.check_limit()?;
    let pinned: u64 = groups
        .iter()
        .filter_map(|g| g.pin.as_ref().map(|p| p.bytes()))
        .sum();
    ledger.lock_host(pinned as i64);
    let hpz = super::hpz::open(&cfg, comm.world.as_ref(), stage.params(), groups.len())?;
    let (n, floor) = (model.units.len(), model.backward_floor());
    let scaler = LossScaler::from_config(match &cfg.precision {
        ferrozero_config::resolved::Precision::Fp16(s) => Some(s),
        _ => None,
    });
    let schedule = Schedule::new(&cfg.optimizer, cfg.scheduler.clone());
    let overlap = CommOverlap::open(&cfg, comm.world.as_ref(), shards)?;
    tracing::debug!(opt_location = ?optimizer_location(&cfg), "engine built");
    let opt_overlap = decided.unwrap_or_else(|| OptimizerOverlap::decide(&cfg));
    if optimizer.per_tensor() && !matches!(opt_overlap, OptimizerOverlap::Off(_)) {
        return Err(Error::Config(
            "optimizer.type = \"Lamb\" does not overlap its step with backward: each \
             tensor's trust ratio needs every rank's partial norms first"
                .into(),
        ));
    }
    opt_overlap.log(&cfg);
    let shared = super::optimizer_overlap::shared_group(&model);
    let optimizer_lane = OptimizerLane::for_overlap(
        &opt_overlap,
        comm.world.rank(),
        (&groups, shared),
        &mut ledger,
    )?;
    let grad_downloads = super::grad_download::GradDownloads::new(&cfg);
    // The first step's report counts the device's work from here, not the build's.
    obs.activity_mark = be.activity();
    Ok(Engine {
        cfg,
        model,
        comm,
        be,
        groups,
        params: ParamFlow {
            stage,
            uploads: Default::default(),
            hpz,
            swap: param_swap,
            places,
        },
        grads: GradFlow {
            overlap,
            downloads: grad_downloads,
            reduced_bytes: 0,
        },
        opt: StepState {
            optimizer,
            schedule,
            scaler,
            overlap: opt_overlap,
            lane: optimizer_lane,
            nvme: nvme.map_or(OptimizerStore::Memory, |n| {
                OptimizerStore::Nvme(Arc::new(n))
            }),
            steps: 0,
        },
        ledger,
        acts: MicroState::new(n, floor),
        obs,
        model_files: Default::default(),
    })
}

/// Opens the rank's parameter swap store when `offload_param.device = "nvme"`.
fn open_param_swap(
    cfg: &ResolvedConfig,
    comm: &dyn Communicator,
    be: &Arc<dyn Backend>,
) -> Result<Swap> {
    match &cfg.zero.offload_param.target {
        ferrozero_config::resolved::OffloadTarget::Nvme(dir) => {
            ParamSwap::open(cfg, be.clone(), dir, comm.rank()).map(Swap::Nvme)
        }
        _ => Ok(Swap::Off),
    }
}

/// Opens the rank's NVMe store when `offload_optimizer.device = "nvme"`.
/// `shards` lays out the sharded state; `rank` (the world's) names the rank's files.
fn open_nvme(
    cfg: &ResolvedConfig,
    (model, be): (&Model, &dyn Backend),
    stage: &dyn Stage,
    shards: &dyn Communicator,
    rank: usize,
) -> Result<Option<NvmeOffload>> {
    let ferrozero_config::resolved::OffloadTarget::Nvme(dir) = &cfg.zero.offload_optimizer.target
    else {
        return Ok(None);
    };
    let largest = rules::largest_owned(model, stage, shards.world_size(), shards.rank());
    NvmeOffload::open(cfg, be, (dir, rank), largest).map(Some)
}
