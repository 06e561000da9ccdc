//! The optimizer step on device state (`optim.cu`): one multi-tensor launch per call over
//! every tensor given, gradients read in their own dtype, the gradient scale read from device
//! memory, bit-identical to the CPU step; f32 state, or bf16 parameters and moments
//! (`bf16.bf16_optimizer_states`) widened and rounded back as the CPU's host step does. A whole step (`whole_step`) decides that scale on
//! the device too, so the host reads the step's status once, after the update.

use super::backend::{expect_len, CudaBackend};
use super::device::BLOCK;
use super::driver::{DevPtr, LaunchConfig};
use super::kernels::params::OptTensor;
use super::launch::Args;
use super::storage::{variant_names, CudaView, CudaViewMut};
use crate::backend::{ClipRule, GradView, OptimizerOps, StepStatus, StepTensor, UpdateRule};
use crate::tensor::{DType, View, ViewMut};
use crate::Result;
use ferrozero_offload::optim::{LambHyper, WeightDecay};

const OP: &str = "optimizer step";

/// Elements per chunk of the multi-tensor launch (a multiple of 8, so aligned chunks vectorise).
const CHUNK: usize = 1 << 16;

/// One tensor of a launch, checked: its views on this device.
struct DevTensor<'a> {
    p: CudaViewMut<'a>,
    g: CudaView<'a>,
    /// How the kernel reads `g` (`OptTensor::grad_dtype`).
    g_read: i64,
    m: CudaViewMut<'a>,
    v: CudaViewMut<'a>,
    lp: Option<CudaViewMut<'a>>,
    /// Which kernel of the rule steps it.
    variant: Variant,
}

/// A rule's kernel for one tensor, by the dtype its values are stored in and the copy written
/// beside them; the index of its name in `launch_multi`'s lists.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Variant {
    /// f32 state, no copy or an f32 one (the parameters copied after the update): `_f32`.
    F32 = 0,
    /// f32 state and a bf16 copy: `_bf16`.
    CopyBf16 = 1,
    /// f32 state and an f16 copy: `_f16`.
    CopyF16 = 2,
    /// bf16 parameters and moments, no copy: `_bf16_state`.
    Bf16State = 3,
}

const VARIANTS: [Variant; 4] = [
    Variant::F32,
    Variant::CopyBf16,
    Variant::CopyF16,
    Variant::Bf16State,
];

/// The kernel for values stored as `state` (the parameters' dtype; the moments' must match)
/// with a copy of dtype `lp`; an error naming the dtypes for a pair no kernel steps.
fn variant_of(state: DType, moments: &[(&str, DType)], lp: Option<DType>) -> Result<Variant> {
    if let Some((what, d)) = moments.iter().find(|(_, d)| *d != state) {
        return Err(crate::Error::Invalid(format!(
            "{OP}: the parameters are {state:?} but the {what} is {d:?}: the device step takes \
             f32 parameters and moments, or bf16 ones (bf16_optimizer_states)"
        )));
    }
    match (state, lp) {
        (DType::F32, None | Some(DType::F32)) => Ok(Variant::F32),
        (DType::F32, Some(DType::Bf16)) => Ok(Variant::CopyBf16),
        (DType::F32, Some(DType::F16)) => Ok(Variant::CopyF16),
        (DType::Bf16, None) => Ok(Variant::Bf16State),
        (DType::Bf16, Some(_)) => Err(crate::Error::Invalid(format!(
            "{OP}: bf16 optimizer values with a separate rounded parameter copy; with bf16 \
             master weights the parameters are updated in place"
        ))),
        (DType::F16, _) => Err(crate::Error::Invalid(format!(
            "{OP}: f16 parameters without f32 master weights; the device step keeps f32 or \
             bf16 optimizer values"
        ))),
    }
}

/// How the kernels read gradients `g` as `grads` asks (`OptTensor::grad_dtype`), or an error
/// naming a reading no kernel has.
pub(super) fn grad_read(op: &'static str, g: &CudaView<'_>, grads: GradView<'_>) -> Result<i64> {
    let round = grads.checked_round(op)?;
    OptTensor::grad_read_of(g.dtype(), round).ok_or_else(|| {
        crate::Error::Invalid(format!(
            "{op}: no kernel reads {:?} gradients as {round:?}",
            g.dtype()
        ))
    })
}

/// A rule's kernel names in [`Variant`] order.
macro_rules! variants {
    ($rule:literal) => {
        variant_names!($rule: "_multi_f32", "_multi_bf16", "_multi_f16", "_bf16_state")
    };
}

impl CudaBackend {
    /// `t`'s views on this device, their lengths and dtypes checked.
    fn dev_tensor<'a>(&self, rule: &UpdateRule, t: StepTensor<'a>) -> Result<DevTensor<'a>> {
        let (p, g) = (
            self.dev_out(OP, "parameters", t.params)?,
            self.dev_in(OP, "gradients", t.grads.values)?,
        );
        let g_read = grad_read(OP, &g, t.grads)?;
        let (m, v) = (
            self.dev_out(OP, "first moment", t.m)?,
            self.dev_out(OP, "second moment", t.v)?,
        );
        let lp =
            t.lp.map(|l| self.dev_out(OP, "low-precision copy", l))
                .transpose()?;
        let n = p.len();
        expect_len(OP, "gradients", g.len(), n)?;
        expect_len(OP, "first moment", m.len(), n)?;
        if matches!(rule, UpdateRule::Adam(_)) {
            expect_len(OP, "second moment", v.len(), n)?;
        }
        if let Some(l) = &lp {
            expect_len(OP, "low-precision copy", l.len(), n)?;
        }
        let mut moments = vec![("first moment", m.dtype())];
        if !v.is_empty() {
            moments.push(("second moment", v.dtype()));
        }
        let variant = variant_of(p.dtype(), &moments, lp.as_ref().map(|l| l.dtype()))?;
        Ok(DevTensor {
            p,
            g,
            g_read,
            m,
            v,
            lp,
            variant,
        })
    }

    /// Updates every tensor with the scale at `scale` (device memory): one launch per
    /// kernel variant among them (one in a training step), then the f32 copies.
    fn launch_update(
        &self,
        rule: &UpdateRule,
        step: u64,
        scale: DevPtr,
        tensors: Vec<DevTensor<'_>>,
    ) -> Result<()> {
        for variant in VARIANTS {
            let mut descs = Vec::new();
            let mut chunks = 0usize;
            for t in tensors
                .iter()
                .filter(|t| t.variant == variant && !t.p.is_empty())
            {
                let n = t.p.len();
                descs.push(OptTensor {
                    params: t.p.ptr().0,
                    grads: t.g.ptr().0,
                    m: t.m.ptr().0,
                    v: if t.v.is_empty() { 0 } else { t.v.ptr().0 },
                    lp: t.lp.as_ref().map_or(0, |l| l.ptr().0),
                    n: n as i64,
                    first_chunk: chunks as i64,
                    grad_dtype: t.g_read,
                });
                chunks += n.div_ceil(CHUNK);
            }
            if !descs.is_empty() {
                self.launch_multi(rule, step, scale, &descs, chunks, variant)?;
            }
        }
        // An f32 "low-precision" copy is the parameters themselves, copied after the update.
        for t in tensors {
            if let Some(l) = t.lp.filter(|l| l.dtype() == DType::F32) {
                t.p.as_view().copy_to(l)?;
            }
        }
        Ok(())
    }

    /// One multi-tensor launch of `rule` over `descs` (uploaded through the ring).
    fn launch_multi(
        &self,
        rule: &UpdateRule,
        step: u64,
        scale: DevPtr,
        descs: &[OptTensor],
        chunks: usize,
        variant: Variant,
    ) -> Result<()> {
        let table = self.dev.upload_async(bytemuck::cast_slice(descs))?;
        let head = Args::new()
            .ptr(table.ptr())
            .i32(descs.len() as i32)
            .len(chunks)
            .i32(CHUNK as i32);
        let sms = self.dev.info().multiprocessors.max(1) as usize;
        let cfg = LaunchConfig::linear(chunks.min(8 * sms).max(1) as u32, BLOCK);
        let (names, args) = match rule {
            UpdateRule::Adam(hp) => {
                let (step_size, bc2_sqrt) = ferrozero_offload::optim::adam_terms(hp, step)?;
                let args = head
                    .f32(hp.lr)
                    .f32(hp.beta1)
                    .f32(hp.beta2)
                    .f32(hp.eps)
                    .f32(hp.weight_decay)
                    .i32(i32::from(hp.decay == WeightDecay::Decoupled))
                    .f32(step_size)
                    .f32(bc2_sqrt);
                (variants!("adam"), args)
            }
            UpdateRule::Sgd(hp) => {
                let args = head
                    .f32(hp.lr)
                    .f32(hp.momentum)
                    .f32(hp.dampening)
                    .f32(hp.weight_decay)
                    .i32(i32::from(hp.nesterov))
                    .i32(i32::from(step <= 1));
                (variants!("sgd"), args)
            }
            UpdateRule::Lion(hp) => {
                let args = head
                    .f32(hp.lr)
                    .f32(hp.beta1)
                    .f32(hp.beta2)
                    .f32(hp.weight_decay);
                (variants!("lion"), args)
            }
        };
        self.dev
            .launch(names[variant as usize], cfg, &mut args.ptr(scale))
    }
}

impl OptimizerOps for CudaBackend {
    fn step_status(&self, losses: &[View<'_>], grads: &[GradView<'_>]) -> Result<StepStatus> {
        self.read_status(losses, grads)
    }

    fn optimizer_update(
        &self,
        rule: &UpdateRule,
        step: u64,
        grad_scale: f32,
        params: ViewMut<'_>,
        grads: GradView<'_>,
        m: ViewMut<'_>,
        v: ViewMut<'_>,
        lp: Option<ViewMut<'_>>,
    ) -> Result<()> {
        let t = StepTensor {
            params,
            grads,
            m,
            v,
            lp,
        };
        let t = self.dev_tensor(rule, t)?;
        if t.p.is_empty() {
            return Ok(());
        }
        let scale = self.dev.upload_async(&grad_scale.to_le_bytes())?;
        self.launch_update(rule, step, scale.ptr(), vec![t])
    }

    fn optimizer_update_all(
        &self,
        rule: &UpdateRule,
        step: u64,
        grad_scale: f32,
        tensors: Vec<StepTensor<'_>>,
    ) -> Result<()> {
        let tensors = tensors
            .into_iter()
            .map(|t| self.dev_tensor(rule, t))
            .collect::<Result<Vec<_>>>()?;
        let scale = self.dev.upload_async(&grad_scale.to_le_bytes())?;
        self.launch_update(rule, step, scale.ptr(), tensors)
    }

    fn lamb_moments(
        &self,
        hp: &LambHyper,
        grad_scale: f32,
        pg: (View<'_>, GradView<'_>),
        m: ViewMut<'_>,
        v: ViewMut<'_>,
    ) -> Result<(f64, f64)> {
        self.lamb_moments_run(hp, grad_scale, pg, m, v)
    }

    fn lamb_apply(
        &self,
        hsc: (&LambHyper, u64, f32),
        params: ViewMut<'_>,
        mv: (View<'_>, View<'_>),
        lp: Option<ViewMut<'_>>,
    ) -> Result<()> {
        self.lamb_apply_run(hsc, params, mv, lp)
    }

    fn whole_step(
        &self,
        (rule, step, clip): (&UpdateRule, u64, ClipRule),
        losses: &[View<'_>],
        grads: &[GradView<'_>],
        tensors: Vec<StepTensor<'_>>,
    ) -> Result<StepStatus> {
        let tensors = tensors
            .into_iter()
            .map(|t| self.dev_tensor(rule, t))
            .collect::<Result<Vec<_>>>()?;
        // The scale is decided from the sums the device computes: every gradient is here.
        for g in grads {
            self.dev_in(OP, "a gradient of the norm", g.values)?;
        }
        let block = self.status_block(losses, grads, 4)?;
        let rule_vals = [clip.loss_scale, clip.clipping];
        let rule_buf = self.dev.upload_async(bytemuck::cast_slice(&rule_vals))?;
        let scale = block.tail();
        let mut args = Args::new()
            .ptr(block.sums())
            .i32(grads.len() as i32)
            .ptr(rule_buf.ptr())
            .ptr(scale);
        self.dev
            .launch("clip_grad_scale", LaunchConfig::linear(1, 1), &mut args)?;
        self.launch_update(rule, step, scale, tensors)?;
        let (mut st, tail) = block.read()?;
        if self.sizes_only() {
            return Ok(crate::backend::meta::whole_status(clip, losses, grads));
        }
        st.grad_scale = Some(f32::from_le_bytes(tail[..4].try_into().unwrap_or_default()));
        Ok(st)
    }
}
