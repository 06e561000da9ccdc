//! The step's status on the device: each gradient range's sum of squares finalized into a
//! slot of one small block, the losses copied beside them, and the block downloaded once (the
//! step's one wait for the device).

use super::backend::{expect_len, CudaBackend};
use super::device::{CudaDevice, STREAM};
use super::driver::{DevPtr, LaunchConfig};
use super::launch::Args;
use super::storage::{by_dtype, CudaView};
use crate::backend::status::host_loss;
use crate::backend::StepStatus;
use crate::tensor::{DType, View};
use crate::Result;

const OP: &str = "step status";

/// Writes the sum of squares of `v` in f64 to `out` (device memory): partial sums per block
/// in a fixed order set by the length alone, then summed in block order.
pub(crate) fn sum_squares_into(dev: &CudaDevice, v: CudaView<'_>, out: DevPtr) -> Result<()> {
    if v.is_empty() {
        return dev.driver().memset_zero(out, 8, STREAM);
    }
    let blocks = v.len().div_ceil(4096).clamp(1, 1024);
    let partials = dev.alloc(blocks * 8)?;
    let cfg = LaunchConfig::linear(blocks as u32, 256);
    let mut args = Args::new().ptr(v.ptr()).len(v.len()).ptr(partials.ptr());
    dev.launch(by_dtype!("sum_squares", v.dtype()), cfg, &mut args)?;
    let mut args = Args::new()
        .ptr(partials.ptr())
        .len(blocks)
        .ptr(out)
        .ptr(DevPtr::NULL);
    dev.launch(
        "sum_squares_finalize",
        LaunchConfig::linear(1, 32),
        &mut args,
    )
}

impl CudaBackend {
    /// Writes a one-element loss to `to` as f32 (widened exactly from half precision).
    fn loss_into(&self, l: CudaView<'_>, to: DevPtr) -> Result<()> {
        expect_len(OP, "a loss", l.len(), 1)?;
        let name = match l.dtype() {
            DType::F32 => return self.dev.driver().copy_dtod(l.ptr(), to, 4, STREAM),
            DType::Bf16 => "cast_bf16_to_f32",
            DType::F16 => "cast_f16_to_f32",
        };
        let mut args = Args::new().ptr(l.ptr()).ptr(to).len(1);
        self.dev.launch(name, self.dev.grid_for(1), &mut args)
    }

    /// [`crate::backend::OptimizerOps::step_status`]: device values through one block of
    /// `grads.len()` f64 slots then `losses.len()` f32 slots, downloaded once.
    pub(super) fn read_status(
        &self,
        losses: &[View<'_>],
        grads: &[View<'_>],
    ) -> Result<StepStatus> {
        let (ng, nl) = (grads.len(), losses.len());
        let mut st = StepStatus {
            losses: vec![0.0; nl],
            sum_squares: vec![0.0; ng],
        };
        let block = self.dev.alloc(ng * 8 + nl * 4)?;
        let at = |bytes: usize| block.ptr().offset(bytes as u64);
        let mut on_device = false;
        for (i, g) in grads.iter().enumerate() {
            match g {
                // In the kernels' order: the norm's bits do not depend on where the gradient
                // accumulated.
                View::Host(h) => st.sum_squares[i] = super::host_order::sum_squares(*h),
                View::Cuda(_) => {
                    let g = self.dev_in(OP, "a gradient", *g)?;
                    sum_squares_into(&self.dev, g, at(8 * i))?;
                    on_device = true;
                }
            }
        }
        for (i, l) in losses.iter().enumerate() {
            if let Some(v) = host_loss(OP, *l)? {
                st.losses[i] = v;
                continue;
            }
            self.loss_into(self.dev_in(OP, "a loss", *l)?, at(8 * ng + 4 * i))?;
            on_device = true;
        }
        if !on_device {
            return Ok(st);
        }
        let mut bytes = vec![0u8; ng * 8 + nl * 4];
        block.copy_to_host(&mut bytes, STREAM)?;
        let (sums, rest) = bytes.split_at(ng * 8);
        for (i, g) in grads.iter().enumerate() {
            if matches!(g, View::Cuda(_)) {
                st.sum_squares[i] =
                    f64::from_le_bytes(sums[8 * i..8 * i + 8].try_into().unwrap_or_default());
            }
        }
        for (i, l) in losses.iter().enumerate() {
            if matches!(l, View::Cuda(_)) {
                st.losses[i] =
                    f32::from_le_bytes(rest[4 * i..4 * i + 4].try_into().unwrap_or_default());
            }
        }
        Ok(st)
    }
}
