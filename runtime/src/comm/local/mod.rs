//! `local`: N ranks as threads of one process, collectives over shared memory.
//!
//! Every collective is one entry barrier (ranks publish their buffer addresses and what they
//! called), a data phase in which rank r alone computes chunk r of the result directly from
//! and into its peers' buffers, and a release barrier. Chunk r of an all-reduce is summed
//! over ranks 0, 1, ... in that order and written to every rank's buffer in the same pass,
//! so each element is read and written once per rank: the minimum memory traffic, with no
//! staging copy and no heap allocation per call. The reduction order never depends on thread
//! timing, so results are reproducible bit for bit.
//!
//! Device buffers (ranks as threads on one or several GPUs) go through the same barriers;
//! in the data phase rank r computes chunk r on its own device (`device.rs`): explicit copies
//! between the ranks' device memory and the same rank-ordered f32 arithmetic in kernels, so
//! host and device collectives give the same bits.

pub(crate) mod desc;
#[cfg(feature = "cuda")]
mod device;
#[cfg(not(feature = "cuda"))]
#[path = "no_device.rs"]
mod device;
mod group;
pub(crate) mod kernels;
mod ops;
mod ranks;

use std::cell::{Cell, RefCell};
use std::sync::Arc;
use std::time::{Duration, Instant};

use desc::{Desc, OpKind};
use group::{Abort, Departure, Group, Phase};

pub use ranks::run_ranks;
pub(crate) use ranks::{open, run_each};

use crate::{Error, Result};

/// One rank of an in-process group. Create a whole group with [`LocalComm::group`] and move
/// each communicator to its own thread (or use [`run_ranks`]).
pub struct LocalComm {
    group: Arc<Group>,
    rank: usize,
    /// Collectives entered so far: part of each announcement, so that ranks that got out of
    /// step are told so.
    seq: Cell<u64>,
    /// Copy of every rank's announcement for the running collective, reused across calls.
    peers: RefCell<Vec<Desc>>,
    /// The device events this rank's device collectives are ordered by (none without CUDA).
    #[cfg(feature = "cuda")]
    marks: device::Marks,
}

impl std::fmt::Debug for LocalComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalComm")
            .field("rank", &self.rank)
            .field("world_size", &self.group.n)
            .field("timeout", &self.group.timeout)
            .finish()
    }
}

impl LocalComm {
    /// A group of `world_size` ranks whose collectives fail after `timeout` without
    /// progress; element `r` is rank `r`. An empty vector for a world size of 0.
    pub fn group(world_size: usize, timeout: Duration) -> Vec<LocalComm> {
        let group = Group::new(world_size, timeout);
        (0..world_size)
            .map(|rank| LocalComm::member(Arc::clone(&group), rank))
            .collect()
    }

    fn member(group: Arc<Group>, rank: usize) -> Self {
        let n = group.n;
        Self {
            group,
            rank,
            seq: Cell::new(0),
            peers: RefCell::new(vec![Desc::bare(0, OpKind::Barrier); n]),
            #[cfg(feature = "cuda")]
            marks: device::Marks::default(),
        }
    }

    /// The per-collective timeout.
    pub fn timeout(&self) -> Duration {
        self.group.timeout
    }

    /// A descriptor for this rank's next collective.
    fn next_desc(&self, op: OpKind) -> Desc {
        let seq = self.seq.get();
        self.seq.set(seq + 1);
        Desc::bare(seq, op)
    }

    /// Runs the entry barrier for `desc`; on success the peers' announcements are in
    /// `self.peers`.
    fn enter(&self, desc: Desc, start: Instant) -> Result<()> {
        let deadline = start.checked_add(self.group.timeout);
        let st = self
            .group
            .arrive(self.rank, Phase::Entry, desc, deadline)
            .map_err(|a| self.abort_error(desc.op, &a, start))?;
        if let Err(m) = &st.verdict {
            let reason = format!("mismatched collectives: {}", m.reason);
            let (op, culprit) = (desc.op.name(), Some(m.rank));
            let abort = Abort {
                op,
                culprit,
                detector: self.rank,
                reason: reason.clone(),
            };
            let mut st = st;
            self.group.abort(&mut st, abort);
            return Err(self.error(desc.op, culprit, start, reason));
        }
        self.peers.borrow_mut().copy_from_slice(&st.descs);
        Ok(())
    }

    /// Runs the release barrier: returns once no peer can touch this rank's buffers.
    fn release(&self, op: OpKind, start: Instant) -> Result<()> {
        let desc = Desc::bare(0, op);
        match self.group.arrive(self.rank, Phase::Release, desc, None) {
            Ok(_) => Ok(()),
            Err(a) => Err(self.abort_error(op, &a, start)),
        }
    }

    fn error(&self, op: OpKind, peer: Option<usize>, start: Instant, reason: String) -> Error {
        crate::comm::failure(self.rank, op.name(), peer, start, reason)
    }

    /// The error this rank reports for a broken group.
    fn abort_error(&self, op: OpKind, a: &Abort, start: Instant) -> Error {
        if a.culprit == Some(self.rank) {
            let reason = format!("rank {} gave up on this rank: {}", a.detector, a.reason);
            return self.error(op, Some(a.detector), start, reason);
        }
        let reason = if a.op == op.name() {
            a.reason.clone()
        } else {
            format!("group broken since {}: {}", a.op, a.reason)
        };
        self.error(op, a.culprit, start, reason)
    }

    /// Creates this rank's sub-group communicator (collective).
    fn child(
        &self,
        op: OpKind,
        color: usize,
        key: usize,
    ) -> Result<Box<dyn crate::comm::Communicator>> {
        let start = Instant::now();
        let mut desc = self.next_desc(op);
        desc.root = color;
        desc.key = key;
        self.enter(desc, start)?;
        let mut st = self.group.lock();
        let child = st.children[self.rank].take();
        drop(st);
        match child {
            Some((group, rank)) => Ok(Box::new(LocalComm::member(group, rank))),
            None => Err(self.error(op, None, start, "no sub-group was created".into())),
        }
    }
}

impl Drop for LocalComm {
    fn drop(&mut self) {
        let how = if std::thread::panicking() {
            Departure::Panicked
        } else {
            Departure::Dropped
        };
        self.group.depart(self.rank, how);
    }
}
