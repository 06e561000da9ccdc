//! What each rank announces when it enters a collective, and the cross-rank check of those
//! announcements that turns a mismatch into an error on every rank instead of corruption.

use crate::comm::ReduceOp;
use crate::tensor::DType;

/// The collective a rank entered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OpKind {
    /// `all_reduce`.
    AllReduce,
    /// `reduce_scatter`.
    ReduceScatter,
    /// `all_gather`.
    AllGather,
    /// `broadcast`.
    Broadcast,
    /// `all_to_all`.
    AllToAll,
    /// `barrier`.
    Barrier,
    /// `duplicate`.
    Duplicate,
    /// `split`.
    Split,
}

impl OpKind {
    /// The name used in errors.
    pub(crate) fn name(self) -> &'static str {
        match self {
            OpKind::AllReduce => "all_reduce",
            OpKind::ReduceScatter => "reduce_scatter",
            OpKind::AllGather => "all_gather",
            OpKind::Broadcast => "broadcast",
            OpKind::AllToAll => "all_to_all",
            OpKind::Barrier => "barrier",
            OpKind::Duplicate => "duplicate",
            OpKind::Split => "split",
        }
    }

    /// The output length a rank's `input` elements call for at `world` ranks, the rule
    /// every transport checks: `None` where no output fits (a reduce-scatter's or an
    /// all-to-all's input that does not split into equal slots).
    pub(crate) fn output_len(self, input: usize, world: usize) -> Option<usize> {
        match self {
            OpKind::ReduceScatter => input.checked_div(world).filter(|m| m * world == input),
            OpKind::AllGather => input.checked_mul(world),
            OpKind::AllToAll => (world > 0 && input.is_multiple_of(world)).then_some(input),
            _ => Some(input),
        }
    }
}

/// One rank's announcement. Buffer addresses are kept as integers so that the descriptor
/// table can sit in the shared state; they are only dereferenced during the data phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Desc {
    /// Collective sequence number on this rank (0-based).
    pub seq: u64,
    /// The collective.
    pub op: OpKind,
    /// Reduction operator, for reductions.
    pub reduce: Option<ReduceOp>,
    /// Input (or in-place) buffer dtype and length.
    pub dtype: DType,
    /// Input (or in-place) length in elements.
    pub len_in: usize,
    /// Output buffer dtype (equals `dtype` for in-place collectives).
    pub dtype_out: DType,
    /// Output length in elements (equals `len_in` for in-place collectives).
    pub len_out: usize,
    /// Broadcast root, split color.
    pub root: usize,
    /// Split key.
    pub key: usize,
    /// Input buffer address.
    pub src: usize,
    /// Output buffer address.
    pub dst: usize,
    /// For a device input: the address of the device handle its view borrows (0: host memory).
    pub src_dev: usize,
    /// For a device output: likewise.
    pub dst_dev: usize,
    /// Device events recorded on the compute streams of the input's and the output's device
    /// after the work that produced them (0: none), which peers' copies wait for.
    pub ready: [u64; 2],
    /// The device event this rank records on its collective stream after its share, which
    /// every rank's compute stream waits for (0: none).
    pub done: u64,
}

impl Desc {
    /// A descriptor for a collective without buffers.
    pub(crate) fn bare(seq: u64, op: OpKind) -> Self {
        Self {
            seq,
            op,
            reduce: None,
            dtype: DType::F32,
            len_in: 0,
            dtype_out: DType::F32,
            len_out: 0,
            root: 0,
            key: 0,
            src: 0,
            dst: 0,
            src_dev: 0,
            dst_dev: 0,
            ready: [0; 2],
            done: 0,
        }
    }

    /// Where the buffers are, in messages.
    fn place(&self) -> &'static str {
        if self.src_dev == 0 {
            "host"
        } else {
            "device"
        }
    }

    /// The fields every rank must agree on, for comparison and messages.
    fn signature(&self) -> String {
        let mut s = format!("{} #{} ({:?}", self.op.name(), self.seq, self.dtype);
        match self.op {
            OpKind::AllReduce => s += &format!(", {} elements, {:?}", self.len_in, self.reduce),
            OpKind::ReduceScatter | OpKind::AllGather | OpKind::AllToAll => {
                s += &format!(", {} -> {} elements", self.len_in, self.len_out)
            }
            OpKind::Broadcast => s += &format!(", {} elements, root {}", self.len_in, self.root),
            _ => {}
        }
        s + &format!(", {} memory)", self.place())
    }
}

/// Why the descriptors of one collective do not fit together.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Mismatch {
    /// The first rank at fault.
    pub rank: usize,
    /// What is wrong, in one sentence.
    pub reason: String,
}

/// Checks one rank's own arguments (lengths that must relate, dtypes that must agree).
fn check_own(d: &Desc, n: usize) -> Option<String> {
    let expected_out = match d.op {
        OpKind::ReduceScatter | OpKind::AllGather | OpKind::AllToAll => {
            d.op.output_len(d.len_in, n)
        }
        _ => Some(d.len_out),
    };
    if (d.src_dev == 0) != (d.dst_dev == 0) {
        return Some(format!(
            "{} input is in {} memory but output is not: both buffers must be on one device",
            d.op.name(),
            d.place()
        ));
    }
    if d.dtype != d.dtype_out {
        return Some(format!(
            "{} input is {:?} but output is {:?}",
            d.op.name(),
            d.dtype,
            d.dtype_out
        ));
    }
    if expected_out != Some(d.len_out) {
        return Some(format!(
            "{} needs output length = input length {} for world size {n}, got input {} and output {}",
            d.op.name(),
            match d.op {
                OpKind::AllGather => "* world size",
                OpKind::AllToAll => "(a multiple of the world size)",
                _ => "/ world size",
            },
            d.len_in,
            d.len_out
        ));
    }
    if d.op == OpKind::Broadcast && d.root >= n {
        return Some(format!(
            "broadcast root {} is not a rank of a {n}-rank group",
            d.root
        ));
    }
    None
}

/// Checks that every rank announced the same collective with fitting arguments. Buffer
/// addresses and split colors/keys legitimately differ between ranks.
pub(crate) fn verify(descs: &[Desc]) -> Result<(), Mismatch> {
    let n = descs.len();
    for (rank, d) in descs.iter().enumerate() {
        if let Some(reason) = check_own(d, n) {
            return Err(Mismatch { rank, reason });
        }
    }
    let first = &descs[0];
    let same = |d: &Desc| {
        d.seq == first.seq
            && d.op == first.op
            && d.reduce == first.reduce
            && d.dtype == first.dtype
            && d.len_in == first.len_in
            && (d.src_dev == 0) == (first.src_dev == 0)
            && (d.op != OpKind::Broadcast || d.root == first.root)
    };
    match descs.iter().position(|d| !same(d)) {
        None => Ok(()),
        Some(rank) => Err(Mismatch {
            rank,
            reason: format!(
                "rank {rank} called {} while rank 0 called {}",
                descs[rank].signature(),
                first.signature()
            ),
        }),
    }
}
