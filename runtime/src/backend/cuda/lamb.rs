//! LAMB's two passes on device state (`optim.cu`'s `lamb_moments` and `lamb_apply_*`), bit for
//! bit the CPU's (`ferrozero_offload::optim::lamb_*`): the run's chunks are the CPU's sum
//! blocks, and each chunk's sums are added in the CPU's lane order on the device.
//!
//! Pass 1 waits for the device once per run: its two sums come back to the host, which adds
//! the chunks in order and, in the engine, combines the runs of a tensor across ranks before
//! pass 2 (the price of a trust ratio per tensor; the element-wise optimizers' step waits once).

use ferrozero_offload::optim::{lamb_step_size, LambHyper, SUM_BLOCK};

use super::backend::{expect_dtype, expect_len, CudaBackend};
use super::device::BLOCK;
use super::driver::LaunchConfig;
use super::kernels::params::OptTensor;
use super::launch::Args;
use super::storage::by_dtype;
use crate::backend::{GradView, MemoryOps};
use crate::tensor::{BufMut, DType, View, ViewMut};
use crate::Result;

const OP: &str = "LAMB step";

impl CudaBackend {
    /// Pass 1 over one run on this device: the moments updated, the run's two sums of squares.
    pub(super) fn lamb_moments_run(
        &self,
        hp: &LambHyper,
        grad_scale: f32,
        (params, grads): (View<'_>, GradView<'_>),
        m: ViewMut<'_>,
        v: ViewMut<'_>,
    ) -> Result<(f64, f64)> {
        if params.is_empty() {
            return Ok((0.0, 0.0));
        }
        let p = self.dev_in(OP, "parameters", params)?;
        let g = self.dev_in(OP, "gradients", grads.values)?;
        let g_read = super::optim::grad_read(OP, &g, grads)?;
        let (m, v) = (
            self.dev_out(OP, "first moment", m)?,
            self.dev_out(OP, "second moment", v)?,
        );
        let n = p.len();
        expect_len(OP, "gradients", g.len(), n)?;
        expect_len(OP, "first moment", m.len(), n)?;
        expect_len(OP, "second moment", v.len(), n)?;
        expect_dtype(
            OP,
            DType::F32,
            &[
                ("parameters", p.dtype()),
                ("first moment", m.dtype()),
                ("second moment", v.dtype()),
            ],
        )?;
        let chunks = n.div_ceil(SUM_BLOCK);
        let desc = [OptTensor {
            params: p.ptr().0,
            grads: g.ptr().0,
            m: m.ptr().0,
            v: v.ptr().0,
            lp: 0,
            n: n as i64,
            first_chunk: 0,
            grad_dtype: g_read,
        }];
        let table = self.dev.upload_async(bytemuck::cast_slice(&desc))?;
        let scale = self.dev.upload_async(&grad_scale.to_le_bytes())?;
        // Two f64 per chunk, as f32 pairs for the download.
        let mut sums = self.zeros(DType::F32, 4 * chunks)?;
        let out = self.dev_out(OP, "the chunk sums", sums.view_mut())?;
        let mut args = Args::new()
            .ptr(table.ptr())
            .i32(1)
            .len(chunks)
            .i32(SUM_BLOCK as i32)
            .f32(hp.beta1)
            .f32(hp.beta2)
            .f32(hp.eps)
            .i32(i32::from(hp.eps_inside_sqrt))
            .f32(hp.weight_decay)
            .ptr(scale.ptr())
            .ptr(out.ptr());
        let sms = self.dev.info().multiprocessors.max(1) as usize;
        let cfg = LaunchConfig::linear(chunks.min(8 * sms).max(1) as u32, BLOCK);
        self.dev.launch("lamb_moments", cfg, &mut args)?;
        let mut host = vec![0.0f32; 4 * chunks];
        out.as_view().download(BufMut::F32(&mut host))?;
        if self.sizes_only() {
            return Ok(crate::backend::meta::LAMB_PARTIALS);
        }
        let pairs: &[f64] = bytemuck::cast_slice(&host);
        Ok(pairs
            .chunks_exact(2)
            .fold((0.0, 0.0), |(a, b), s| (a + s[0], b + s[1])))
    }

    /// Pass 2 over one run on this device: `params -= step_size * coeff * u`, the
    /// low-precision copy written in the same pass (an f32 copy after it).
    pub(super) fn lamb_apply_run(
        &self,
        (hp, step, coeff): (&LambHyper, u64, f32),
        params: ViewMut<'_>,
        (m, v): (View<'_>, View<'_>),
        lp: Option<ViewMut<'_>>,
    ) -> Result<()> {
        if params.is_empty() {
            return Ok(());
        }
        let p = self.dev_out(OP, "parameters", params)?;
        let (m, v) = (
            self.dev_in(OP, "first moment", m)?,
            self.dev_in(OP, "second moment", v)?,
        );
        let lp = lp
            .map(|l| self.dev_out(OP, "low-precision copy", l))
            .transpose()?;
        let n = p.len();
        expect_len(OP, "first moment", m.len(), n)?;
        expect_len(OP, "second moment", v.len(), n)?;
        if let Some(l) = &lp {
            expect_len(OP, "low-precision copy", l.len(), n)?;
        }
        let lp_dtype = lp.as_ref().map_or(DType::F32, |l| l.dtype());
        let chunks = n.div_ceil(SUM_BLOCK);
        // The kernel reads no gradient: the parameters stand in, read as f32.
        let desc = [OptTensor {
            params: p.ptr().0,
            grads: p.ptr().0,
            m: m.ptr().0,
            v: v.ptr().0,
            lp: lp.as_ref().map_or(0, |l| l.ptr().0),
            n: n as i64,
            first_chunk: 0,
            grad_dtype: 0,
        }];
        let table = self.dev.upload_async(bytemuck::cast_slice(&desc))?;
        let scale = lamb_step_size(hp, step)? * coeff;
        let mut args = Args::new()
            .ptr(table.ptr())
            .i32(1)
            .len(chunks)
            .i32(SUM_BLOCK as i32)
            .f32(hp.eps)
            .i32(i32::from(hp.eps_inside_sqrt))
            .f32(hp.weight_decay)
            .f32(scale);
        let name = by_dtype!("lamb_apply", lp_dtype);
        let sms = self.dev.info().multiprocessors.max(1) as usize;
        let cfg = LaunchConfig::linear(chunks.min(8 * sms).max(1) as u32, BLOCK);
        self.dev.launch(name, cfg, &mut args)?;
        if let (Some(l), DType::F32) = (lp, lp_dtype) {
            p.as_view().copy_to(l)?;
        }
        Ok(())
    }
}
