//! The local communicator's arithmetic on device memory. Ranks that share a process each open
//! their own device (driver, allocator, stream), so a rank reads and writes its peers' buffers
//! with explicit copies between devices (`driver::copy_peer`, checked by both owners) and
//! reduces in its own scratch memory with the backend's kernels. Sums have the host
//! communicator's arithmetic bit for bit: `((x0 + x1) + x2) + ...` accumulated in f32
//! (`add_assign_f32`, or `max_assign_f32` for `Max`), divided by the world size for `Avg`
//! (`div_f32`), rounded once to the buffer's dtype by the cast kernels, which round as `half`
//! does.
//!
//! Everything here runs on one stream `s` of the computing rank's device: its compute stream
//! for a lone rank, else the collective stream, ordered by events after and before the ranks'
//! compute streams (`comm/local/device.rs`), so nothing here makes the host wait. Scratch
//! buffers are marked as used on `s`: the allocator reuses them only after `s` passed.

use std::sync::Arc;

use super::device::{CudaDevice, STREAM};
use super::driver::{copy_peer, DevPtr, DeviceBuffer, StreamKind};
use super::launch::Args;
use super::storage::{CudaView, CudaViewMut};
use crate::backend::ReduceOp;
use crate::tensor::DType;
use crate::{Error, Result};

/// Elements reduced per pass: bounds the scratch memory a rank allocates (4 MiB of f32
/// accumulator) whatever the bucket size.
const PIECE: usize = 1 << 20;

/// Copies `src` into `dst` (equal length and dtype; either may belong to another device of
/// this process) on `on`'s stream `s`.
pub(crate) fn copy_between(
    on: &CudaDevice,
    src: CudaView<'_>,
    dst: CudaViewMut<'_>,
    s: StreamKind,
) -> Result<()> {
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
        s,
    )
}

/// Reduces `srcs` (one equal-length run per rank, in rank order) with `op` and writes the
/// result into every run of `dsts`, computing on `on`'s stream `s` (see the module
/// documentation).
pub(crate) fn reduce_runs(
    on: &Arc<CudaDevice>,
    srcs: &[CudaView<'_>],
    dsts: &mut [CudaViewMut<'_>],
    op: ReduceOp,
    s: StreamKind,
) -> Result<()> {
    let Some(first) = srcs.first() else {
        return Ok(());
    };
    let (len, dtype) = (first.len(), first.dtype());
    if len == 0 {
        return Ok(());
    }
    let piece = PIECE.min(len);
    let scratch = |dtype: DType| -> Result<DeviceBuffer> {
        let mut b = on.alloc(piece * dtype.size())?;
        // Reused only after `s` passed the work queued on it by the drop.
        b.record_stream(s);
        Ok(b)
    };
    let acc = scratch(DType::F32)?;
    let stage = scratch(dtype)?;
    let wide = match dtype {
        DType::F32 => None,
        _ => Some(scratch(DType::F32)?),
    };
    if s != STREAM {
        after_compute(on, s)?;
    }
    let own = on.driver();
    // Into `on`'s scratch memory from a view of any rank, or back.
    let fetch = |src: &CudaView<'_>, into: DevPtr, m: usize| {
        let bytes = m * dtype.size();
        copy_peer(
            own,
            (src.device().driver(), src.ptr()),
            (own, into),
            bytes,
            s,
        )
    };
    let mut start = 0;
    while start < len {
        let m = piece.min(len - start);
        let part = start..start + m;
        for (k, src) in srcs.iter().enumerate() {
            let src = src.range(part.clone())?;
            if k == 0 && dtype == DType::F32 {
                fetch(&src, acc.ptr(), m)?;
                continue;
            }
            fetch(&src, stage.ptr(), m)?;
            let operand = match &wide {
                None => stage.ptr(),
                Some(w) => {
                    let into = if k == 0 { acc.ptr() } else { w.ptr() };
                    cast(on, (stage.ptr(), dtype), (into, DType::F32), m, s)?;
                    w.ptr()
                }
            };
            if k > 0 {
                combine(on, acc.ptr(), operand, m, op, s)?;
            }
        }
        if op == ReduceOp::Avg {
            let mut args = Args::new().ptr(acc.ptr()).len(m).f32(srcs.len() as f32);
            on.launch_on("div_f32", on.grid_for(m), &mut args, s)?;
        }
        let out = match dtype {
            DType::F32 => acc.ptr(),
            _ => {
                cast(on, (acc.ptr(), DType::F32), (stage.ptr(), dtype), m, s)?;
                stage.ptr()
            }
        };
        for d in dsts.iter_mut() {
            let d = d.reborrow().range(part.clone())?;
            let bytes = m * dtype.size();
            copy_peer(own, (own, out), (d.device().driver(), d.ptr()), bytes, s)?;
        }
        start += m;
    }
    Ok(())
}

/// Orders `on`'s stream `s` after the work queued on its compute stream so far: the scratch
/// blocks just taken from the allocator may have been freed by compute work still running
/// (the allocator reuses a block freed on its home stream at once).
fn after_compute(on: &CudaDevice, s: StreamKind) -> Result<()> {
    let d = on.driver();
    let e = d.event_create()?;
    let r = d
        .event_record(e, STREAM)
        .and_then(|()| d.stream_wait_event(s, e));
    // A stream already waiting keeps waiting for a destroyed event.
    r.and(d.event_destroy(e))
}

/// `acc[..n] = acc op src` in f32 (`add_assign_f32` for sums, `max_assign_f32` for `Max`).
fn combine(
    on: &CudaDevice,
    acc: DevPtr,
    src: DevPtr,
    n: usize,
    op: ReduceOp,
    s: StreamKind,
) -> Result<()> {
    let name = match op {
        ReduceOp::Sum | ReduceOp::Avg => "add_assign_f32",
        ReduceOp::Max => "max_assign_f32",
    };
    let mut args = Args::new().ptr(acc).ptr(src).len(n);
    on.launch_on(name, on.grid_for(n), &mut args, s)
}

/// `n` elements from `src` to `dst` converted between the two dtypes (round to nearest even).
fn cast(
    on: &CudaDevice,
    src: (DevPtr, DType),
    dst: (DevPtr, DType),
    n: usize,
    s: StreamKind,
) -> Result<()> {
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
    on.launch_on(name, on.grid_for(n), &mut args, s)
}
