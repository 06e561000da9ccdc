//! The local communicator's arithmetic on device memory. Ranks that share a process each open
//! their own device (driver, allocator, stream), so a rank reads and writes its peers' buffers
//! with explicit copies between devices (`driver::copy_peer`, checked by both owners) and
//! reduces in its own scratch memory with the backend's kernels. Sums have the host
//! communicator's arithmetic bit for bit: `((x0 + x1) + x2) + ...` accumulated in f32
//! (`add_assign_f32`, or `max_assign_f32` for `Max`), divided by the world size for `Avg`
//! (`div_f32`), rounded once to the buffer's dtype by the cast kernels, which round as `half`
//! does.

use std::sync::Arc;

use super::device::{CudaDevice, STREAM};
use super::driver::{copy_peer, DevPtr};
use super::launch::Args;
use super::storage::{CudaBuf, CudaView, CudaViewMut};
use crate::comm::ReduceOp;
use crate::tensor::DType;
use crate::{Error, Result};

/// Elements reduced per pass: bounds the scratch memory a rank allocates (4 MiB of f32
/// accumulator) whatever the bucket size.
const PIECE: usize = 1 << 20;

/// Copies `src` into `dst` (equal length and dtype; either may belong to another device of
/// this process) on `on`'s compute stream.
pub(crate) fn copy_between(on: &CudaDevice, src: CudaView<'_>, dst: CudaViewMut<'_>) -> Result<()> {
    if src.len() != dst.len() || src.dtype() != dst.dtype() {
        return Err(Error::Shape {
            op: "device copy between ranks",
            expected: format!("{} {:?} elements", src.len(), src.dtype()),
            got: format!("{} {:?}", dst.len(), dst.dtype()),
        });
    }
    let bytes = src.len() * src.dtype().size();
    copy_peer(
        on.driver(),
        (src.device().driver(), src.ptr()),
        (dst.device().driver(), dst.ptr()),
        bytes,
        STREAM,
    )
}

/// Reduces `srcs` (one equal-length run per rank, in rank order) with `op` and writes the
/// result into every run of `dsts`, computing on `on` (see the module documentation).
pub(crate) fn reduce_runs(
    on: &Arc<CudaDevice>,
    srcs: &[CudaView<'_>],
    dsts: &mut [CudaViewMut<'_>],
    op: ReduceOp,
) -> Result<()> {
    let Some(first) = srcs.first() else {
        return Ok(());
    };
    let (len, dtype) = (first.len(), first.dtype());
    if len == 0 {
        return Ok(());
    }
    let piece = PIECE.min(len);
    let mut acc = CudaBuf::uninit(on, DType::F32, piece)?;
    let mut stage = CudaBuf::uninit(on, dtype, piece)?;
    let wide = match dtype {
        DType::F32 => None,
        _ => Some(CudaBuf::uninit(on, DType::F32, piece)?),
    };
    let mut start = 0;
    while start < len {
        let m = piece.min(len - start);
        let part = start..start + m;
        for (k, src) in srcs.iter().enumerate() {
            let src = src.range(part.clone())?;
            if k == 0 && dtype == DType::F32 {
                copy_between(on, src, acc.view_mut().range(0..m)?)?;
                continue;
            }
            copy_between(on, src, stage.view_mut().range(0..m)?)?;
            let operand = match &wide {
                None => stage.view().ptr(),
                Some(w) => {
                    let into = if k == 0 {
                        acc.view().ptr()
                    } else {
                        w.view().ptr()
                    };
                    cast(on, (stage.view().ptr(), dtype), (into, DType::F32), m)?;
                    w.view().ptr()
                }
            };
            if k > 0 {
                combine(on, acc.view().ptr(), operand, m, op)?;
            }
        }
        if op == ReduceOp::Avg {
            let mut args = Args::new()
                .ptr(acc.view().ptr())
                .len(m)
                .f32(srcs.len() as f32);
            on.launch("div_f32", on.grid_for(m), &mut args)?;
        }
        let out = match dtype {
            DType::F32 => acc.view().range(0..m)?,
            _ => {
                cast(
                    on,
                    (acc.view().ptr(), DType::F32),
                    (stage.view().ptr(), dtype),
                    m,
                )?;
                stage.view().range(0..m)?
            }
        };
        for d in dsts.iter_mut() {
            copy_between(on, out, d.reborrow().range(part.clone())?)?;
        }
        start += m;
    }
    // The scratch buffers go back to the allocator on drop; wait for the copies out of them.
    on.synchronize()
}

/// `acc[..n] = acc op src` in f32 (`add_assign_f32` for sums, `max_assign_f32` for `Max`).
fn combine(on: &CudaDevice, acc: DevPtr, src: DevPtr, n: usize, op: ReduceOp) -> Result<()> {
    let name = match op {
        ReduceOp::Sum | ReduceOp::Avg => "add_assign_f32",
        ReduceOp::Max => "max_assign_f32",
    };
    let mut args = Args::new().ptr(acc).ptr(src).len(n);
    on.launch(name, on.grid_for(n), &mut args)
}

/// `n` elements from `src` to `dst` converted between the two dtypes (round to nearest even).
fn cast(on: &CudaDevice, src: (DevPtr, DType), dst: (DevPtr, DType), n: usize) -> Result<()> {
    let name = match (src.1, dst.1) {
        (DType::F32, DType::Bf16) => "cast_f32_to_bf16",
        (DType::F32, DType::F16) => "cast_f32_to_f16",
        (DType::Bf16, DType::F32) => "cast_bf16_to_f32",
        (DType::F16, DType::F32) => "cast_f16_to_f32",
        (a, b) => {
            return Err(Error::Invalid(format!(
                "device reduction: no cast from {a:?} to {b:?} (one side is f32)"
            )))
        }
    };
    let mut args = Args::new().ptr(src.0).ptr(dst.0).len(n);
    on.launch(name, on.grid_for(n), &mut args)
}
