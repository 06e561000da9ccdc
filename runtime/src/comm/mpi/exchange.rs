//! The MPI data movement: descriptor check-in, nonblocking calls polled against the deadline,
//! and the rank-ordered reductions built from all-to-all and all-gather.

use std::time::{Duration, Instant};

use bytemuck::{cast_slice, cast_slice_mut, Pod, Zeroable};
use half::{bf16, f16};
use mpi::collective::CommunicatorCollectives;
use mpi::datatype::Equivalence;
use mpi::request::{Request, StaticScope};
use mpi::traits::Communicator as _;
use mpi::traits::Root;

use super::MpiComm;
use crate::comm::local::desc::{verify, OpKind};
use crate::comm::local::kernels::{reduce_range, Elem};
use crate::comm::{BufMut, BufRef, Communicator, ReduceOp};
use crate::tensor::DType;
use crate::Result;

pub(super) use crate::comm::local::desc::Desc;

/// An element type and the MPI type it travels as (bf16/f16 as raw 16-bit words).
pub(crate) trait Wire: Elem + Pod {
    /// The MPI-side type of the same size.
    type W: Equivalence + Pod + 'static;
}
impl Wire for f32 {
    type W = f32;
}
impl Wire for bf16 {
    type W = u16;
}
impl Wire for f16 {
    type W = u16;
}

const DESC_WORDS: usize = 9;

impl Desc {
    /// The descriptor of a split.
    pub(super) fn split(color: usize, key: usize) -> Desc {
        let mut d = Desc::bare(0, OpKind::Split);
        (d.root, d.key) = (color, key);
        d
    }
}

fn dtype_code(d: DType) -> u64 {
    match d {
        DType::F32 => 0,
        DType::Bf16 => 1,
        DType::F16 => 2,
    }
}

fn code_dtype(c: u64) -> DType {
    match c {
        1 => DType::Bf16,
        2 => DType::F16,
        _ => DType::F32,
    }
}

const OPS: [OpKind; 7] = [
    OpKind::AllReduce,
    OpKind::ReduceScatter,
    OpKind::AllGather,
    OpKind::Broadcast,
    OpKind::Barrier,
    OpKind::Duplicate,
    OpKind::Split,
];
const REDUCES: [ReduceOp; 3] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max];

fn encode(d: &Desc) -> [u64; DESC_WORDS] {
    let op = OPS.iter().position(|o| *o == d.op).unwrap_or(0) as u64;
    let reduce = d
        .reduce
        .and_then(|r| REDUCES.iter().position(|x| *x == r))
        .map_or(0, |i| i as u64 + 1);
    [
        d.seq,
        op,
        reduce,
        dtype_code(d.dtype),
        d.len_in as u64,
        dtype_code(d.dtype_out),
        d.len_out as u64,
        d.root as u64,
        d.key as u64,
    ]
}

fn decode(w: &[u64]) -> Desc {
    let mut d = Desc::bare(w[0], OPS[(w[1] as usize).min(OPS.len() - 1)]);
    d.reduce = (w[2] as usize)
        .checked_sub(1)
        .and_then(|i| REDUCES.get(i).copied());
    d.dtype = code_dtype(w[3]);
    d.len_in = w[4] as usize;
    d.dtype_out = code_dtype(w[5]);
    d.len_out = w[6] as usize;
    d.root = w[7] as usize;
    d.key = w[8] as usize;
    d
}

/// Moves `v` to the heap for MPI; it is freed only after its request completed.
fn lease<T>(v: Vec<T>) -> &'static mut [T] {
    Box::leak(v.into_boxed_slice())
}

/// Takes back a leased buffer.
///
/// # Safety
/// `p` must come from [`lease`] and no request may still use it.
unsafe fn reclaim<T>(p: *mut [T]) -> Vec<T> {
    // SAFETY: per the contract, `p` is a leaked box no one else uses.
    unsafe { Box::from_raw(p) }.into_vec()
}

impl MpiComm {
    /// Polls `req` until it completes or the collective's deadline passes. On timeout the
    /// request is forgotten (its buffers stay leased forever) and the communicator breaks.
    fn complete<D: ?Sized>(
        &self,
        op: OpKind,
        start: Instant,
        mut req: Request<'static, D, StaticScope>,
    ) -> Result<()> {
        // Open MPI's nonblocking collectives advance only inside MPI calls, so the request
        // is tested continuously (yielding the core between tests) and only a long wait
        // falls back to short sleeps.
        let patient = Duration::from_millis(200);
        let waiting = Instant::now();
        loop {
            match req.test() {
                Ok(_) => return Ok(()),
                Err(r) => req = r,
            }
            let now = Instant::now();
            if now.duration_since(start) >= self.timeout {
                std::mem::forget(req);
                let reason = format!(
                    "no progress within {:?}: a peer died, stopped answering or called fewer \
                     collectives",
                    self.timeout
                );
                self.break_with(&reason);
                return Err(self.error(op.name(), None, start, reason));
            }
            if now.duration_since(waiting) < patient {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(200));
            }
        }
    }

    /// Entry of every collective: all-gathers the descriptors and checks them.
    pub(super) fn check_in(&self, mut desc: Desc, start: Instant) -> Result<()> {
        if let Some(reason) = self.broken.borrow().clone() {
            return Err(self.error(
                desc.op.name(),
                None,
                start,
                format!("communicator broken earlier: {reason}"),
            ));
        }
        desc.seq = self.seq.get();
        self.seq.set(desc.seq + 1);
        let send = lease(encode(&desc).to_vec());
        let recv = lease(vec![0u64; DESC_WORDS * self.size]);
        let (sp, rp) = (send as *mut [u64], recv as *mut [u64]);
        let req = self
            .comm
            .immediate_all_gather_into(StaticScope, &*send, recv);
        self.complete(desc.op, start, req)?;
        // SAFETY: the request completed; both came from `lease`.
        let (_, words) = unsafe { (reclaim(sp), reclaim(rp)) };
        let descs: Vec<Desc> = words.chunks(DESC_WORDS).map(decode).collect();
        if let Err(m) = verify(&descs) {
            let reason = format!("mismatched collectives: {}", m.reason);
            self.break_with(&reason);
            return Err(self.error(desc.op.name(), Some(m.rank), start, reason));
        }
        Ok(())
    }

    /// All-to-all of `send` (blocks of `block` elements per rank).
    fn all_to_all<W: Equivalence + Pod>(
        &self,
        op: OpKind,
        start: Instant,
        send: Vec<W>,
        block: usize,
    ) -> Result<Vec<W>> {
        let send = lease(send);
        let recv = lease(vec![W::zeroed(); block * self.size]);
        let (sp, rp) = (send as *mut [W], recv as *mut [W]);
        let req = self
            .comm
            .immediate_all_to_all_into(StaticScope, &*send, recv);
        self.complete(op, start, req)?;
        // SAFETY: the request completed; both came from `lease`.
        Ok(unsafe { (reclaim(sp), reclaim(rp)) }.1)
    }

    /// All-gather of `send` into a new vector of `size * send.len()` elements.
    fn gather<W: Equivalence + Pod>(
        &self,
        op: OpKind,
        start: Instant,
        send: Vec<W>,
    ) -> Result<Vec<W>> {
        let n = send.len() * self.size;
        let send = lease(send);
        let recv = lease(vec![W::zeroed(); n]);
        let (sp, rp) = (send as *mut [W], recv as *mut [W]);
        let req = self
            .comm
            .immediate_all_gather_into(StaticScope, &*send, recv);
        self.complete(op, start, req)?;
        // SAFETY: the request completed; both came from `lease`.
        Ok(unsafe { (reclaim(sp), reclaim(rp)) }.1)
    }

    /// Reduces the `size` blocks of `block` elements in `blocks` in rank order into `out`.
    fn reduce_blocks<T: Wire>(&self, blocks: &[T::W], block: usize, out: &mut [T], op: ReduceOp) {
        let blocks: &[T] = cast_slice(blocks);
        let srcs: Vec<*const T> = blocks
            .chunks_exact(block.max(1))
            .map(<[T]>::as_ptr)
            .collect();
        // SAFETY: `size` source blocks of `block` elements, read only; `out` has `block`
        // elements and is exclusively borrowed.
        unsafe { reduce_range(&srcs[..self.size], &[out.as_mut_ptr()], 0, block, op) };
    }

    pub(super) fn all_reduce_t<T: Wire>(
        &self,
        buf: &mut [T],
        op: ReduceOp,
        start: Instant,
    ) -> Result<()> {
        let (n, len) = (self.size, buf.len());
        let block = len.div_ceil(n);
        if block == 0 {
            return Ok(());
        }
        let mut send = vec![T::W::zeroed(); block * n];
        send[..len].copy_from_slice(cast_slice(buf));
        let recv = self.all_to_all(OpKind::AllReduce, start, send, block)?;
        let mut mine = vec![T::zeroed(); block];
        self.reduce_blocks::<T>(&recv, block, &mut mine, op);
        let all = self.gather(
            OpKind::AllReduce,
            start,
            cast_slice::<T, T::W>(&mine).to_vec(),
        )?;
        cast_slice_mut::<T, T::W>(buf).copy_from_slice(&all[..len]);
        Ok(())
    }

    pub(super) fn reduce_scatter_t<T: Wire>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
        start: Instant,
    ) -> Result<()> {
        let block = output.len();
        if block == 0 {
            return Ok(());
        }
        let recv = self.all_to_all(
            OpKind::ReduceScatter,
            start,
            cast_slice(input).to_vec(),
            block,
        )?;
        self.reduce_blocks::<T>(&recv, block, output, op);
        Ok(())
    }

    pub(super) fn all_gather_t<T: Wire>(
        &self,
        input: &[T],
        output: &mut [T],
        start: Instant,
    ) -> Result<()> {
        if input.is_empty() {
            return Ok(());
        }
        let all = self.gather(OpKind::AllGather, start, cast_slice(input).to_vec())?;
        cast_slice_mut::<T, T::W>(output).copy_from_slice(&all);
        Ok(())
    }

    pub(super) fn broadcast_t<T: Wire>(
        &self,
        buf: &mut [T],
        root: usize,
        start: Instant,
    ) -> Result<()> {
        if buf.is_empty() {
            return Ok(());
        }
        let data = lease(cast_slice::<T, T::W>(buf).to_vec());
        let p = data as *mut [T::W];
        let req = self
            .comm
            .process_at_rank(root as i32)
            .immediate_broadcast_into(StaticScope, data);
        self.complete(OpKind::Broadcast, start, req)?;
        // SAFETY: the request completed; it came from `lease`.
        let data = unsafe { reclaim(p) };
        cast_slice_mut::<T, T::W>(buf).copy_from_slice(&data);
        Ok(())
    }
}

/// Fills the descriptor fields of a one-buffer collective.
fn desc_mut(op: OpKind, buf: &BufMut<'_>) -> Desc {
    let mut d = Desc::bare(0, op);
    (d.dtype, d.len_in, d.dtype_out, d.len_out) = (buf.dtype(), buf.len(), buf.dtype(), buf.len());
    d
}

/// Fills the descriptor fields of an input/output collective.
fn desc_io(op: OpKind, input: &BufRef<'_>, output: &BufMut<'_>) -> Desc {
    let mut d = Desc::bare(0, op);
    (d.dtype, d.len_in, d.dtype_out, d.len_out) =
        (input.dtype(), input.len(), output.dtype(), output.len());
    d
}

impl Communicator for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.size
    }

    fn backend(&self) -> crate::comm::CommBackend {
        crate::comm::CommBackend::Mpi
    }

    fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        let start = Instant::now();
        let mut d = desc_mut(OpKind::AllReduce, &buf);
        d.reduce = Some(op);
        self.check_in(d, start)?;
        match buf {
            BufMut::F32(b) => self.all_reduce_t(b, op, start),
            BufMut::Bf16(b) => self.all_reduce_t(b, op, start),
            BufMut::F16(b) => self.all_reduce_t(b, op, start),
        }
    }

    fn reduce_scatter(&self, input: BufRef<'_>, output: BufMut<'_>, op: ReduceOp) -> Result<()> {
        let start = Instant::now();
        let mut d = desc_io(OpKind::ReduceScatter, &input, &output);
        d.reduce = Some(op);
        self.check_in(d, start)?;
        match (input, output) {
            (BufRef::F32(i), BufMut::F32(o)) => self.reduce_scatter_t(i, o, op, start),
            (BufRef::Bf16(i), BufMut::Bf16(o)) => self.reduce_scatter_t(i, o, op, start),
            (BufRef::F16(i), BufMut::F16(o)) => self.reduce_scatter_t(i, o, op, start),
            // `check_in` rejects differing dtypes on every rank.
            _ => Ok(()),
        }
    }

    fn all_gather(&self, input: BufRef<'_>, output: BufMut<'_>) -> Result<()> {
        let start = Instant::now();
        self.check_in(desc_io(OpKind::AllGather, &input, &output), start)?;
        match (input, output) {
            (BufRef::F32(i), BufMut::F32(o)) => self.all_gather_t(i, o, start),
            (BufRef::Bf16(i), BufMut::Bf16(o)) => self.all_gather_t(i, o, start),
            (BufRef::F16(i), BufMut::F16(o)) => self.all_gather_t(i, o, start),
            // `check_in` rejects differing dtypes on every rank.
            _ => Ok(()),
        }
    }

    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<()> {
        let start = Instant::now();
        let mut d = desc_mut(OpKind::Broadcast, &buf);
        d.root = root;
        self.check_in(d, start)?;
        match buf {
            BufMut::F32(b) => self.broadcast_t(b, root, start),
            BufMut::Bf16(b) => self.broadcast_t(b, root, start),
            BufMut::F16(b) => self.broadcast_t(b, root, start),
        }
    }

    fn barrier(&self) -> Result<()> {
        // The descriptor all-gather completes only once every rank contributed.
        self.check_in(Desc::bare(0, OpKind::Barrier), Instant::now())
    }

    fn duplicate(&self) -> Result<Box<dyn Communicator>> {
        self.check_in(Desc::bare(0, OpKind::Duplicate), Instant::now())?;
        Ok(self.child(self.comm.duplicate()))
    }

    fn split(&self, color: usize, key: usize) -> Result<Box<dyn Communicator>> {
        self.split_impl(color, key)
    }
}
