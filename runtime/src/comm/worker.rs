//! Asynchronous collectives: a [`CommWorker`] owns a communicator on its own thread and runs
//! submitted collectives in submission order, so the engine can overlap communication with
//! compute (DeepSpeed's `overlap_comm`). Buffers are moved in and handed back by
//! [`Pending::wait`].

use std::sync::mpsc::{channel, Receiver, Sender};
use std::thread::JoinHandle;

use super::{Communicator, ReduceOp};
use crate::{Error, Result};

/// An owned buffer of a communicable dtype (the engine's flat buffer type).
pub use crate::tensor::FlatBuf as OwnedBuf;

type Job = Box<dyn FnOnce(&dyn Communicator) + Send>;

/// A collective in flight; [`Pending::wait`] blocks until it finished.
#[derive(Debug)]
#[must_use = "a submitted collective must be waited on to get its buffers back"]
pub struct Pending<T> {
    rx: Receiver<Result<T>>,
    op: &'static str,
    rank: usize,
}

impl<T> Pending<T> {
    /// Waits for the collective and returns its buffers, or its error.
    pub fn wait(self) -> Result<T> {
        self.rx.recv().unwrap_or_else(|_| {
            Err(Error::Comm {
                op: self.op,
                rank: self.rank,
                peer: None,
                elapsed: std::time::Duration::ZERO,
                reason: "the communication worker thread stopped before running it".into(),
            })
        })
    }
}

/// A communicator on its own thread. Collectives run one at a time in submission order, so
/// every rank must submit the same sequence, exactly as with direct calls.
pub struct CommWorker {
    tx: Option<Sender<Job>>,
    thread: Option<JoinHandle<()>>,
    rank: usize,
    world_size: usize,
}

impl std::fmt::Debug for CommWorker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CommWorker")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .finish()
    }
}

impl CommWorker {
    /// A worker over a duplicate of `comm` (a collective call on `comm`'s group), so that
    /// its collectives never interleave with those issued on `comm` directly.
    pub fn duplicate_of(comm: &dyn Communicator) -> Result<Self> {
        Self::new(comm.duplicate()?)
    }

    /// A worker that owns `comm`.
    pub fn new(comm: Box<dyn Communicator>) -> Result<Self> {
        let (rank, world_size) = (comm.rank(), comm.world_size());
        let (tx, rx) = channel::<Job>();
        let thread = std::thread::Builder::new()
            .name(format!("fz-comm-{rank}"))
            .spawn(move || {
                for job in rx {
                    job(&*comm);
                }
            })
            .map_err(|source| Error::Io {
                context: "spawning the communication worker".into(),
                source,
            })?;
        Ok(Self {
            tx: Some(tx),
            thread: Some(thread),
            rank,
            world_size,
        })
    }

    /// This rank in the worker's group.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the worker's group.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Queues any sequence of collectives as one job (`op` names it in errors) and returns
    /// the handle to its result; the engine uses it to run a bucketed reduction as a unit.
    pub fn submit<T: Send + 'static>(
        &self,
        op: &'static str,
        f: impl FnOnce(&dyn Communicator) -> Result<T> + Send + 'static,
    ) -> Pending<T> {
        let (tx, rx) = channel();
        let job: Job = Box::new(move |c| {
            // A waiter that gave up on the result is not an error for the worker.
            let _ = tx.send(f(c));
        });
        // If the worker thread is gone, `job` (and its sender) is dropped here and `wait`
        // reports the stopped worker.
        if let Some(q) = &self.tx {
            let _ = q.send(job);
        }
        Pending {
            rx,
            op,
            rank: self.rank,
        }
    }

    /// Asynchronous [`Communicator::all_reduce`]; `wait` returns the reduced buffer.
    pub fn all_reduce(&self, mut buf: OwnedBuf, op: ReduceOp) -> Pending<OwnedBuf> {
        self.submit("all_reduce", move |c| {
            c.all_reduce(buf.as_mut(), op).map(|()| buf)
        })
    }

    /// Asynchronous [`Communicator::reduce_scatter`]; `wait` returns `(input, output)`.
    pub fn reduce_scatter(
        &self,
        input: OwnedBuf,
        mut output: OwnedBuf,
        op: ReduceOp,
    ) -> Pending<(OwnedBuf, OwnedBuf)> {
        self.submit("reduce_scatter", move |c| {
            c.reduce_scatter(input.as_ref(), output.as_mut(), op)
                .map(|()| (input, output))
        })
    }

    /// Asynchronous [`Communicator::all_gather`]; `wait` returns `(input, output)`.
    pub fn all_gather(
        &self,
        input: OwnedBuf,
        mut output: OwnedBuf,
    ) -> Pending<(OwnedBuf, OwnedBuf)> {
        self.submit("all_gather", move |c| {
            c.all_gather(input.as_ref(), output.as_mut())
                .map(|()| (input, output))
        })
    }

    /// Asynchronous [`Communicator::broadcast`]; `wait` returns the buffer.
    pub fn broadcast(&self, mut buf: OwnedBuf, root: usize) -> Pending<OwnedBuf> {
        self.submit("broadcast", move |c| {
            c.broadcast(buf.as_mut(), root).map(|()| buf)
        })
    }

    /// Asynchronous [`Communicator::barrier`].
    pub fn barrier(&self) -> Pending<()> {
        self.submit("barrier", |c| c.barrier())
    }
}

impl Drop for CommWorker {
    /// Lets queued collectives finish, then joins the thread (its communicator is dropped
    /// there, which tells the peers this rank left).
    fn drop(&mut self) {
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
