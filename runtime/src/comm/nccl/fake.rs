//! A fake NCCL for CI: ranks are threads of one process, a collective is on its stream (its
//! results written) once every rank of its communicator started it (so a rank that never
//! arrives leaves its peers polling, as a dead peer does on a GPU; the emulator's streams run
//! work at issue, so the results must be there before the host goes on), and it finishes a
//! set delay later, or never for a collective told to hang inside NCCL. Errors can be injected
//! where NCCL's asynchronous errors would appear. It moves real data, summing in *reverse* rank order (a
//! stand-in for NCCL's ring order, which is not rank order), so the deterministic path's
//! bitwise claims are testable too.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::api::{NcclHandle, NcclId, NcclLib, NcclOp, Poll};
use super::ordered::copy;
use crate::comm::{BufRef, ReduceOp};
use crate::tensor::staging::write_host;
use crate::tensor::{FlatBuf, View, ViewMut};
use crate::{Error, Result};

/// An error to report on `rank` when it polls its collective number `seq` (1-based).
#[derive(Debug, Clone)]
pub struct InjectedError {
    /// The rank that sees it.
    pub rank: usize,
    /// The collective (1-based count of the communicator's collectives).
    pub seq: u64,
    /// NCCL's message.
    pub reason: String,
}

/// Every rank's deposited input of one collective, and how many ranks took their result.
type Deposit = (Vec<Option<FlatBuf>>, usize);

#[derive(Default)]
struct State {
    /// Ids each rank initialised with, per world (for the id-exchange check).
    inits: Vec<(usize, NcclId)>,
    /// Inputs deposited per (communicator, collective number), per rank; and how many
    /// ranks have taken their result.
    deposits: HashMap<(u64, u64), Deposit>,
    aborted: Vec<(u64, usize)>,
    /// Collectives started with device buffers (as the communicator passed them).
    device_collectives: usize,
}

/// The fake library; clones share one world.
#[derive(Clone, Default)]
pub struct FakeNccl {
    state: Arc<Mutex<State>>,
    errors: Vec<InjectedError>,
    next_id: Arc<Mutex<u8>>,
    /// How long after every rank started it a collective finishes.
    delay: Duration,
    /// Collectives (numbers on the root communicator) that are queued but never finish.
    hang: Vec<u64>,
}

impl FakeNccl {
    /// A fake whose ranks see `errors`.
    pub fn with_errors(errors: Vec<InjectedError>) -> Self {
        Self {
            errors,
            ..Self::default()
        }
    }

    /// This fake, with every collective finishing `delay` after the last rank started it
    /// (instead of at once): the time a GPU takes to run it, which the host need not wait for.
    pub fn with_completion_delay(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }

    /// This fake, with collective number `seq` (1-based, on the communicator made by `init`)
    /// queued on every rank but never finishing: a peer that died inside it on a GPU.
    pub fn hanging_at(mut self, seq: u64) -> Self {
        self.hang.push(seq);
        self
    }

    /// The ids ranks initialised with, as (rank, id), in call order.
    pub fn inits(&self) -> Vec<(usize, NcclId)> {
        self.lock().inits.clone()
    }

    /// How many collectives (over every rank) were started with device buffers: the
    /// communicator handed them over instead of staging them through host memory.
    pub fn device_collectives(&self) -> usize {
        self.lock().device_collectives
    }

    /// (communicator, rank) pairs that called abort.
    pub fn aborted_ranks(&self) -> Vec<usize> {
        self.lock().aborted.iter().map(|a| a.1).collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl NcclLib for FakeNccl {
    fn describe(&self) -> String {
        "fake NCCL (threads, host memory)".into()
    }

    fn unique_id(&self) -> Result<NcclId> {
        let mut n = self.next_id.lock().unwrap_or_else(PoisonError::into_inner);
        *n = n.wrapping_add(1);
        let mut id = [0u8; 128];
        id[0] = *n;
        id[1..9].copy_from_slice(&u64::from(std::process::id()).to_le_bytes());
        Ok(id)
    }

    fn init(&self, id: &NcclId, world: usize, rank: usize) -> Result<Box<dyn NcclHandle>> {
        self.lock().inits.push((rank, *id));
        Ok(Box::new(FakeHandle {
            lib: self.clone(),
            comm: u64::from_le_bytes(id[..8].try_into().unwrap_or_default()),
            id: *id,
            rank,
            world,
            seq: 0,
            splits: 0,
            queued: None,
        }))
    }
}

struct FakeHandle {
    lib: FakeNccl,
    comm: u64,
    id: NcclId,
    rank: usize,
    world: usize,
    seq: u64,
    splits: u64,
    /// When the collective started last was queued (every rank had started it).
    queued: Option<Instant>,
}

impl FakeHandle {
    fn injected(&self) -> Option<String> {
        self.lib
            .errors
            .iter()
            .find(|e| e.rank == self.rank && e.seq == self.seq && self.comm_is_root())
            .map(|e| e.reason.clone())
    }

    /// Injected errors apply to the communicator made by `init`, not to its splits.
    fn comm_is_root(&self) -> bool {
        self.comm == u64::from_le_bytes(self.id[..8].try_into().unwrap_or_default())
    }
}

impl NcclHandle for FakeHandle {
    fn poll_init(&mut self) -> Poll {
        let st = self.lib.lock();
        let peers: Vec<&NcclId> = st
            .inits
            .iter()
            .filter(|(_, id)| id[..9] == self.id[..9])
            .map(|(_, id)| id)
            .collect();
        if peers.iter().any(|id| **id != self.id) {
            return Poll::Failed("ranks initialised with different unique ids".into());
        }
        if peers.len() >= self.world || !self.comm_is_root() {
            Poll::Done
        } else {
            Poll::Pending
        }
    }

    fn start(&mut self, op: &mut NcclOp<'_>) -> Result<()> {
        self.seq += 1;
        self.queued = None;
        if self.injected().is_some() {
            // The failing rank's part never reaches its peers, as when NCCL gives up.
            return Ok(());
        }
        let input = match op {
            NcclOp::AllReduce { buf, .. } | NcclOp::Broadcast { buf, .. } => buf.as_view(),
            NcclOp::ReduceScatter { input, .. }
            | NcclOp::AllGather { input, .. }
            | NcclOp::AllToAll { input, .. } => *input,
        };
        let on_device = matches!(input, View::Cuda(_));
        // What NCCL reads from device memory on a GPU, the fake downloads.
        let input = input.to_host()?;
        let mut st = self.lib.lock();
        st.device_collectives += usize::from(on_device);
        let slot = st
            .deposits
            .entry((self.comm, self.seq))
            .or_insert_with(|| (vec![None; self.world], 0));
        slot.0[self.rank] = Some(input);
        Ok(())
    }

    fn poll_enqueued(&mut self, op: &mut NcclOp<'_>) -> Poll {
        if let Some(reason) = self.injected() {
            return Poll::Failed(reason);
        }
        let mut st = self.lib.lock();
        let key = (self.comm, self.seq);
        let Some((inputs, taken)) = st.deposits.get_mut(&key) else {
            return Poll::Failed("poll without a started collective".into());
        };
        if inputs.iter().any(Option::is_none) {
            return Poll::Pending;
        }
        let inputs: Vec<&FlatBuf> = inputs.iter().flatten().collect();
        let r = complete(op, &inputs, self.rank);
        *taken += 1;
        if *taken == self.world {
            st.deposits.remove(&key);
        }
        match r {
            Ok(()) => {
                self.queued = Some(Instant::now());
                Poll::Done
            }
            Err(e) => Poll::Failed(e.to_string()),
        }
    }

    fn poll(&mut self, _op: Option<&mut NcclOp<'_>>) -> Poll {
        let Some(queued) = self.queued else {
            return Poll::Failed("poll of a collective that was never queued".into());
        };
        let hangs = self.comm_is_root() && self.lib.hang.contains(&self.seq);
        if hangs || queued.elapsed() < self.lib.delay {
            Poll::Pending
        } else {
            Poll::Done
        }
    }

    fn abort(&mut self) {
        self.lib.lock().aborted.push((self.comm, self.rank));
    }

    fn split(
        &mut self,
        color: usize,
        _key: usize,
        rank: usize,
        world: usize,
    ) -> Result<Box<dyn NcclHandle>> {
        self.splits += 1;
        let comm = self
            .comm
            .wrapping_mul(1_000_003)
            .wrapping_add(self.splits * 1009 + color as u64 + 1);
        Ok(Box::new(FakeHandle {
            lib: self.lib.clone(),
            comm,
            id: self.id,
            rank,
            world,
            seq: 0,
            splits: 0,
            queued: None,
        }))
    }
}

/// Writes `op`'s result on `rank` from every rank's deposited input.
fn complete(op: &mut NcclOp<'_>, inputs: &[&FlatBuf], rank: usize) -> Result<()> {
    let world = inputs.len();
    match op {
        NcclOp::AllReduce { buf, op } => {
            let out = reduce(inputs, 0..buf.len(), *op)?;
            put(out.as_ref(), buf.reborrow())
        }
        NcclOp::ReduceScatter { output, op, .. } => {
            let n = output.len();
            let out = reduce(inputs, rank * n..(rank + 1) * n, *op)?;
            put(out.as_ref(), output.reborrow())
        }
        NcclOp::AllGather { output, .. } => {
            let n = output.len() / world.max(1);
            for (r, x) in inputs.iter().enumerate() {
                put(x.as_ref(), output.reborrow().range(r * n..(r + 1) * n)?)?;
            }
            Ok(())
        }
        NcclOp::Broadcast { buf, root } => put(inputs[*root].as_ref(), buf.reborrow()),
        NcclOp::AllToAll { output, .. } => {
            let n = output.len() / world.max(1);
            for (r, x) in inputs.iter().enumerate() {
                let part: BufRef<'_> = x.as_ref_range(rank * n..(rank + 1) * n);
                put(part, output.reborrow().range(r * n..(r + 1) * n)?)?;
            }
            Ok(())
        }
    }
}

/// Writes a host result into an output wherever it lives (device outputs by an upload: what
/// NCCL writes in device memory on a GPU).
fn put(src: BufRef<'_>, dst: ViewMut<'_>) -> Result<()> {
    write_host(dst, |d| copy(src, d))
}

/// Elements `range` of every input reduced in reverse rank order, in f32, rounded once.
fn reduce(inputs: &[&FlatBuf], range: std::ops::Range<usize>, op: ReduceOp) -> Result<FlatBuf> {
    let first = inputs
        .first()
        .ok_or_else(|| Error::Invalid("no ranks".into()))?;
    let n = range.len();
    let (mut acc, mut x) = (vec![0f32; n], vec![0f32; n]);
    for (i, b) in inputs.iter().rev().enumerate() {
        if b.len() < range.end {
            return Err(Error::Invalid("ranks passed different lengths".into()));
        }
        b.load_f32(range.start, &mut x);
        if i == 0 {
            acc.copy_from_slice(&x);
        } else {
            crate::comm::local::kernels::combine_f32(&mut acc, &x, op);
        }
    }
    crate::comm::local::kernels::finish(&mut acc, op, inputs.len());
    let mut out = FlatBuf::zeros(first.dtype(), n);
    out.store_f32(0, &acc);
    Ok(out)
}
