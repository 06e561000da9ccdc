//! The optimizer step on device state (`optim.cu`): one multi-tensor launch per call, with the
//! gradient scale read from device memory, bit-identical to the CPU step.

use super::backend::{expect_dtype, expect_len, CudaBackend};
use super::device::BLOCK;
use super::driver::{DevPtr, LaunchConfig};
use super::kernels::params::OptTensor;
use super::launch::Args;
use super::storage::CudaBuf;
use crate::backend::{OptimizerOps, StepStatus, UpdateRule};
use crate::tensor::{DType, View, ViewMut};
use crate::Result;
use ferrozero_offload::optim::WeightDecay;

const OP: &str = "optimizer step";

/// Elements per chunk of the multi-tensor launch (a multiple of 8, so aligned chunks vectorise).
const CHUNK: usize = 1 << 16;

impl OptimizerOps for CudaBackend {
    fn step_status(&self, losses: &[View<'_>], grads: &[View<'_>]) -> Result<StepStatus> {
        self.read_status(losses, grads)
    }

    fn optimizer_update(
        &self,
        rule: &UpdateRule,
        step: u64,
        grad_scale: f32,
        params: ViewMut<'_>,
        grads: View<'_>,
        m: ViewMut<'_>,
        v: ViewMut<'_>,
        lp: Option<ViewMut<'_>>,
    ) -> Result<()> {
        let (p, g) = (
            self.dev_out(OP, "parameters", params)?,
            self.dev_in(OP, "gradients", grads)?,
        );
        let (m, v) = (
            self.dev_out(OP, "first moment", m)?,
            self.dev_out(OP, "second moment", v)?,
        );
        let lp = lp
            .map(|l| self.dev_out(OP, "low-precision copy", l))
            .transpose()?;
        let n = p.len();
        expect_len(OP, "gradients", g.len(), n)?;
        expect_len(OP, "first moment", m.len(), n)?;
        if matches!(rule, UpdateRule::Adam(_)) {
            expect_len(OP, "second moment", v.len(), n)?;
        }
        expect_dtype(
            OP,
            DType::F32,
            &[("parameters", p.dtype()), ("first moment", m.dtype())],
        )?;
        if n == 0 {
            return Ok(());
        }
        // The kernels read f32 gradients: widen half-precision ones first (exactly).
        let widened;
        let gptr = if g.dtype() == DType::F32 {
            g.ptr()
        } else {
            let mut w = CudaBuf::uninit(&self.dev, DType::F32, n)?;
            let mut args = Args::new().ptr(g.ptr()).ptr(w.view_mut().ptr()).len(n);
            let name = match g.dtype() {
                DType::Bf16 => "cast_bf16_to_f32",
                _ => "cast_f16_to_f32",
            };
            self.dev.launch(name, self.dev.grid_for(n), &mut args)?;
            widened = w;
            widened.view().ptr()
        };
        let (lp_ptr, lp_dtype) = match &lp {
            Some(l) => {
                expect_len(OP, "low-precision copy", l.len(), n)?;
                (l.ptr(), l.dtype())
            }
            None => (DevPtr::NULL, DType::F32),
        };
        let desc = OptTensor {
            params: p.ptr().0,
            grads: gptr.0,
            m: m.ptr().0,
            v: if v.is_empty() { 0 } else { v.ptr().0 },
            lp: lp_ptr.0,
            n: n as i64,
            first_chunk: 0,
        };
        let table = self.dev.upload_async(bytemuck::bytes_of(&desc))?;
        let scale = self.dev.upload_async(&grad_scale.to_le_bytes())?;
        let chunks = n.div_ceil(CHUNK);
        let head = Args::new()
            .ptr(table.ptr())
            .i32(1)
            .len(chunks)
            .i32(CHUNK as i32);
        let sms = self.dev.info().multiprocessors.max(1) as usize;
        let cfg = LaunchConfig::linear(chunks.min(8 * sms).max(1) as u32, BLOCK);
        let (name, mut args) = match rule {
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
                (
                    lp_kernel(
                        ["adam_multi_f32", "adam_multi_bf16", "adam_multi_f16"],
                        &lp,
                        lp_dtype,
                    ),
                    args,
                )
            }
            UpdateRule::Sgd(hp) => {
                let args = head
                    .f32(hp.lr)
                    .f32(hp.momentum)
                    .f32(hp.dampening)
                    .f32(hp.weight_decay)
                    .i32(i32::from(hp.nesterov))
                    .i32(i32::from(step <= 1));
                (
                    lp_kernel(
                        ["sgd_multi_f32", "sgd_multi_bf16", "sgd_multi_f16"],
                        &lp,
                        lp_dtype,
                    ),
                    args,
                )
            }
            UpdateRule::Lion(hp) => {
                let args = head
                    .f32(hp.lr)
                    .f32(hp.beta1)
                    .f32(hp.beta2)
                    .f32(hp.weight_decay);
                (
                    lp_kernel(
                        ["lion_multi_f32", "lion_multi_bf16", "lion_multi_f16"],
                        &lp,
                        lp_dtype,
                    ),
                    args,
                )
            }
        };
        args = args.ptr(scale.ptr());
        self.dev.launch(name, cfg, &mut args)?;
        // An f32 "low-precision" copy is the parameters themselves, copied after the update.
        if let (Some(l), DType::F32) = (lp, lp_dtype) {
            p.as_view().copy_to(l)?;
        }
        Ok(())
    }
}

/// The kernel variant for the low-precision copy: none and f32 copies use the `_f32` kernel.
fn lp_kernel(
    names: [&'static str; 3],
    lp: &Option<super::storage::CudaViewMut<'_>>,
    dtype: DType,
) -> &'static str {
    match (lp, dtype) {
        (Some(_), DType::Bf16) => names[1],
        (Some(_), DType::F16) => names[2],
        _ => names[0],
    }
}
