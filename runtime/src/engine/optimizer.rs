//! The engine's optimizer driver: runs the CPU kernels of `ferrozero-offload` over each
//! group's owned range in `sub_group_size` tiles, writing the low-precision copy in the same
//! pass; NVMe-resident state goes through the offload crate's pipelined tile driver.

use ferrozero_config::resolved::OptimizerConfig;
use ferrozero_offload::optim::{self, AdamHyper, LionHyper, LowPrecision, SgdHyper, WeightDecay};

use super::group::{owned_lp, owned_params, Group};
use super::nvme::NvmeOffload;
use super::partition::chunks;
use crate::tensor::FlatBuf;
use crate::{Error, Result};

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

/// The configured optimizer.
#[derive(Debug, Clone, PartialEq)]
pub struct Optimizer {
    cfg: OptimizerConfig,
}

impl Optimizer {
    /// Wraps a resolved optimizer config.
    pub fn new(cfg: OptimizerConfig) -> Self {
        Self { cfg }
    }

    /// f32 state buffers per parameter element (Adam: m and v; SGD and Lion: one).
    pub fn moments(&self) -> usize {
        match self.cfg {
            OptimizerConfig::Adam { .. } => 2,
            OptimizerConfig::Sgd { .. } | OptimizerConfig::Lion { .. } => 1,
        }
    }

    /// Updates the group's owned range, `tile` elements at a time.
    pub fn step_group(
        &self,
        g: &mut Group,
        sv: &StepValues,
        tile: usize,
        nvme: Option<&NvmeOffload>,
        scratch: &mut Vec<f32>,
    ) -> Result<()> {
        if let (Some(_), Some(n)) = (&g.nvme_adam, nvme) {
            return self.step_nvme(g, n, sv, scratch);
        }
        let Group {
            params,
            master,
            grad,
            grad_offset,
            m,
            v,
            owned,
            ..
        } = g;
        let (p, mut lp) = owned_params(params, master, owned)?;
        let g_base = owned.start - *grad_offset;
        for t in chunks(owned.len(), tile) {
            let grads: &[f32] = match &*grad {
                FlatBuf::F32(gv) => &gv[g_base + t.start..g_base + t.end],
                other => {
                    scratch.resize(t.len(), 0.0);
                    other.load_f32(g_base + t.start, &mut scratch[..t.len()]);
                    &scratch[..t.len()]
                }
            };
            let lp_out = match &mut lp {
                None => LowPrecision::None,
                Some((FlatBuf::Bf16(b), off)) => {
                    LowPrecision::Bf16(&mut b[*off + t.start..*off + t.end])
                }
                Some((FlatBuf::F16(b), off)) => {
                    LowPrecision::F16(&mut b[*off + t.start..*off + t.end])
                }
                Some((FlatBuf::F32(b), off)) => {
                    // f32 storage with master weights does not occur; keep them equal anyway.
                    b[*off + t.start..*off + t.end].copy_from_slice(&p[t.clone()]);
                    LowPrecision::None
                }
            };
            let pt = &mut p[t.clone()];
            self.kernel(
                sv,
                pt,
                grads,
                &mut m[t.clone()],
                v.get_mut(t.clone()).unwrap_or(&mut []),
                lp_out,
            )?;
        }
        Ok(())
    }

    /// The step for a group whose master weights and moments live on NVMe: the gradient of
    /// the owned range in f32, the tile driver, the low-precision copy written in place.
    fn step_nvme(
        &self,
        g: &mut Group,
        n: &NvmeOffload,
        sv: &StepValues,
        scratch: &mut Vec<f32>,
    ) -> Result<()> {
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
        scratch.resize(owned.len(), 0.0);
        grad.load_f32(owned.start - *grad_offset, &mut scratch[..owned.len()]);
        let (lp, off) = owned_lp(params, owned)?;
        let r = off..off + owned.len();
        let out = match lp {
            FlatBuf::Bf16(b) => LowPrecision::Bf16(&mut b[r]),
            FlatBuf::F16(b) => LowPrecision::F16(&mut b[r]),
            FlatBuf::F32(_) => {
                return Err(Error::Config(
                    "NVMe optimizer state needs bf16 or fp16 parameters".into(),
                ))
            }
        };
        state.adam_step(
            &n.store,
            &n.pool,
            &hp,
            sv.step,
            sv.grad_scale,
            &scratch[..owned.len()],
            out,
        )?;
        Ok(())
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

    fn kernel(
        &self,
        sv: &StepValues,
        p: &mut [f32],
        g: &[f32],
        m: &mut [f32],
        v: &mut [f32],
        lp: LowPrecision<'_>,
    ) -> Result<()> {
        match self.cfg {
            OptimizerConfig::Adam { .. } => {
                optim::adam_step(
                    &self.adam_hyper(sv)?,
                    sv.step,
                    sv.grad_scale,
                    p,
                    g,
                    m,
                    v,
                    lp,
                )?;
            }
            OptimizerConfig::Sgd {
                momentum,
                dampening,
                weight_decay,
                nesterov,
                ..
            } => {
                let hp = SgdHyper {
                    lr: sv.lr as f32,
                    momentum: sv.beta1.unwrap_or(momentum) as f32,
                    dampening: dampening as f32,
                    weight_decay: weight_decay as f32,
                    nesterov,
                };
                optim::sgd_step(&hp, sv.step, sv.grad_scale, p, g, m, lp)?;
            }
            OptimizerConfig::Lion {
                betas,
                weight_decay,
                ..
            } => {
                let hp = LionHyper {
                    lr: sv.lr as f32,
                    beta1: sv.beta1.unwrap_or(betas.0) as f32,
                    beta2: betas.1 as f32,
                    weight_decay: weight_decay as f32,
                };
                optim::lion_step(&hp, sv.grad_scale, p, g, m, lp)?;
            }
        }
        Ok(())
    }
}
