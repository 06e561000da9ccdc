//! The device forms of the local collectives in a build without CUDA memory: no device view
//! can exist, so none of these can be reached (their views are uninhabited).

use super::desc::Desc;
use super::LocalComm;
use crate::backend::cuda::CudaView;
use crate::comm::ReduceOp;
use crate::tensor::DType;
use crate::Result;

/// Address, dtype, length and device handle of a device view.
pub(super) fn parts(v: &CudaView<'_>) -> (usize, DType, usize, usize) {
    v.absurd()
}

/// Device buffers are announced only through [`parts`], which cannot run in this build.
fn unreachable_without_cuda() -> Result<()> {
    Err(crate::Error::Invalid(
        "device buffers in a build without the `cuda` feature".into(),
    ))
}

/// All-reduce of device buffers.
pub(super) fn all_reduce(_: &LocalComm, _: Desc, _: ReduceOp) -> Result<()> {
    unreachable_without_cuda()
}

/// Reduce-scatter of device buffers.
pub(super) fn reduce_scatter(_: &LocalComm, _: Desc, _: ReduceOp) -> Result<()> {
    unreachable_without_cuda()
}

/// All-gather of device buffers.
pub(super) fn all_gather(_: &LocalComm, _: Desc) -> Result<()> {
    unreachable_without_cuda()
}

/// Broadcast of device buffers.
pub(super) fn broadcast(_: &LocalComm, _: Desc) -> Result<()> {
    unreachable_without_cuda()
}
