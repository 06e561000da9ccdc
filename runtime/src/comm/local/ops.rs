//! The `Communicator` implementation of [`LocalComm`]: announce, move data, release.

use std::time::Instant;

use half::{bf16, f16};

use super::desc::{Desc, OpKind};
use super::kernels::{chunk, reduce_range, Elem};
use super::{device, LocalComm};
use crate::comm::{BufMut, BufRef, Communicator, ReduceOp};
use crate::tensor::{DType, View, ViewMut};
use crate::Result;

/// Address, dtype and length of a read-only buffer.
fn parts_ref(buf: &BufRef<'_>) -> (usize, DType, usize) {
    let addr = match buf {
        BufRef::F32(b) => b.as_ptr() as usize,
        BufRef::Bf16(b) => b.as_ptr() as usize,
        BufRef::F16(b) => b.as_ptr() as usize,
    };
    (addr, buf.dtype(), buf.len())
}

/// Address, dtype and length of a mutable buffer; the address is the one every rank uses
/// during the data phase, this rank included, so the `&mut` is not used meanwhile.
fn parts_mut(buf: &mut BufMut<'_>) -> (usize, DType, usize) {
    let (dtype, len) = (buf.dtype(), buf.len());
    let addr = match buf {
        BufMut::F32(b) => b.as_mut_ptr() as usize,
        BufMut::Bf16(b) => b.as_mut_ptr() as usize,
        BufMut::F16(b) => b.as_mut_ptr() as usize,
    };
    (addr, dtype, len)
}

/// Calls `$f::<T>` with the element type of `$dtype`.
macro_rules! with_elem {
    ($dtype:expr, $f:ident($($arg:expr),*)) => {
        match $dtype {
            crate::tensor::DType::F32 => $f::<f32>($($arg),*),
            crate::tensor::DType::Bf16 => $f::<bf16>($($arg),*),
            crate::tensor::DType::F16 => $f::<f16>($($arg),*),
        }
    };
}

/// Max ranks whose pointers fit in the on-stack tables of the data phase; larger groups
/// fall back to a heap table (one allocation per call).
const STACK_RANKS: usize = 16;

/// Rank `me`'s share of an all-reduce: chunk `me` over every rank, into every rank.
fn all_reduce_data<T: Elem>(peers: &[Desc], me: usize, op: ReduceOp) {
    let n = peers.len();
    let (lo, hi) = chunk(peers[0].len_in, n, me);
    let run = |srcs: &[*const T], dsts: &[*mut T]| {
        // SAFETY: every rank passed the entry barrier with a buffer of `len_in` elements it
        // does not touch until the release barrier; chunk `me` is accessed by this rank only.
        unsafe { reduce_range(srcs, dsts, lo, hi, op) }
    };
    if n <= STACK_RANKS {
        let mut srcs = [std::ptr::null::<T>(); STACK_RANKS];
        let mut dsts = [std::ptr::null_mut::<T>(); STACK_RANKS];
        for (k, d) in peers.iter().enumerate() {
            srcs[k] = d.src as *const T;
            dsts[k] = d.src as *mut T;
        }
        run(&srcs[..n], &dsts[..n]);
    } else {
        let srcs: Vec<*const T> = peers.iter().map(|d| d.src as *const T).collect();
        let dsts: Vec<*mut T> = peers.iter().map(|d| d.src as *mut T).collect();
        run(&srcs, &dsts);
    }
}

/// Rank `me`'s share of a reduce-scatter: block `me` of every input, into its own output.
fn reduce_scatter_data<T: Elem>(peers: &[Desc], me: usize, op: ReduceOp) {
    let n = peers.len();
    let m = peers[me].len_out;
    let out = peers[me].dst as *mut T;
    let run = |srcs: &[*const T]| {
        // SAFETY: inputs hold `n * m` elements and are only read; this rank's output holds
        // `m` elements and is written by this rank only. Offsetting by `me * m` stays in
        // bounds.
        unsafe { reduce_range(srcs, &[out], 0, m, op) }
    };
    if n <= STACK_RANKS {
        let mut srcs = [std::ptr::null::<T>(); STACK_RANKS];
        for (k, d) in peers.iter().enumerate() {
            // SAFETY: in bounds, see above.
            srcs[k] = unsafe { (d.src as *const T).add(me * m) };
        }
        run(&srcs[..n]);
    } else {
        // SAFETY: in bounds, see above.
        let srcs: Vec<*const T> = peers
            .iter()
            .map(|d| unsafe { (d.src as *const T).add(me * m) })
            .collect();
        run(&srcs);
    }
}

/// Rank `me`'s share of an all-gather: every input into its own output.
fn all_gather_data<T: Elem>(peers: &[Desc], me: usize) {
    let m = peers[me].len_in;
    let out = peers[me].dst as *mut T;
    for (k, d) in peers.iter().enumerate() {
        // SAFETY: inputs hold `m` elements and are only read; this rank's output holds
        // `n * m` elements and is written by this rank only.
        unsafe { std::ptr::copy_nonoverlapping(d.src as *const T, out.add(k * m), m) };
    }
}

/// Rank `me`'s share of an all-to-all: slot `me` of every input into its own output.
fn all_to_all_data<T: Elem>(peers: &[Desc], me: usize) {
    let m = peers[me].len_in / peers.len();
    let out = peers[me].dst as *mut T;
    for (k, d) in peers.iter().enumerate() {
        // SAFETY: inputs hold `n * m` elements and are only read; this rank's output holds
        // `n * m` elements and is written by this rank only.
        unsafe {
            std::ptr::copy_nonoverlapping((d.src as *const T).add(me * m), out.add(k * m), m)
        };
    }
}

/// Rank `me`'s share of a broadcast: copy the root's buffer unless this is the root.
fn broadcast_data<T: Elem>(peers: &[Desc], me: usize) {
    let root = peers[me].root;
    if me != root {
        let len = peers[me].len_in;
        // SAFETY: the root's buffer is only read during the data phase; ours is written by
        // this rank only; both hold `len` elements.
        unsafe {
            std::ptr::copy_nonoverlapping(peers[root].src as *const T, peers[me].src as *mut T, len)
        };
    }
}

impl LocalComm {
    /// Announces `desc`, runs `data` on every rank's announcements, then releases.
    fn collective(&self, desc: Desc, data: impl FnOnce(&[Desc])) -> Result<()> {
        let start = Instant::now();
        self.enter(desc, start)?;
        data(&self.peers.borrow());
        self.release(desc.op, start)
    }
}

impl Communicator for LocalComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.group.n
    }

    fn backend(&self) -> crate::comm::CommBackend {
        crate::comm::CommBackend::Local
    }

    crate::comm::host_by_views!();

    fn all_to_all(&self, input: BufRef<'_>, mut output: BufMut<'_>) -> Result<()> {
        let mut d = self.next_desc(OpKind::AllToAll);
        (d.src, d.dtype, d.len_in) = parts_ref(&input);
        (d.dst, d.dtype_out, d.len_out) = parts_mut(&mut output);
        let me = self.rank;
        self.collective(d, |p| with_elem!(d.dtype, all_to_all_data(p, me)))
    }

    fn barrier(&self) -> Result<()> {
        let start = Instant::now();
        self.enter(self.next_desc(OpKind::Barrier), start)
    }

    fn duplicate(&self) -> Result<Box<dyn Communicator>> {
        self.child(OpKind::Duplicate, 0, self.rank)
    }

    fn split(&self, color: usize, key: usize) -> Result<Box<dyn Communicator>> {
        self.child(OpKind::Split, color, key)
    }

    /// Host buffers are exchanged in shared memory, device buffers in device memory (each
    /// rank's share computed by its own device); every rank passes the same kind.
    fn all_reduce_view(&self, mut buf: ViewMut<'_>, op: ReduceOp) -> Result<()> {
        let mut d = self.next_desc(OpKind::AllReduce);
        (d.src, d.dtype, d.len_in, d.src_dev) = parts_view_mut(&mut buf)?;
        (d.dst, d.dtype_out, d.len_out) = (d.src, d.dtype, d.len_in);
        (d.dst_dev, d.reduce) = (d.src_dev, Some(op));
        if on_device(&d) {
            return device::all_reduce(self, d, op);
        }
        let me = self.rank;
        self.collective(d, |p| with_elem!(d.dtype, all_reduce_data(p, me, op)))
    }

    fn reduce_scatter_view(
        &self,
        input: View<'_>,
        mut output: ViewMut<'_>,
        op: ReduceOp,
    ) -> Result<()> {
        let mut d = self.next_desc(OpKind::ReduceScatter);
        (d.src, d.dtype, d.len_in, d.src_dev) = parts_view(&input)?;
        (d.dst, d.dtype_out, d.len_out, d.dst_dev) = parts_view_mut(&mut output)?;
        d.reduce = Some(op);
        if on_device(&d) {
            return device::reduce_scatter(self, d, op);
        }
        let me = self.rank;
        self.collective(d, |p| with_elem!(d.dtype, reduce_scatter_data(p, me, op)))
    }

    fn all_gather_view(&self, input: View<'_>, mut output: ViewMut<'_>) -> Result<()> {
        let mut d = self.next_desc(OpKind::AllGather);
        (d.src, d.dtype, d.len_in, d.src_dev) = parts_view(&input)?;
        (d.dst, d.dtype_out, d.len_out, d.dst_dev) = parts_view_mut(&mut output)?;
        if on_device(&d) {
            return device::all_gather(self, d);
        }
        let me = self.rank;
        self.collective(d, |p| with_elem!(d.dtype, all_gather_data(p, me)))
    }

    fn broadcast_view(&self, mut buf: ViewMut<'_>, root: usize) -> Result<()> {
        let mut d = self.next_desc(OpKind::Broadcast);
        (d.src, d.dtype, d.len_in, d.src_dev) = parts_view_mut(&mut buf)?;
        (d.dst, d.dtype_out, d.len_out) = (d.src, d.dtype, d.len_in);
        (d.dst_dev, d.root) = (d.src_dev, root);
        if on_device(&d) {
            return device::broadcast(self, d);
        }
        let me = self.rank;
        self.collective(d, |p| with_elem!(d.dtype, broadcast_data(p, me)))
    }
}

/// Whether either buffer of `d` is device memory. A rank whose two buffers are in different
/// places (or whose kind differs from its peers') takes the device path too and fails at the
/// entry barrier, on every rank, with the check of `desc.rs`.
fn on_device(d: &Desc) -> bool {
    d.src_dev != 0 || d.dst_dev != 0
}

/// Address, dtype, length and device handle (0 for host memory) of a read-only view.
fn parts_view(v: &View<'_>) -> Result<(usize, DType, usize, usize)> {
    Ok(match v {
        View::Host(b) => {
            let (addr, dtype, len) = parts_ref(b);
            (addr, dtype, len, 0)
        }
        View::Cuda(c) => device::parts(c),
        View::Meta(_) => return Err(meta_refused()),
    })
}

/// Address, dtype, length and device handle (0 for host memory) of a mutable view.
fn parts_view_mut(v: &mut ViewMut<'_>) -> Result<(usize, DType, usize, usize)> {
    Ok(match v {
        ViewMut::Host(b) => {
            let (addr, dtype, len) = parts_mut(b);
            (addr, dtype, len, 0)
        }
        ViewMut::Cuda(c) => device::parts(&c.as_view()),
        ViewMut::Meta(_) => return Err(meta_refused()),
    })
}

/// Size-only elements have nothing to exchange: their collectives are `comm::meta`'s.
fn meta_refused() -> crate::Error {
    crate::Error::Invalid(
        "local communicator: meta (size-only) buffers have no values to exchange; a size-only          run uses comm::meta::MetaComm"
            .into(),
    )
}
