//! The step's status on the device: each gradient range's sum of squares finalized into a
//! slot of one small block, the losses copied beside them, and the block downloaded once (the
//! step's one wait for the device).

use super::backend::{expect_len, CudaBackend};
use super::device::{CudaDevice, STREAM};
use super::driver::{DevPtr, DeviceBuffer, LaunchConfig};
use super::launch::Args;
use super::storage::{by_dtype, CudaView};
use crate::backend::status::host_loss;
use crate::backend::{GradView, StepStatus};
use crate::tensor::{DType, View};
use crate::Result;

const OP: &str = "step status";

/// Writes the sum of squares of `v` in f64 to `out` (device memory): partial sums per block
/// in a fixed order set by the length alone, then summed in block order.
pub(crate) fn sum_squares_into(dev: &CudaDevice, v: CudaView<'_>, out: DevPtr) -> Result<()> {
    sum_squares_as_into(dev, v, None, out)
}

/// [`sum_squares_into`] of `v`'s values as an accumulator of `round` holds them (f32 values
/// rounded; `crate::backend::GradView`), in that accumulator's order.
fn sum_squares_as_into(
    dev: &CudaDevice,
    v: CudaView<'_>,
    round: Option<DType>,
    out: DevPtr,
) -> Result<()> {
    if v.is_empty() {
        return dev.driver().memset_zero(out, 8, STREAM);
    }
    let blocks = v.len().div_ceil(4096).clamp(1, 1024);
    let partials = dev.alloc(blocks * 8)?;
    let cfg = LaunchConfig::linear(blocks as u32, 256);
    let mut args = Args::new().ptr(v.ptr()).len(v.len()).ptr(partials.ptr());
    let name = match (v.dtype(), round) {
        (DType::F32, Some(DType::Bf16)) => "sum_squares_f32_as_bf16",
        (DType::F32, Some(DType::F16)) => "sum_squares_f32_as_f16",
        // Squares ignore the sign of a zero: values in their own dtype read as stored.
        (d, _) => by_dtype!("sum_squares", d),
    };
    dev.launch(name, cfg, &mut args)?;
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
        grads: &[GradView<'_>],
    ) -> Result<StepStatus> {
        let st = self.status_block(losses, grads, 0)?.read()?.0;
        // A size-only device read back zeros: its status is the size-only backend's.
        Ok(match self.sizes_only() {
            true => crate::backend::meta::status(losses, grads),
            false => st,
        })
    }

    /// Starts the status of `losses` and `grads` (host views are read at once) in one block
    /// with `tail` more bytes after the losses for the caller's own results.
    pub(super) fn status_block(
        &self,
        losses: &[View<'_>],
        grads: &[GradView<'_>],
        tail: usize,
    ) -> Result<StatusBlock> {
        let (ng, nl) = (grads.len(), losses.len());
        let mut st = StepStatus {
            losses: vec![0.0; nl],
            sum_squares: vec![0.0; ng],
            grad_scale: None,
        };
        let block = self.dev.alloc(ng * 8 + nl * 4 + tail)?;
        let at = |bytes: usize| block.ptr().offset(bytes as u64);
        let mut on_device = tail > 0;
        let mut device_grads = vec![false; ng];
        for (i, g) in grads.iter().enumerate() {
            let round = g.checked_round(OP)?;
            match g.values {
                // In the kernels' order: the norm's bits do not depend on where the gradient
                // accumulated.
                View::Host(h) => {
                    st.sum_squares[i] = match round {
                        Some(d) => super::host_order::sum_squares_as(h, d),
                        None => super::host_order::sum_squares(h),
                    }
                }
                // A size-only host's gradient: its slot is the size-only status's.
                View::Meta(_) if self.sizes_only() => {}
                View::Cuda(_) | View::Meta(_) => {
                    let v = self.dev_in(OP, "a gradient", g.values)?;
                    sum_squares_as_into(&self.dev, v, round, at(8 * i))?;
                    (on_device, device_grads[i]) = (true, true);
                }
            }
        }
        let mut device_losses = vec![false; nl];
        for (i, l) in losses.iter().enumerate() {
            if let Some(v) = host_loss(OP, *l)? {
                st.losses[i] = v;
                continue;
            }
            self.loss_into(self.dev_in(OP, "a loss", *l)?, at(8 * ng + 4 * i))?;
            (on_device, device_losses[i]) = (true, true);
        }
        Ok(StatusBlock {
            block,
            st,
            on_device,
            device_grads,
            device_losses,
            tail,
        })
    }
}

/// A step's status on its way: the block on the device, what was read on the host.
pub(super) struct StatusBlock {
    block: DeviceBuffer,
    st: StepStatus,
    on_device: bool,
    device_grads: Vec<bool>,
    device_losses: Vec<bool>,
    tail: usize,
}

impl StatusBlock {
    /// The gradients' f64 sums of squares, in order (host views' slots are not written).
    pub(super) fn sums(&self) -> DevPtr {
        self.block.ptr()
    }

    /// The caller's bytes after the losses.
    pub(super) fn tail(&self) -> DevPtr {
        let at = self.st.sum_squares.len() * 8 + self.st.losses.len() * 4;
        self.block.ptr().offset(at as u64)
    }

    /// The one download (when anything is on the device): the status and the tail's bytes.
    pub(super) fn read(self) -> Result<(StepStatus, Vec<u8>)> {
        let StatusBlock { block, mut st, .. } = self;
        let (ng, nl) = (st.sum_squares.len(), st.losses.len());
        if !self.on_device {
            return Ok((st, Vec::new()));
        }
        let mut bytes = vec![0u8; ng * 8 + nl * 4 + self.tail];
        block.copy_to_host(&mut bytes, STREAM)?;
        let (sums, rest) = bytes.split_at(ng * 8);
        let (losses, tail) = rest.split_at(nl * 4);
        let word = |b: &[u8], i: usize, w: usize| b[w * i..w * i + w].to_vec();
        for i in (0..ng).filter(|&i| self.device_grads[i]) {
            let b: [u8; 8] = word(sums, i, 8).try_into().unwrap_or_default();
            st.sum_squares[i] = f64::from_le_bytes(b);
        }
        for i in (0..nl).filter(|&i| self.device_losses[i]) {
            let b: [u8; 4] = word(losses, i, 4).try_into().unwrap_or_default();
            st.losses[i] = f32::from_le_bytes(b);
        }
        Ok((st, tail.to_vec()))
    }
}
