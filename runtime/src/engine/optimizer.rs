//! The engine's optimizer driver: updates each group's owned range in `sub_group_size`
//! tiles, writing the low-precision copy in the same pass, on the device that holds the
//! optimizer state (the compute device, or the host when the state is offloaded: then the
//! gradients come down and the parameters go up on the copy streams, `offload_copies.rs`).
//! NVMe-resident state goes
//! through the offload crate's pipelined tile driver.

use ferrozero_config::resolved::OptimizerConfig;
use ferrozero_offload::optim::{AdamHyper, LambHyper, LionHyper, SgdHyper, WeightDecay};

use super::group::{owned_lp, Group, OwnedState};
use super::nvme::NvmeOffload;
use super::offload_copies::{self, Inbound, Landing, UploadWindow};
use super::partition::chunks;
use crate::backend::{Backend, GradView, StepTensor, UpdateRule};
use crate::tensor::{DType, ViewMut};
use crate::{Error, Result};
use std::ops::Range;

/// Per-step values that the schedule decides.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepValues {
    /// 1-based optimizer step (bias correction).
    pub step: u64,
    /// Learning rate.
    pub lr: f64,
    /// Momentum override (OneCycle's beta1), if the schedule cycles momentum.
    pub beta1: Option<f64>,
    /// Multiplies every gradient: loss-scale removal times the clipping coefficient.
    pub grad_scale: f32,
}

/// The configured optimizer. Its clones (the optimizer lane's) share one window of
/// parameter uploads in flight.
#[derive(Debug, Clone)]
pub struct Optimizer {
    cfg: OptimizerConfig,
    uploads: std::sync::Arc<UploadWindow>,
}

impl Optimizer {
    /// Wraps a resolved optimizer config.
    pub fn new(cfg: OptimizerConfig) -> Self {
        Self {
            cfg,
            uploads: Default::default(),
        }
    }

    /// f32 state buffers per parameter element (Adam, Lamb: m and v; SGD and Lion: one).
    pub fn moments(&self) -> usize {
        match self.cfg {
            OptimizerConfig::Adam { .. } | OptimizerConfig::Lamb { .. } => 2,
            OptimizerConfig::Sgd { .. } | OptimizerConfig::Lion { .. } => 1,
        }
    }

    /// Queues the downloads group `g`'s step reads when its optimizer state is in host
    /// memory (see `offload_copies`); nothing otherwise.
    pub fn fetch(&self, g: &Group, be: &dyn Backend) -> Result<Inbound> {
        let Group { m, nvme_adam, .. } = g;
        let offloaded = m.is_host_side();
        match offloaded && nvme_adam.is_none() {
            true => offload_copies::fetch(g, be),
            false => Ok(Inbound::default()),
        }
    }

    /// Updates the group's owned range, `tile` elements at a time, on `be` when the state
    /// lives on the compute device and on the host when it is offloaded (reading what
    /// `inbound` fetched; the uploads it queues wait in the group's `landing`).
    pub fn step_group(
        &self,
        g: &mut Group,
        sv: &StepValues,
        tile: usize,
        nvme: Option<&NvmeOffload>,
        be: &dyn Backend,
        inbound: Inbound,
    ) -> Result<()> {
        if let (Some(_), Some(n)) = (&g.nvme_adam, nvme) {
            return self.step_nvme(g, n, sv);
        }
        let rule = self.rule(sv)?;
        let Group { m, .. } = &*g;
        let offloaded = m.is_host_side();
        if offloaded {
            g.landing = Landing::default();
            let inbound = (inbound, &*self.uploads);
            g.landing = offload_copies::host_step(&rule, sv, tile, g, inbound, be)?;
            return Ok(());
        }
        let OwnedState {
            params: (mut p, mut lp),
            grad,
            m,
            v,
            owned,
        } = g.owned_state()?;
        for t in chunks(owned.len(), tile) {
            let grads = grad.range(owned.start + t.start..owned.start + t.end)?;
            let lp_t = match &mut lp {
                Some((b, off)) => Some(b.range_mut(*off + t.start..*off + t.end)?),
                None => None,
            };
            let pt = p.reborrow().range(t.clone())?;
            let mt = m.range_mut(t.clone())?;
            // SGD and Lion keep no second moment: an empty view stands in.
            let vn = v.len();
            let vt = v.range_mut(t.start.min(vn)..t.end.min(vn))?;
            be.optimizer_update(&rule, sv.step, sv.grad_scale, pt, grads, mt, vt, lp_t)?;
        }
        Ok(())
    }

    /// Group `g`'s update as tensors of a whole step (`OptimizerOps::whole_step`): its owned
    /// range in `tile`-element runs, the same calls [`Self::step_group`] makes (a device
    /// updates every run of every group in one launch). With them, the gradient over `norm`
    /// (padded positions): what the norm sums.
    pub fn step_tensors(
        g: &mut Group,
        tile: usize,
        norm: Range<usize>,
    ) -> Result<(GradView<'_>, Vec<StepTensor<'_>>)> {
        let OwnedState {
            params: (p, lp),
            grad,
            m,
            v,
            owned,
        } = g.owned_state()?;
        let n = owned.len();
        let tiles: Vec<_> = chunks(n, tile).collect();
        let mut ps = split_runs(p, &tiles)?.into_iter();
        let mut ms = split_runs(m.range_mut(0..n)?, &tiles)?.into_iter();
        let mut vs = split_runs(v.view_mut(), &tiles)?.into_iter();
        let lps: Vec<Option<ViewMut<'_>>> = match lp {
            Some((b, off)) => split_runs(b.range_mut(off..off + n)?, &tiles)?
                .into_iter()
                .map(Some)
                .collect(),
            None => tiles.iter().map(|_| None).collect(),
        };
        let mut lps = lps.into_iter();
        let mut out = Vec::new();
        for t in &tiles {
            let (Some(params), Some(m), Some(v), Some(lp)) =
                (ps.next(), ms.next(), vs.next(), lps.next())
            else {
                return Err(Error::Invalid(
                    "optimizer runs: a split came up short".into(),
                ));
            };
            out.push(StepTensor {
                params,
                grads: grad.range(owned.start + t.start..owned.start + t.end)?,
                m,
                v,
                lp,
            });
        }
        Ok((grad.range(norm)?, out))
    }

    /// The step for a group whose master weights and moments live on NVMe: the gradient of
    /// the owned range in f32, the tile driver, the low-precision copy written in place (the
    /// storage lends them to the host; size-only storage has nothing to step).
    fn step_nvme(&self, g: &mut Group, n: &NvmeOffload, sv: &StepValues) -> Result<()> {
        let hp = self.adam_hyper(sv)?;
        let Group {
            nvme_adam: Some(state),
            params,
            grad,
            grad_offset,
            owned,
            ..
        } = g
        else {
            return Ok(());
        };
        let (lp, off) = owned_lp(params, owned)?;
        if lp.dtype() == DType::F32 {
            return Err(Error::Config(
                "NVMe optimizer state needs bf16 or fp16 parameters".into(),
            ));
        }
        let grads = owned.start - *grad_offset..owned.end - *grad_offset;
        let lp_range = off..off + owned.len();
        grad.with_host_update(grads, (lp, lp_range), |grads, out| {
            let (store, pool) = (&n.store, &n.pool);
            Ok(state.adam_step(store, pool, &hp, sv.step, sv.grad_scale, grads, out)?)
        })
    }

    fn adam_hyper(&self, sv: &StepValues) -> Result<AdamHyper> {
        let OptimizerConfig::Adam {
            betas,
            eps,
            weight_decay,
            adam_w_mode,
            bias_correction,
            ..
        } = self.cfg
        else {
            return Err(Error::Config(
                "NVMe optimizer state needs Adam or AdamW".into(),
            ));
        };
        Ok(AdamHyper {
            lr: sv.lr as f32,
            beta1: sv.beta1.unwrap_or(betas.0) as f32,
            beta2: betas.1 as f32,
            eps: eps as f32,
            weight_decay: weight_decay as f32,
            decay: if adam_w_mode {
                WeightDecay::Decoupled
            } else {
                WeightDecay::L2
            },
            bias_correction,
        })
    }

    /// The window of parameter uploads in flight that offloaded host steps share.
    pub fn uploads(&self) -> &UploadWindow {
        &self.uploads
    }

    /// Whether the step needs whole tensors' norms (LAMB), so it is not one element-wise
    /// call per run.
    pub fn per_tensor(&self) -> bool {
        matches!(self.cfg, OptimizerConfig::Lamb { .. })
    }

    /// LAMB's hyper-parameters for this step's values; `None` for the element-wise optimizers
    /// (whose step is [`Self::rule`]). LAMB steps every group in two passes with the
    /// per-tensor norms combined between them (`lamb.rs`).
    pub fn lamb_hyper(&self, sv: &StepValues) -> Option<LambHyper> {
        let OptimizerConfig::Lamb {
            betas,
            eps,
            eps_inside_sqrt,
            weight_decay,
            bias_correction,
            max_coeff,
            min_coeff,
            ..
        } = self.cfg
        else {
            return None;
        };
        Some(LambHyper {
            lr: sv.lr as f32,
            beta1: sv.beta1.unwrap_or(betas.0) as f32,
            beta2: betas.1 as f32,
            eps: eps as f32,
            eps_inside_sqrt,
            weight_decay: weight_decay as f32,
            max_coeff: max_coeff as f32,
            min_coeff: min_coeff as f32,
            bias_correction,
        })
    }

    /// The update rule for this step's values.
    pub fn rule(&self, sv: &StepValues) -> Result<UpdateRule> {
        Ok(match self.cfg {
            OptimizerConfig::Adam { .. } => UpdateRule::Adam(self.adam_hyper(sv)?),
            OptimizerConfig::Sgd {
                momentum,
                dampening,
                weight_decay,
                nesterov,
                ..
            } => UpdateRule::Sgd(SgdHyper {
                lr: sv.lr as f32,
                momentum: sv.beta1.unwrap_or(momentum) as f32,
                dampening: dampening as f32,
                weight_decay: weight_decay as f32,
                nesterov,
            }),
            OptimizerConfig::Lion {
                betas,
                weight_decay,
                ..
            } => UpdateRule::Lion(LionHyper {
                lr: sv.lr as f32,
                beta1: sv.beta1.unwrap_or(betas.0) as f32,
                beta2: betas.1 as f32,
                weight_decay: weight_decay as f32,
            }),
            OptimizerConfig::Lamb { .. } => {
                return Err(Error::Invalid(
                    "LAMB has no element-wise update rule: its step is two passes with the \
                     per-tensor norms between them (engine/lamb.rs)"
                        .into(),
                ))
            }
        })
    }
}

/// `v` cut at the ends of `runs` (consecutive from 0); a shorter `v` (an empty second moment)
/// gives its elements to the first runs and empty views after.
fn split_runs<'a>(mut v: ViewMut<'a>, runs: &[Range<usize>]) -> Result<Vec<ViewMut<'a>>> {
    let mut out = Vec::with_capacity(runs.len());
    let mut at = 0;
    for r in runs {
        let mid = r.end.min(at + v.len()) - at.min(r.end);
        let (head, rest) = v.split_at(mid)?;
        out.push(head);
        v = rest;
        at += mid;
    }
    Ok(out)
}
