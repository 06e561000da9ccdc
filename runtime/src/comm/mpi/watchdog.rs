//! The deadline of the blocking data phase. MPI cannot cancel a collective, and a blocking
//! call on the caller's buffers cannot return early without MPI still writing into them, so
//! a data phase that outlives the timeout ends the job instead of hanging it: the watchdog
//! names the collective, the rank and the wait on stderr, then acts (for MPI: `MPI_Abort`).
//!
//! Arming costs two atomic stores; a thread per communicator wakes a few times per timeout
//! to look, so nothing is signalled per call.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// What the watchdog reports when a data phase outlives its timeout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expired {
    /// The collective.
    pub op: &'static str,
    /// How long it had been running when noticed.
    pub waited: Duration,
}

struct Shared {
    /// Nanoseconds since `epoch` at which the armed call started, plus one; 0 when idle.
    armed_at: AtomicU64,
    /// The armed call's name.
    op: Mutex<&'static str>,
    /// Cleared when the owner drops the watchdog; the thread then exits.
    alive: AtomicBool,
    epoch: Instant,
}

/// One communicator's watchdog.
pub struct Watchdog {
    shared: Arc<Shared>,
}

/// Disarms on drop.
pub struct Armed<'a>(&'a Watchdog);

impl Drop for Armed<'_> {
    fn drop(&mut self) {
        self.0.shared.armed_at.store(0, Ordering::Release);
    }
}

impl Watchdog {
    /// A watchdog without a thread: arming it does nothing (used where no thread could be
    /// started; the data phase then has no deadline).
    pub fn inactive() -> Watchdog {
        Watchdog {
            shared: Arc::new(Shared {
                armed_at: AtomicU64::new(0),
                op: Mutex::new(""),
                alive: AtomicBool::new(false),
                epoch: Instant::now(),
            }),
        }
    }

    /// Starts a watchdog that calls `on_expire` (once) when an armed call runs longer than
    /// `timeout`. Checks every `timeout / 8` (between 10 ms and 1 s).
    pub fn start(
        timeout: Duration,
        on_expire: impl FnOnce(Expired) + Send + 'static,
    ) -> std::io::Result<Watchdog> {
        let shared = Arc::new(Shared {
            armed_at: AtomicU64::new(0),
            op: Mutex::new(""),
            alive: AtomicBool::new(true),
            epoch: Instant::now(),
        });
        let s = Arc::clone(&shared);
        let period = (timeout / 8).clamp(Duration::from_millis(10), Duration::from_secs(1));
        std::thread::Builder::new()
            .name("fz-mpi-watchdog".into())
            .spawn(move || {
                while s.alive.load(Ordering::Acquire) {
                    std::thread::park_timeout(period);
                    let at = s.armed_at.load(Ordering::Acquire);
                    if at == 0 {
                        continue;
                    }
                    let started = Duration::from_nanos(at - 1);
                    let waited = s.epoch.elapsed().saturating_sub(started);
                    if waited > timeout && s.alive.load(Ordering::Acquire) {
                        let op = *s.op.lock().unwrap_or_else(PoisonError::into_inner);
                        on_expire(Expired { op, waited });
                        return;
                    }
                }
            })?;
        Ok(Watchdog { shared })
    }

    /// Marks the start of a blocking call named `op`; the call is watched until the
    /// returned guard drops.
    pub fn arm(&self, op: &'static str) -> Armed<'_> {
        *self
            .shared
            .op
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = op;
        let now = self.shared.epoch.elapsed().as_nanos() as u64;
        self.shared.armed_at.store(now + 1, Ordering::Release);
        Armed(self)
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.shared.alive.store(false, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc::channel;

    #[test]
    fn a_call_that_outlives_the_timeout_is_reported_with_its_name() {
        let (tx, rx) = channel();
        let w = Watchdog::start(Duration::from_millis(50), move |e| {
            tx.send(e).unwrap();
        })
        .unwrap();
        let armed = w.arm("all_reduce");
        let e = rx.recv_timeout(Duration::from_secs(10)).expect("reported");
        assert_eq!(e.op, "all_reduce");
        assert!(e.waited > Duration::from_millis(50), "{e:?}");
        drop(armed);
    }

    #[test]
    fn calls_that_finish_in_time_are_never_reported() {
        let (tx, rx) = channel();
        // Short calls against a long timeout, so that a loaded machine cannot stretch one
        // call past it.
        let w = Watchdog::start(Duration::from_secs(2), move |e| {
            tx.send(e).unwrap();
        })
        .unwrap();
        let start = Instant::now();
        while start.elapsed() < Duration::from_millis(600) {
            let _a = w.arm("barrier");
            std::thread::sleep(Duration::from_millis(2));
        }
        assert!(rx.recv_timeout(Duration::from_millis(600)).is_err());
    }
}
