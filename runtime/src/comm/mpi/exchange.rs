//! The entry of every MPI collective: the ranks' descriptors are all-gathered with a
//! nonblocking call polled against the deadline (so a rank that never comes is a clean error
//! on the others), and compared (so a mismatched call is an error on every rank, never
//! corruption). The data phase that follows is in `data.rs`.

use std::time::{Duration, Instant};

use mpi::collective::CommunicatorCollectives;
use mpi::request::{Request, StaticScope};
use mpi::traits::Communicator as _;

use super::MpiComm;
use crate::comm::local::desc::{verify, OpKind};
use crate::comm::{BufMut, BufRef, Communicator, ReduceOp};
use crate::tensor::DType;
use crate::Result;

pub(super) use crate::comm::local::desc::Desc;

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

const OPS: [OpKind; 8] = [
    OpKind::AllReduce,
    OpKind::ReduceScatter,
    OpKind::AllGather,
    OpKind::Broadcast,
    OpKind::Barrier,
    OpKind::Duplicate,
    OpKind::Split,
    OpKind::AllToAll,
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

/// How long a check-in tests back to back when the node has a core per rank, as Open MPI's
/// own blocking calls do (they spin for as long as they wait): a yield on a busy core can
/// cost a whole scheduler time slice, which a check-in of a few microseconds must not pay.
const SPIN_FOR: Duration = Duration::from_millis(2);
/// How long a check-in waits by yielding before it starts to sleep: past this, the peer is
/// busy with real work (a checkpoint, a long step), not a scheduling hiccup.
const YIELD_FOR: Duration = Duration::from_millis(50);
/// The longest sleep between tests of a long wait: the latency it adds once the peer arrives.
const MAX_NAP: Duration = Duration::from_micros(500);

impl MpiComm {
    /// Polls `req` until it completes or the collective's deadline passes. On timeout the
    /// request is forgotten (its buffers stay leased forever) and the communicator breaks.
    ///
    /// Open MPI's nonblocking collectives advance only inside MPI calls, so the request is
    /// tested in a loop that gives the core away as the wait grows: up to [`SPIN_FOR`] of
    /// back-to-back tests (skipped when this node runs more ranks than it has cores), then
    /// tests between yields for up to [`YIELD_FOR`], then sleeps that double up to
    /// [`MAX_NAP`]. A rank waiting for a slow peer therefore does not take the peer's core.
    ///
    /// Yielding rather than sleeping through ordinary waits matters: every check-in needs
    /// both ranks inside MPI to progress, so two ranks that each sleep between tests meet
    /// only by chance, and each nap adds its length to the collective's latency.
    fn complete<D: ?Sized>(
        &self,
        op: OpKind,
        start: Instant,
        mut req: Request<'static, D, StaticScope>,
    ) -> Result<()> {
        let waiting = Instant::now();
        let spin = if self.env.oversubscribed {
            Duration::ZERO
        } else {
            SPIN_FOR
        };
        let mut nap = Duration::from_micros(20);
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
                return Err(crate::comm::failure(
                    self.rank,
                    op.name(),
                    None,
                    start,
                    reason,
                ));
            }
            let waited = now.duration_since(waiting);
            if waited < spin {
                std::hint::spin_loop();
            } else if waited < YIELD_FOR {
                std::thread::yield_now();
            } else {
                std::thread::sleep(nap);
                nap = (nap * 2).min(MAX_NAP);
            }
        }
    }

    /// Entry of every collective: all-gathers the descriptors and checks them.
    pub(super) fn check_in(&self, mut desc: Desc, start: Instant) -> Result<()> {
        if let Some(reason) = self.broken.borrow().clone() {
            return Err(crate::comm::failure(
                self.rank,
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
            return Err(crate::comm::failure(
                self.rank,
                desc.op.name(),
                Some(m.rank),
                start,
                reason,
            ));
        }
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

    fn deterministic(&self) -> bool {
        // MPI's own sum is rank order at two ranks (one addition per element).
        self.reduction() == crate::comm::Reduction::RankOrdered || self.size <= 2
    }

    fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        let start = Instant::now();
        let mut d = desc_mut(OpKind::AllReduce, &buf);
        d.reduce = Some(op);
        self.check_in(d, start)?;
        match buf {
            BufMut::F32(b) => self.all_reduce_data(b, op),
            BufMut::Bf16(b) => self.all_reduce_data(b, op),
            BufMut::F16(b) => self.all_reduce_data(b, op),
        }
    }

    fn reduce_scatter(&self, input: BufRef<'_>, output: BufMut<'_>, op: ReduceOp) -> Result<()> {
        let start = Instant::now();
        let mut d = desc_io(OpKind::ReduceScatter, &input, &output);
        d.reduce = Some(op);
        self.check_in(d, start)?;
        match (input, output) {
            (BufRef::F32(i), BufMut::F32(o)) => self.reduce_scatter_data(i, o, op),
            (BufRef::Bf16(i), BufMut::Bf16(o)) => self.reduce_scatter_data(i, o, op),
            (BufRef::F16(i), BufMut::F16(o)) => self.reduce_scatter_data(i, o, op),
            // `check_in` rejects differing dtypes on every rank.
            _ => Ok(()),
        }
    }

    fn all_gather(&self, input: BufRef<'_>, output: BufMut<'_>) -> Result<()> {
        let start = Instant::now();
        self.check_in(desc_io(OpKind::AllGather, &input, &output), start)?;
        match (input, output) {
            (BufRef::F32(i), BufMut::F32(o)) => self.all_gather_data(i, o),
            (BufRef::Bf16(i), BufMut::Bf16(o)) => self.all_gather_data(i, o),
            (BufRef::F16(i), BufMut::F16(o)) => self.all_gather_data(i, o),
            // `check_in` rejects differing dtypes on every rank.
            _ => Ok(()),
        }
    }

    /// One `MPI_Alltoall` of the slots alone: each rank moves its input once, where the
    /// trait's default gathers every whole input.
    fn all_to_all(&self, input: BufRef<'_>, output: BufMut<'_>) -> Result<()> {
        let start = Instant::now();
        self.check_in(desc_io(OpKind::AllToAll, &input, &output), start)?;
        match (input, output) {
            (BufRef::F32(i), BufMut::F32(o)) => self.all_to_all_data(i, o),
            (BufRef::Bf16(i), BufMut::Bf16(o)) => self.all_to_all_data(i, o),
            (BufRef::F16(i), BufMut::F16(o)) => self.all_to_all_data(i, o),
            // `check_in` rejects differing dtypes and lengths on every rank.
            _ => Ok(()),
        }
    }

    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<()> {
        let start = Instant::now();
        let mut d = desc_mut(OpKind::Broadcast, &buf);
        d.root = root;
        self.check_in(d, start)?;
        match buf {
            BufMut::F32(b) => self.broadcast_data(b, root),
            BufMut::Bf16(b) => self.broadcast_data(b, root),
            BufMut::F16(b) => self.broadcast_data(b, root),
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
