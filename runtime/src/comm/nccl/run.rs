//! How [`NcclComm`] runs a collective and learns that it finished: it waits until the
//! library has queued it; an op on a device's stream is then left running (its order with
//! the device's other work is kept by events, `device.rs`) and settled at the next point the
//! host must know: the communicator's next collective, a split, [`Communicator::fence`] or
//! the communicator's end. Any other op (host buffers) is polled to completion at once.
//! Either way a failure is reported within `comms.timeout` of the host starting to wait,
//! naming the collective, its number and the rank at fault.
//!
//! [`Communicator::fence`]: crate::comm::Communicator::fence

use std::time::{Duration, Instant};

use super::device::{device_of, End};
use super::{NcclComm, NcclOp, Poll};
use crate::{Error, Result};

/// A collective left running on a device's stream.
pub(super) struct Pending {
    op: &'static str,
    seq: u64,
    start: Instant,
    end: End,
}

impl NcclComm {
    /// Runs one collective: settles the one before it, starts this one, waits until it is
    /// queued; polls it to completion unless it runs on a device's stream.
    pub(super) fn run(&self, mut op: NcclOp<'_>) -> Result<()> {
        if let (crate::tensor::View::Meta(_), _) | (_, crate::tensor::View::Meta(_)) = op.views() {
            return Err(crate::Error::Invalid(format!(
                "nccl {}: meta (size-only) buffers have no values to exchange; a size-only run \
                 uses comm::meta::MetaComm",
                op.name()
            )));
        }
        self.settle()?;
        let name = op.name();
        let start = Instant::now();
        if let Some(reason) = self.broken.borrow().clone() {
            return Err(crate::comm::failure(self.rank, name, None, start, reason));
        }
        let seq = self.seq.get() + 1;
        self.seq.set(seq);
        let dev = device_of(&op);
        if let Some(Err(e)) = dev.as_ref().map(|d| self.marks.before(d)) {
            return Err(self.fail(name, seq, start, Some(e.to_string())));
        }
        let mut h = self.handle.borrow_mut();
        if let Err(e) = h.start(&mut op) {
            drop(h);
            return Err(self.fail(name, seq, start, Some(e.to_string())));
        }
        let timeout = self.opts.timeout;
        let outcome = match (
            poll_until(timeout, start, || h.poll_enqueued(&mut op)),
            &dev,
        ) {
            (Poll::Done, Some(d)) => match self.marks.after(d) {
                Ok(end) => {
                    let p = Pending {
                        op: name,
                        seq,
                        start,
                        end,
                    };
                    *self.pending.borrow_mut() = Some(p);
                    return Ok(());
                }
                Err(e) => Poll::Failed(e.to_string()),
            },
            (Poll::Done, None) => poll_until(timeout, start, || h.poll(Some(&mut op))),
            (other, _) => other,
        };
        drop(h);
        self.conclude(name, seq, start, outcome)
    }

    /// Waits until the collective left running on a device's stream, if any, has finished:
    /// within the timeout, counted from now (the device may have had queued work before it).
    pub(super) fn settle(&self) -> Result<()> {
        let Some(p) = self.pending.borrow_mut().take() else {
            return Ok(());
        };
        let mut h = self.handle.borrow_mut();
        let outcome = poll_until(self.opts.timeout, Instant::now(), || match h.poll(None) {
            Poll::Done => match p.end.finished() {
                Ok(true) => Poll::Done,
                Ok(false) => Poll::Pending,
                Err(e) => Poll::Failed(format!("the device failed while NCCL ran: {e}")),
            },
            other => other,
        });
        drop(h);
        self.conclude(p.op, p.seq, p.start, outcome)
    }

    /// A finished wait as the result of collective `seq`.
    fn conclude(&self, op: &'static str, seq: u64, start: Instant, outcome: Poll) -> Result<()> {
        match outcome {
            Poll::Done => Ok(()),
            Poll::Failed(reason) => Err(self.fail(op, seq, start, Some(reason))),
            Poll::Pending => Err(self.fail(op, seq, start, None)),
        }
    }

    /// Aborts the communicator and turns what this rank and its peers saw of collective
    /// `seq` into one error.
    pub(super) fn fail(
        &self,
        op: &'static str,
        seq: u64,
        start: Instant,
        reason: Option<String>,
    ) -> Error {
        self.handle.borrow_mut().abort();
        let verdict = self.board.report(seq, reason.as_deref(), self.opts.timeout);
        let why = match &reason {
            Some(r) => format!("NCCL error: {r}; {}", verdict.text),
            None => format!(
                "no progress within comms.timeout = {:?}; {}",
                self.opts.timeout, verdict.text
            ),
        };
        *self.broken.borrow_mut() = Some(format!("communicator aborted after {op}: {why}"));
        crate::comm::failure(self.rank, op, verdict.culprit, start, why)
    }
}

/// Polls until `poll` is no longer pending, or `timeout` has passed since `since` (then
/// [`Poll::Pending`]).
pub(super) fn poll_until(
    timeout: Duration,
    since: Instant,
    mut poll: impl FnMut() -> Poll,
) -> Poll {
    loop {
        match poll() {
            Poll::Pending if since.elapsed() < timeout => backoff(since),
            p => return p,
        }
    }
}

/// Waits between polls: spins briefly (small collectives finish in microseconds), then
/// sleeps a little longer each time, up to a millisecond.
fn backoff(start: Instant) {
    let waited = start.elapsed();
    if waited < Duration::from_micros(50) {
        std::hint::spin_loop();
    } else if waited < Duration::from_millis(2) {
        std::thread::yield_now();
    } else {
        std::thread::sleep(Duration::from_millis(1).min(waited / 16));
    }
}
