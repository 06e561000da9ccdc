//! Deterministic reductions over NCCL (`comms.reduction = "rank_ordered"`): an all-to-all brings every
//! rank's chunk `r` to rank `r`, which sums the chunks in rank order with the local
//! communicator's kernel (f32 accumulation, one rounding), so results are bitwise those of
//! the local communicator whatever NCCL's ring or tree order would have been.

use half::{bf16, f16};

use super::{NcclComm, NcclOp};
use crate::comm::local::kernels::{reduce_range, Elem};
use crate::comm::{BufMut, BufRef, Communicator, ReduceOp};
use crate::tensor::{FlatBuf, View, ViewMut};
use crate::{Error, Result};

/// Rank-ordered reduce-scatter: all-to-all, then the ordered sum of the received chunks.
pub(super) fn reduce_scatter(
    c: &NcclComm,
    input: BufRef<'_>,
    output: BufMut<'_>,
    op: ReduceOp,
) -> Result<()> {
    let world = c.world_size();
    let mut recv = FlatBuf::zeros(input.dtype(), output.len() * world);
    c.run(NcclOp::AllToAll {
        input: View::Host(input),
        output: ViewMut::Host(recv.as_mut()),
    })?;
    ordered_sum(recv.as_ref(), output, world, op)
}

/// Rank-ordered all-reduce: a deterministic reduce-scatter of the buffer padded to a
/// multiple of the world size, then an all-gather.
pub(super) fn all_reduce(c: &NcclComm, buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
    let world = c.world_size();
    let len = buf.len();
    let chunk = len.div_ceil(world);
    let mut padded = FlatBuf::zeros(buf.dtype(), chunk * world);
    copy(buf.as_ref(), padded.as_mut_range(0..len))?;
    let mut mine = FlatBuf::zeros(buf.dtype(), chunk);
    reduce_scatter(c, padded.as_ref(), mine.as_mut(), op)?;
    c.run(NcclOp::AllGather {
        input: View::Host(mine.as_ref()),
        output: ViewMut::Host(padded.as_mut()),
    })?;
    copy(padded.as_ref_range(0..len), buf)
}

/// `out[i] = recv[0][i] op recv[1][i] op ...` over the `world` equal chunks of `recv`.
fn ordered_sum(recv: BufRef<'_>, out: BufMut<'_>, world: usize, op: ReduceOp) -> Result<()> {
    match (recv, out) {
        (BufRef::F32(r), BufMut::F32(o)) => sum_chunks(r, o, world, op),
        (BufRef::Bf16(r), BufMut::Bf16(o)) => sum_chunks::<bf16>(r, o, world, op),
        (BufRef::F16(r), BufMut::F16(o)) => sum_chunks::<f16>(r, o, world, op),
        (r, o) => return Err(dtype_mismatch(r, &o)),
    }
    Ok(())
}

fn sum_chunks<T: Elem>(recv: &[T], out: &mut [T], world: usize, op: ReduceOp) {
    let n = out.len();
    let srcs: Vec<*const T> = (0..world).map(|k| recv[k * n..].as_ptr()).collect();
    let dsts = [out.as_mut_ptr()];
    // SAFETY: `recv` holds `world` chunks of `n` elements and `out` has `n`; both are
    // borrowed for the call, so nothing else touches them.
    unsafe { reduce_range(&srcs, &dsts, 0, n, op) }
}

/// Copies between host buffers of one dtype and length.
pub(super) fn copy(src: BufRef<'_>, dst: BufMut<'_>) -> Result<()> {
    if src.len() != dst.len() {
        return Err(Error::Invalid(format!(
            "copy of {} elements into {}",
            src.len(),
            dst.len()
        )));
    }
    match (src, dst) {
        (BufRef::F32(s), BufMut::F32(d)) => d.copy_from_slice(s),
        (BufRef::Bf16(s), BufMut::Bf16(d)) => d.copy_from_slice(s),
        (BufRef::F16(s), BufMut::F16(d)) => d.copy_from_slice(s),
        (s, d) => return Err(dtype_mismatch(s, &d)),
    }
    Ok(())
}

fn dtype_mismatch(a: BufRef<'_>, b: &BufMut<'_>) -> Error {
    Error::Invalid(format!(
        "collective input is {:?} but output is {:?}",
        a.dtype(),
        b.dtype()
    ))
}
