//! When an estimate does not fit: the cheapest configuration change that does, found by
//! re-running the estimator on each candidate in order of cost (checkpointing, a higher
//! stage, optimizer offload, parameter offload, NVMe, a smaller micro-batch).

use std::fmt;
use std::path::PathBuf;

use ferrozero_config::resolved::{OffloadTarget, ResolvedConfig, ZeroStage};
use serde::Serialize;

use super::{default_checkpointing, estimate, Estimate};
use crate::nn::Model;

/// Memory available to one rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Budget {
    /// Device bytes per rank.
    pub device_bytes: u64,
    /// Host bytes per rank (the node's RAM divided among its ranks).
    pub host_bytes: u64,
}

impl Budget {
    /// Whether an estimate fits: device peak and host peak (swap buffers and the device's
    /// page-locked staging included, each buffer once: what `initialize` checks).
    pub fn fits(&self, e: &Estimate) -> bool {
        let host = crate::engine::host_limits::HostRamNeed::of(e, 1).total();
        e.device.peak_bytes <= self.device_bytes && host <= self.host_bytes
    }
}

/// One configuration change.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub enum Change {
    /// Turn on activation checkpointing.
    ActivationCheckpointing,
    /// Move to a higher ZeRO stage.
    Stage(u8),
    /// Offload the optimizer state to host memory.
    OffloadOptimizerCpu,
    /// Offload parameters to host memory (stage 3).
    OffloadParamCpu,
    /// Offload optimizer state and parameters to NVMe (stage 3).
    Nvme,
    /// Use a smaller micro-batch.
    MicroBatch(usize),
}

impl fmt::Display for Change {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Change::ActivationCheckpointing => {
                write!(f, "enable activation checkpointing ([activation_checkpointing])")
            }
            Change::Stage(s) => write!(f, "use ZeRO stage {s} (zero_optimization.stage = {s})"),
            Change::OffloadOptimizerCpu => write!(
                f,
                "offload the optimizer to CPU (zero_optimization.offload_optimizer.device = \"cpu\")"
            ),
            Change::OffloadParamCpu => write!(
                f,
                "offload parameters to CPU at stage 3 (zero_optimization.offload_param.device = \"cpu\")"
            ),
            Change::Nvme => write!(
                f,
                "offload optimizer and parameters to NVMe at stage 3 (offload_*.device = \"nvme\")"
            ),
            Change::MicroBatch(m) => write!(
                f,
                "use micro-batch {m} (train_micro_batch_size_per_gpu = {m}; raise gradient accumulation to keep the global batch)"
            ),
        }
    }
}

/// A set of changes and the estimate with them applied.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Suggestion {
    /// Changes, applied in this order.
    pub changes: Vec<Change>,
    /// The estimate after the changes.
    pub estimate: Estimate,
}

fn stage_of(n: u8) -> ZeroStage {
    match n {
        0 => ZeroStage::Stage0,
        1 => ZeroStage::Stage1,
        2 => ZeroStage::Stage2,
        _ => ZeroStage::Stage3,
    }
}

/// Applies a change to a config and micro-batch.
fn apply(c: &Change, cfg: &mut ResolvedConfig, micro: &mut usize) {
    let z = &mut cfg.zero;
    match c {
        Change::ActivationCheckpointing => {
            cfg.activation_checkpointing = Some(default_checkpointing())
        }
        Change::Stage(s) => z.stage = z.stage.max(stage_of(*s)),
        Change::OffloadOptimizerCpu => z.offload_optimizer.target = OffloadTarget::Cpu,
        Change::OffloadParamCpu => {
            z.stage = ZeroStage::Stage3;
            z.offload_param.target = OffloadTarget::Cpu;
            z.offload_optimizer.target = OffloadTarget::Cpu;
        }
        Change::Nvme => {
            let path = nvme_path(cfg);
            let z = &mut cfg.zero;
            z.stage = ZeroStage::Stage3;
            z.offload_param.target = OffloadTarget::Nvme(path.clone());
            z.offload_optimizer.target = OffloadTarget::Nvme(path);
        }
        Change::MicroBatch(m) => *micro = *m,
    }
}

/// The configured NVMe directory, or DeepSpeed's customary one.
fn nvme_path(cfg: &ResolvedConfig) -> PathBuf {
    [&cfg.zero.offload_optimizer, &cfg.zero.offload_param]
        .iter()
        .find_map(|o| match &o.target {
            OffloadTarget::Nvme(p) => Some(p.clone()),
            _ => None,
        })
        .unwrap_or_else(|| PathBuf::from("/local_nvme"))
}

/// Candidate changes in order of cost, skipping those already in effect.
fn candidates(cfg: &ResolvedConfig, micro: usize) -> Vec<Change> {
    let z = &cfg.zero;
    let mut c = Vec::new();
    if cfg.activation_checkpointing.is_none() {
        c.push(Change::ActivationCheckpointing);
    }
    c.extend((z.stage.number() + 1..=3).map(Change::Stage));
    if z.offload_optimizer.target == OffloadTarget::None {
        c.push(Change::OffloadOptimizerCpu);
    }
    if z.offload_param.target == OffloadTarget::None {
        c.push(Change::OffloadParamCpu);
    }
    let on_nvme = |t: &OffloadTarget| matches!(t, OffloadTarget::Nvme(_));
    if !(on_nvme(&z.offload_param.target) && on_nvme(&z.offload_optimizer.target)) {
        c.push(Change::Nvme);
    }
    let mut m = micro / 2;
    while m >= 1 {
        c.push(Change::MicroBatch(m));
        m /= 2;
    }
    c
}

/// The cheapest change (or, failing any single one, the shortest prefix of the candidate
/// list applied together) under which the estimate fits `budget`; `None` if nothing does.
pub fn suggest(
    model: &Model,
    cfg: &ResolvedConfig,
    micro_batch: usize,
    seq: usize,
    budget: Budget,
) -> Option<Suggestion> {
    let cands = candidates(cfg, micro_batch);
    let run = |changes: &[Change]| {
        let (mut c, mut m) = (cfg.clone(), micro_batch);
        for ch in changes {
            apply(ch, &mut c, &mut m);
        }
        estimate(model, &c, m, seq)
    };
    // A change the engine refuses (NVMe with an optimizer it cannot keep there) fits nothing.
    for ch in &cands {
        let Ok(e) = run(std::slice::from_ref(ch)) else {
            continue;
        };
        if budget.fits(&e) {
            return Some(Suggestion {
                changes: vec![ch.clone()],
                estimate: e,
            });
        }
    }
    (2..=cands.len()).find_map(|n| {
        let e = run(&cands[..n]).ok()?;
        budget.fits(&e).then(|| Suggestion {
            changes: simplify(&cands[..n]),
            estimate: e,
        })
    })
}

/// Drops changes a later one supersedes: only the highest stage and the smallest micro-batch
/// are kept, and NVMe replaces CPU offload.
fn simplify(changes: &[Change]) -> Vec<Change> {
    let last_stage = changes.iter().rposition(|c| matches!(c, Change::Stage(_)));
    let last_micro = changes
        .iter()
        .rposition(|c| matches!(c, Change::MicroBatch(_)));
    let nvme = changes.contains(&Change::Nvme);
    changes
        .iter()
        .enumerate()
        .filter(|&(i, c)| match c {
            Change::Stage(_) => Some(i) == last_stage,
            Change::MicroBatch(_) => Some(i) == last_micro,
            Change::OffloadOptimizerCpu | Change::OffloadParamCpu => !nvme,
            _ => true,
        })
        .map(|(_, c)| c.clone())
        .collect()
}

/// The pre-flight check: the estimate when it fits `budget`, otherwise a configuration error
/// that gives the shortfall and the cheapest change that fits (or says that none does).
pub fn preflight(
    model: &Model,
    cfg: &ResolvedConfig,
    micro_batch: usize,
    seq: usize,
    budget: Budget,
) -> crate::Result<Estimate> {
    let e = estimate(model, cfg, micro_batch, seq)?;
    if budget.fits(&e) {
        return Ok(e);
    }
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let mut msg = format!(
        "this run needs {:.2} GiB of device and {:.2} GiB of host memory per rank, but the \
         budget is {:.2} GiB and {:.2} GiB",
        gib(e.device.peak_bytes),
        gib(e.host_total_bytes()),
        gib(budget.device_bytes),
        gib(budget.host_bytes)
    );
    match suggest(model, cfg, micro_batch, seq, budget) {
        Some(s) => {
            let changes: Vec<String> = s.changes.iter().map(|c| c.to_string()).collect();
            msg.push_str(&format!("; it fits if you {}", changes.join(", then ")));
        }
        None => msg.push_str("; no change of stage, offload, checkpointing or micro-batch fits"),
    }
    Err(crate::Error::Config(msg))
}
