//! The data phase of the MPI collectives: blocking MPI calls made directly on the caller's
//! buffers, after [`MpiComm::check_in`] proved that every rank entered the same collective
//! with matching lengths and dtypes. No staging copies and no per-call allocation: what
//! Open MPI's own `MPI_Allreduce` pays is all that is paid, plus, in rank-ordered mode, one
//! scratch buffer per communicator that is reused.
//!
//! Two ways to reduce ([`Reduction`]):
//! - `Native`: f32 `Sum`/`Avg` all-reduces go to `MPI_Allreduce` (MPI's own algorithm and
//!   association order; `Avg` divides the sum afterwards, as `local` does). Reduce-scatters
//!   take the rank-ordered path in both modes: it beat `MPI_Reduce_scatter_block` here.
//! - `RankOrdered`: an all-to-all hands rank r block r of every rank's buffer, rank r folds
//!   the blocks in rank order with `local`'s kernels, and (all-reduce) an all-gather returns
//!   the blocks: bitwise equal to `local` at every world size. `Max` and the 16-bit dtypes
//!   (MPI has no bf16) always take this path.
//!
//! With two ranks both give the same bits: one IEEE addition is commutative.
//!
//! A blocking MPI call cannot time out, so each data phase is armed on the communicator's
//! [`super::watchdog::Watchdog`]: a call that has not returned long after every rank entered
//! it (a peer stopped inside MPI) aborts the job with the collective named, rather than hang.

use std::ffi::c_void;
use std::os::raw::c_int;

use bytemuck::Pod;
use mpi::ffi;
use mpi::raw::AsRaw;

use super::MpiComm;
use crate::comm::local::desc::OpKind;
use crate::comm::local::kernels::{finish, reduce_range, Elem};
use crate::comm::{ReduceOp, Reduction};
use crate::{Error, Result};

/// Most elements one all-reduce call moves; longer buffers go in pieces (MPI counts and
/// displacements are C ints).
const PIECE: usize = 1 << 30;

/// An element type, its MPI datatype (bf16/f16 travel as 16-bit words).
pub(crate) trait Wire: Elem + Pod {
    /// The MPI datatype of one element.
    fn datatype() -> ffi::MPI_Datatype;
}

impl Wire for f32 {
    fn datatype() -> ffi::MPI_Datatype {
        // SAFETY: a predefined handle, valid while MPI is initialized (it is: a communicator
        // exists).
        unsafe { ffi::RSMPI_FLOAT }
    }
}
impl Wire for half::bf16 {
    fn datatype() -> ffi::MPI_Datatype {
        // SAFETY: as for f32.
        unsafe { ffi::RSMPI_UINT16_T }
    }
}
impl Wire for half::f16 {
    fn datatype() -> ffi::MPI_Datatype {
        // SAFETY: as for f32.
        unsafe { ffi::RSMPI_UINT16_T }
    }
}

/// Whether `T` is f32 (the only type MPI reduces natively here).
fn is_f32<T: 'static>() -> bool {
    std::any::TypeId::of::<T>() == std::any::TypeId::of::<f32>()
}

/// The scratch area's smallest size (32 MiB, glibc's largest mmap threshold): the scratch is
/// always a mapping of its own, which the kernel aligns to huge pages and which is advised
/// to use them before its first touch, never a piece of the heap whose pages are whatever
/// the heap held. Shared-memory transfers into it walk its pages, so this decides their
/// speed: a 2-process 1 MiB reduce-scatter after the native all-reduce series ran at
/// 1.7 GB/s bus bandwidth with an 8 MiB scratch (served from the heap once earlier large
/// buffers had raised glibc's threshold) and 4.3 GB/s with 32 MiB. Untouched pages cost
/// nothing, so the size is address space, not memory.
const SCRATCH_MIN_WORDS: usize = 1 << 22;

impl MpiComm {
    /// An MPI error code as this crate's error (the default handler aborts before, so this
    /// is reached only where a library returns errors).
    fn mpi_rc(&self, op: OpKind, call: &str, rc: c_int) -> Result<()> {
        if rc == 0 {
            return Ok(());
        }
        let reason = format!("{call} returned MPI error {rc}");
        self.break_with(&reason);
        Err(Error::Comm {
            op: op.name(),
            rank: self.rank,
            peer: None,
            elapsed: std::time::Duration::ZERO,
            reason,
        })
    }

    /// Converts a count to a C int, or fails with the collective named.
    fn count(&self, op: OpKind, n: usize) -> Result<c_int> {
        c_int::try_from(n).map_err(|_| Error::Comm {
            op: op.name(),
            rank: self.rank,
            peer: None,
            elapsed: std::time::Duration::ZERO,
            reason: format!(
                "{n} elements per rank exceed what one MPI call can address ({}); split the buffer",
                c_int::MAX
            ),
        })
    }

    /// Runs one blocking MPI call under the watchdog.
    fn guarded(&self, op: OpKind, call: &str, f: impl FnOnce() -> c_int) -> Result<()> {
        let _armed = self.watchdog().arm(op.name());
        let rc = f();
        self.mpi_rc(op, call, rc)
    }

    /// A scratch area of at least `elems` elements of `T`, reused across calls.
    fn with_scratch<T: Pod, R>(&self, elems: usize, f: impl FnOnce(&mut [T]) -> R) -> R {
        let mut s = self.scratch.borrow_mut();
        let words = (elems * std::mem::size_of::<T>()).div_ceil(8);
        if s.len() < words {
            let n = words.max(SCRATCH_MIN_WORDS);
            // Zeroed memory this large is a fresh mapping that nothing has touched yet.
            let v = vec![0u64; n];
            ferrozero_offload::huge::advise_huge_pages(v.as_ptr().cast(), n * 8);
            *s = v;
        }
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut s[..words]);
        f(bytemuck::cast_slice_mut(
            &mut bytes[..elems * std::mem::size_of::<T>()],
        ))
    }

    /// Whether this call reduces through MPI's own operator.
    fn native<T: 'static>(&self, op: ReduceOp) -> bool {
        self.reduction == Reduction::Native
            && is_f32::<T>()
            && matches!(op, ReduceOp::Sum | ReduceOp::Avg)
    }

    pub(super) fn all_reduce_data<T: Wire>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        if self.size == 1 || buf.is_empty() {
            // One rank: the sum is the value (and `Avg` divides by one).
            return Ok(());
        }
        for piece in buf.chunks_mut(PIECE) {
            if self.native::<T>(op) {
                self.native_all_reduce(piece, op)?;
            } else {
                self.ordered_all_reduce(piece, op)?;
            }
        }
        Ok(())
    }

    fn native_all_reduce<T: Wire>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let (kind, n) = (OpKind::AllReduce, self.count(OpKind::AllReduce, buf.len())?);
        let comm = self.comm.as_raw();
        match self.env.in_place {
            Some(in_place) => self.guarded(kind, "MPI_Allreduce", || {
                // SAFETY: `buf` holds `n` elements of the datatype and is exclusively ours for
                // the call; MPI_IN_PLACE is this library's sentinel.
                unsafe {
                    ffi::MPI_Allreduce(
                        in_place as *const c_void,
                        buf.as_mut_ptr().cast(),
                        n,
                        T::datatype(),
                        ffi::RSMPI_SUM,
                        comm,
                    )
                }
            })?,
            // A library whose MPI_IN_PLACE is not known: reduce into scratch, copy back.
            None => self.with_scratch::<T, Result<()>>(buf.len(), |out| {
                self.guarded(kind, "MPI_Allreduce", || {
                    // SAFETY: both buffers hold `n` elements and are ours for the call.
                    unsafe {
                        ffi::MPI_Allreduce(
                            buf.as_ptr().cast(),
                            out.as_mut_ptr().cast(),
                            n,
                            T::datatype(),
                            ffi::RSMPI_SUM,
                            comm,
                        )
                    }
                })?;
                buf.copy_from_slice(out);
                Ok(())
            })?,
        }
        average(buf, op, self.size);
        Ok(())
    }

    /// Rank `k`'s block of a buffer of `len` elements: `(start, count)`.
    fn block(&self, len: usize, k: usize) -> (usize, usize) {
        let b = len.div_ceil(self.size);
        let start = (k * b).min(len);
        (start, (start + b).min(len) - start)
    }

    fn ordered_all_reduce<T: Wire>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let kind = OpKind::AllReduce;
        let n = self.size;
        let blocks: Vec<(usize, usize)> = (0..n).map(|k| self.block(buf.len(), k)).collect();
        let counts = blocks
            .iter()
            .map(|b| self.count(kind, b.1))
            .collect::<Result<Vec<c_int>>>()?;
        let displs = blocks
            .iter()
            .map(|b| self.count(kind, b.0))
            .collect::<Result<Vec<c_int>>>()?;
        let mine = blocks[self.rank].1;
        let mine_c = counts[self.rank];
        let recv_counts = vec![mine_c; n];
        let recv_displs = (0..n)
            .map(|k| self.count(kind, k * mine))
            .collect::<Result<Vec<c_int>>>()?;
        let comm = self.comm.as_raw();
        // Scratch: every rank's copy of my block, then my reduced block.
        self.with_scratch::<T, Result<()>>(mine * (n + 1), |scratch| {
            let (gathered, reduced) = scratch.split_at_mut(mine * n);
            self.guarded(kind, "MPI_Alltoallv", || {
                // SAFETY: counts and displacements describe ranges inside `buf` (send) and
                // `gathered` (receive); both are ours for the call.
                unsafe {
                    ffi::MPI_Alltoallv(
                        buf.as_ptr().cast(),
                        counts.as_ptr(),
                        displs.as_ptr(),
                        T::datatype(),
                        gathered.as_mut_ptr().cast(),
                        recv_counts.as_ptr(),
                        recv_displs.as_ptr(),
                        T::datatype(),
                        comm,
                    )
                }
            })?;
            fold_blocks(gathered, mine, n, reduced, op);
            self.guarded(kind, "MPI_Allgatherv", || {
                // SAFETY: `reduced` holds my `mine` elements; `buf` receives every rank's
                // block at its displacement.
                unsafe {
                    ffi::MPI_Allgatherv(
                        reduced.as_ptr().cast(),
                        mine_c,
                        T::datatype(),
                        buf.as_mut_ptr().cast(),
                        counts.as_ptr(),
                        displs.as_ptr(),
                        T::datatype(),
                        comm,
                    )
                }
            })
        })
    }

    pub(super) fn reduce_scatter_data<T: Wire>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let kind = OpKind::ReduceScatter;
        let m = output.len();
        if m == 0 {
            return Ok(());
        }
        if self.size == 1 {
            output.copy_from_slice(&input[..m]);
            return Ok(());
        }
        let mc = self.count(kind, m)?;
        let comm = self.comm.as_raw();
        // Native or not, the reduce-scatter is an all-to-all plus a rank-ordered fold:
        // measured faster than Open MPI's MPI_Reduce_scatter_block at every size from 1 to
        // 256 MiB at 2 and 4 processes (bench/mpi_side_by_side.sh: 0.29-0.95x its time), and
        // it is bitwise equal to `local` on top.
        let n = self.size;
        self.with_scratch::<T, Result<()>>(m * n, |gathered| {
            self.guarded(kind, "MPI_Alltoall", || {
                // SAFETY: `input` holds n blocks of m elements, `gathered` receives n blocks.
                unsafe {
                    ffi::MPI_Alltoall(
                        input.as_ptr().cast(),
                        mc,
                        T::datatype(),
                        gathered.as_mut_ptr().cast(),
                        mc,
                        T::datatype(),
                        comm,
                    )
                }
            })?;
            fold_blocks(gathered, m, n, output, op);
            Ok(())
        })
    }

    pub(super) fn all_to_all_data<T: Wire>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        let m = input.len() / self.size.max(1);
        let call = (OpKind::AllToAll, "MPI_Alltoall", BlocksFn::AllToAll);
        self.equal_blocks(call, input, m, output)
    }

    pub(super) fn all_gather_data<T: Wire>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        let call = (OpKind::AllGather, "MPI_Allgather", BlocksFn::AllGather);
        self.equal_blocks(call, input, input.len(), output)
    }

    /// `MPI_Allgather` or `MPI_Alltoall` (one signature: blocks of `m` elements to and from
    /// every rank); one rank copies, empty blocks move nothing.
    fn equal_blocks<T: Wire>(
        &self,
        (kind, name, f): (OpKind, &'static str, BlocksFn),
        input: &[T],
        m: usize,
        output: &mut [T],
    ) -> Result<()> {
        if m == 0 {
            return Ok(());
        }
        if self.size == 1 {
            output.copy_from_slice(input);
            return Ok(());
        }
        let mc = self.count(kind, m)?;
        let comm = self.comm.as_raw();
        let f = match f {
            BlocksFn::AllGather => ffi::MPI_Allgather,
            BlocksFn::AllToAll => ffi::MPI_Alltoall,
        };
        self.guarded(kind, name, || {
            // SAFETY: `output` holds size × m elements and `input` m (all-gather) or size × m
            // (all-to-all), as checked in on every rank; both ours for the call.
            unsafe {
                f(
                    input.as_ptr().cast(),
                    mc,
                    T::datatype(),
                    output.as_mut_ptr().cast(),
                    mc,
                    T::datatype(),
                    comm,
                )
            }
        })
    }

    pub(super) fn broadcast_data<T: Wire>(&self, buf: &mut [T], root: usize) -> Result<()> {
        let kind = OpKind::Broadcast;
        if self.size == 1 {
            return Ok(());
        }
        let root = self.count(kind, root)?;
        let comm = self.comm.as_raw();
        for piece in buf.chunks_mut(PIECE) {
            let n = self.count(kind, piece.len())?;
            self.guarded(kind, "MPI_Bcast", || {
                // SAFETY: `piece` holds n elements and is ours for the call.
                unsafe { ffi::MPI_Bcast(piece.as_mut_ptr().cast(), n, T::datatype(), root, comm) }
            })?;
        }
        Ok(())
    }
}

/// `Avg` after a native sum: the division `local` applies, element by element.
fn average<T: Wire>(buf: &mut [T], op: ReduceOp, world: usize) {
    if op != ReduceOp::Avg {
        return;
    }
    let mut acc = [0f32; crate::comm::local::kernels::BLOCK];
    for piece in buf.chunks_mut(acc.len()) {
        let a = &mut acc[..piece.len()];
        T::load(piece, a);
        finish(a, op, world);
        T::store(a, piece);
    }
}

/// Folds `n` consecutive blocks of `m` elements of `blocks` in rank order into `out`.
fn fold_blocks<T: Wire>(blocks: &[T], m: usize, n: usize, out: &mut [T], op: ReduceOp) {
    if m == 0 {
        return;
    }
    let srcs: Vec<*const T> = blocks[..m * n].chunks_exact(m).map(<[T]>::as_ptr).collect();
    // SAFETY: `n` source blocks of `m` readable elements; `out` holds `m` elements and is
    // exclusively borrowed, distinct from `blocks`.
    unsafe { reduce_range(&srcs, &[out.as_mut_ptr()], 0, m, op) };
}

/// The MPI collectives of equal blocks [`MpiComm::equal_blocks`] calls.
#[derive(Clone, Copy)]
enum BlocksFn {
    /// `MPI_Allgather`.
    AllGather,
    /// `MPI_Alltoall`.
    AllToAll,
}
