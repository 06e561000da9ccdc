//! Collective bandwidth measurement, nccl-tests style: for each op and size, the time per
//! call (slowest rank), algorithm bandwidth `bytes / time` and bus bandwidth (algorithm
//! bandwidth times the op's traffic factor, comparable across world sizes).

use std::time::Instant;

use serde::Serialize;

use super::{BufMut, BufRef, Communicator, ReduceOp};
use crate::Result;

/// A benchmarked collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BenchOp {
    /// In-place sum across ranks.
    AllReduce,
    /// Sum, each rank keeps its block.
    ReduceScatter,
    /// Concatenation of every rank's block.
    AllGather,
    /// Rank 0's buffer to every rank.
    Broadcast,
}

impl BenchOp {
    /// Every op, in table order.
    pub const ALL: [BenchOp; 4] = [
        BenchOp::AllReduce,
        BenchOp::ReduceScatter,
        BenchOp::AllGather,
        BenchOp::Broadcast,
    ];

    /// The op's name in tables and JSON.
    pub fn name(self) -> &'static str {
        match self {
            BenchOp::AllReduce => "all_reduce",
            BenchOp::ReduceScatter => "reduce_scatter",
            BenchOp::AllGather => "all_gather",
            BenchOp::Broadcast => "broadcast",
        }
    }

    /// nccl-tests' bus bandwidth factor: the share of the data each rank must send or
    /// receive, so that a perfect implementation's bus bandwidth equals the link bandwidth.
    pub fn bus_factor(self, ranks: usize) -> f64 {
        let n = ranks as f64;
        match self {
            BenchOp::AllReduce => 2.0 * (n - 1.0) / n,
            BenchOp::ReduceScatter | BenchOp::AllGather => (n - 1.0) / n,
            BenchOp::Broadcast => 1.0,
        }
    }
}

/// One row of results.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BenchRow {
    /// The collective.
    pub op: BenchOp,
    /// Size of the largest buffer of the call (all-reduce and broadcast buffer,
    /// reduce-scatter input, all-gather output), as in nccl-tests.
    pub bytes: usize,
    /// World size.
    pub ranks: usize,
    /// Mean time per call on the slowest rank, in microseconds.
    pub time_us: f64,
    /// `bytes / time`, in GB/s (1e9 bytes).
    pub algbw_gbps: f64,
    /// Algorithm bandwidth times the op's bus factor, in GB/s.
    pub busbw_gbps: f64,
}

/// Sizes from `min` to `max` bytes, doubling (nccl-tests' `-f 2`).
pub fn sizes(min: usize, max: usize) -> Vec<usize> {
    let mut out = Vec::new();
    let mut s = min.max(4);
    while s <= max {
        out.push(s);
        s = s.saturating_mul(2);
    }
    out
}

/// Calls per measurement: enough to move about 1 GiB, at least 3 and at most 1000.
fn iterations(bytes: usize) -> usize {
    ((1usize << 30) / bytes.max(1)).clamp(3, 1000)
}

/// Runs one rank's part of the benchmark (every rank of `comm` must call it with the same
/// arguments); every rank returns the same rows.
pub fn run(comm: &dyn Communicator, ops: &[BenchOp], sizes: &[usize]) -> Result<Vec<BenchRow>> {
    let mut rows = Vec::with_capacity(ops.len() * sizes.len());
    for &op in ops {
        for &bytes in sizes {
            rows.push(measure(comm, op, bytes)?);
        }
    }
    Ok(rows)
}

/// Times `op` on f32 buffers of `bytes` (rounded down to whole elements divisible by the
/// world size).
fn measure(comm: &dyn Communicator, op: BenchOp, bytes: usize) -> Result<BenchRow> {
    let n = comm.world_size();
    let block = (bytes / 4 / n).max(1);
    let total = block * n;
    let mut big = vec![1.0f32; total];
    let mut small = vec![1.0f32; block];
    let mut call = || match op {
        BenchOp::AllReduce => comm.all_reduce(BufMut::F32(&mut big), ReduceOp::Sum),
        BenchOp::ReduceScatter => {
            comm.reduce_scatter(BufRef::F32(&big), BufMut::F32(&mut small), ReduceOp::Sum)
        }
        BenchOp::AllGather => comm.all_gather(BufRef::F32(&small), BufMut::F32(&mut big)),
        BenchOp::Broadcast => comm.broadcast(BufMut::F32(&mut big), 0),
    };
    call()?;
    let iters = iterations(total * 4);
    comm.barrier()?;
    let start = Instant::now();
    for _ in 0..iters {
        call()?;
    }
    let mut secs = [start.elapsed().as_secs_f32() / iters as f32];
    comm.all_reduce(BufMut::F32(&mut secs), ReduceOp::Max)?;
    let secs = f64::from(secs[0]).max(1e-9);
    let algbw = (total * 4) as f64 / secs / 1e9;
    Ok(BenchRow {
        op,
        bytes: total * 4,
        ranks: n,
        time_us: secs * 1e6,
        algbw_gbps: algbw,
        busbw_gbps: algbw * op.bus_factor(n),
    })
}
