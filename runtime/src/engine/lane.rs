//! The engine's schedule vocabulary, host arm: a [`Lane`] runs submitted work in submission
//! order on its own thread (a CUDA stream's contract, kept by a thread queue), [`Lane::record`]
//! marks a point in that order as an [`Event`], and [`Lane::wait`] makes later work on another
//! lane start only after that point. Results come back through [`Ticket::wait`].
//!
//! The optimizer lane (`optimizer_overlap.rs`) is one lane; the communication worker
//! (`comm::worker`) is another of the same shape, with a communicator lent to each job.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use crate::{Error, Result};

type Job = Box<dyn FnOnce() + Send>;

/// An ordered queue of work on its own thread.
pub struct Lane {
    tx: Option<Sender<Job>>,
    thread: Option<JoinHandle<()>>,
    name: String,
}

impl std::fmt::Debug for Lane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lane").field("name", &self.name).finish()
    }
}

/// The result of one job on a lane; [`Ticket::wait`] blocks until it ran.
#[derive(Debug)]
#[must_use = "a submitted job must be waited on to get its result (and its buffers) back"]
pub struct Ticket<T> {
    rx: Receiver<Result<T>>,
    op: &'static str,
    lane: String,
}

impl<T> Ticket<T> {
    /// Waits for the job and returns its result, or an error naming the lane when its thread
    /// stopped before running it (a panic in an earlier job).
    pub fn wait(self) -> Result<T> {
        self.rx.recv().unwrap_or_else(|_| {
            Err(Error::Invalid(format!(
                "{}: the lane `{}` stopped before running it",
                self.op, self.lane
            )))
        })
    }
}

/// A point in a lane's order: complete once every job submitted before it has finished.
#[derive(Debug, Clone)]
pub struct Event {
    state: Arc<(Mutex<bool>, Condvar)>,
}

impl Event {
    /// An event that is already complete (the origin of every lane's order).
    pub fn complete() -> Self {
        let e = Self::pending();
        e.signal();
        e
    }

    fn pending() -> Self {
        Self {
            state: Arc::new((Mutex::new(false), Condvar::new())),
        }
    }

    fn signal(&self) {
        let (done, cv) = &*self.state;
        *done.lock().unwrap_or_else(|p| p.into_inner()) = true;
        cv.notify_all();
    }

    /// Whether the work before the event has finished.
    pub fn is_complete(&self) -> bool {
        *self.state.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Blocks the calling thread until the event is complete (a host wait).
    pub fn synchronize(&self) {
        let (done, cv) = &*self.state;
        let mut d = done.lock().unwrap_or_else(|p| p.into_inner());
        while !*d {
            d = cv.wait(d).unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// Completes its event when dropped, so an event whose lane stopped before reaching it
/// still completes (the lost work reports through its tickets) and no waiter hangs.
struct Signal(Event);

impl Drop for Signal {
    fn drop(&mut self) {
        self.0.signal();
    }
}

impl Lane {
    /// A lane on a new thread named `name`.
    pub fn new(name: &str) -> Result<Self> {
        let (tx, rx) = channel::<Job>();
        let thread = std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || {
                for job in rx {
                    job();
                }
            })
            .map_err(|source| Error::Io {
                context: format!("spawning the lane `{name}`"),
                source,
            })?;
        Ok(Self {
            tx: Some(tx),
            thread: Some(thread),
            name: name.to_string(),
        })
    }

    /// The lane's name (its thread's).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Queues `f` after everything submitted so far; `op` names it in errors.
    pub fn submit<T: Send + 'static>(
        &self,
        op: &'static str,
        f: impl FnOnce() -> Result<T> + Send + 'static,
    ) -> Ticket<T> {
        let (tx, rx) = channel();
        self.push(Box::new(move || {
            // A waiter that gave up on the result is not an error for the lane.
            let _ = tx.send(f());
        }));
        Ticket {
            rx,
            op,
            lane: self.name.clone(),
        }
    }

    /// An event that completes when every job submitted so far has finished.
    pub fn record(&self) -> Event {
        let e = Event::pending();
        let signal = Signal(e.clone());
        self.push(Box::new(move || drop(signal)));
        e
    }

    /// Makes every job submitted after this call wait for `event` (recorded on any lane).
    pub fn wait(&self, event: &Event) {
        let e = event.clone();
        self.push(Box::new(move || e.synchronize()));
    }

    fn push(&self, job: Job) {
        // If the thread is gone the job is dropped here: its ticket reports the stopped lane
        // and its event signals, so nobody waits for it.
        if let Some(q) = &self.tx {
            let _ = q.send(job);
        }
    }
}

impl Drop for Lane {
    /// Lets queued work finish, then joins the thread.
    fn drop(&mut self) {
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    #[test]
    fn jobs_run_in_submission_order() {
        let lane = Lane::new("t-order").unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        let tickets: Vec<_> = (0..8)
            .map(|i| {
                let log = log.clone();
                lane.submit("push", move || {
                    // Earlier jobs sleep longer: only the queue can keep the order.
                    std::thread::sleep(Duration::from_millis(8 - i as u64));
                    log.lock().unwrap().push(i);
                    Ok(i)
                })
            })
            .collect();
        let got: Vec<_> = tickets.into_iter().map(|t| t.wait().unwrap()).collect();
        assert_eq!(got, (0..8).collect::<Vec<_>>());
        assert_eq!(*log.lock().unwrap(), (0..8).collect::<Vec<_>>());
    }

    #[test]
    fn a_lane_waits_for_an_event_recorded_on_another() {
        let (a, b) = (Lane::new("t-a").unwrap(), Lane::new("t-b").unwrap());
        let n = Arc::new(AtomicUsize::new(0));
        let n1 = n.clone();
        let slow = a.submit("slow", move || {
            std::thread::sleep(Duration::from_millis(50));
            n1.store(1, Ordering::SeqCst);
            Ok(())
        });
        let e = a.record();
        b.wait(&e);
        let n2 = n.clone();
        // Without the wait this would read 0: `slow` is still sleeping.
        let seen = b.submit("read", move || Ok(n2.load(Ordering::SeqCst)));
        assert_eq!(seen.wait().unwrap(), 1);
        slow.wait().unwrap();
        e.synchronize();
        assert!(e.is_complete());
        assert!(Event::complete().is_complete());
    }

    #[test]
    fn a_stopped_lane_reports_and_its_events_still_complete() {
        let lane = Lane::new("t-stop").unwrap();
        let boom: Ticket<()> = lane.submit("boom", || panic!("job panicked"));
        let after = lane.submit("after", || Ok(()));
        let e = lane.record();
        assert!(boom.wait().is_err());
        let err = after.wait().unwrap_err().to_string();
        assert!(err.contains("t-stop") && err.contains("after"), "{err}");
        e.synchronize();
    }
}
