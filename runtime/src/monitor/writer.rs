//! The monitor's writer thread: a step hands its scalars over a channel and goes on, so a
//! slow disk never holds training up. The thread buffers, flushes when asked (every
//! `steps_per_print` steps), at shutdown, and on SIGINT/SIGTERM before letting the signal
//! end the process as it would have.

use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use super::sinks::Sink;
use crate::{Error, Result};

enum Msg {
    Scalars {
        step: u64,
        wall_time: f64,
        scalars: Vec<(String, f64)>,
    },
    Flush,
}

/// The writer thread's handle; dropping it flushes and joins.
pub(super) struct Writer {
    tx: Option<Sender<Msg>>,
    thread: Option<JoinHandle<()>>,
    /// The first write error, reported at the next step.
    failed: Arc<Mutex<Option<Error>>>,
}

/// How often the thread looks for a pending signal while idle.
const POLL: Duration = Duration::from_millis(50);

impl Writer {
    pub(super) fn spawn(sinks: Vec<Box<dyn Sink>>) -> Result<Self> {
        let (tx, rx) = channel::<Msg>();
        let failed = Arc::new(Mutex::new(None));
        let err = failed.clone();
        signals::register();
        let thread = std::thread::Builder::new()
            .name("ferrozero-monitor".into())
            .spawn(move || {
                let mut sinks = sinks;
                let mut run = |f: &mut dyn FnMut(&mut dyn Sink) -> Result<()>| {
                    for s in sinks.iter_mut() {
                        if let Err(e) = f(s.as_mut()) {
                            let mut slot = err.lock().unwrap_or_else(|p| p.into_inner());
                            slot.get_or_insert(e);
                        }
                    }
                };
                loop {
                    match rx.recv_timeout(POLL) {
                        Ok(Msg::Scalars {
                            step,
                            wall_time,
                            scalars,
                        }) => run(&mut |s| s.write(step, wall_time, &scalars)),
                        Ok(Msg::Flush) => run(&mut |s| s.flush()),
                        Err(RecvTimeoutError::Timeout) => {}
                        Err(RecvTimeoutError::Disconnected) => break,
                    }
                    if let Some(sig) = signals::pending() {
                        run(&mut |s| s.flush());
                        signals::flushed(sig);
                    }
                }
                run(&mut |s| s.flush());
            })
            .map_err(|e| Error::Io {
                context: "starting the monitor's writer thread".into(),
                source: e,
            });
        let thread = match thread {
            Ok(t) => t,
            Err(e) => {
                signals::unregister();
                return Err(e);
            }
        };
        Ok(Writer {
            tx: Some(tx),
            thread: Some(thread),
            failed,
        })
    }

    /// Queues one step's scalars; fails with the first earlier write error, if any.
    pub(super) fn write(
        &self,
        step: u64,
        wall_time: f64,
        scalars: Vec<(String, f64)>,
    ) -> Result<()> {
        if let Some(e) = self.failed.lock().unwrap_or_else(|p| p.into_inner()).take() {
            return Err(e);
        }
        self.send(Msg::Scalars {
            step,
            wall_time,
            scalars,
        });
        Ok(())
    }

    /// Asks the thread to flush (it does not wait for the disk).
    pub(super) fn flush(&self) {
        self.send(Msg::Flush);
    }

    fn send(&self, m: Msg) {
        // The thread only exits once the sender is dropped, so a send cannot fail while we
        // hold it; a panic in a sink would show as a lost message, and the join reports it.
        if let Some(tx) = &self.tx {
            let _ = tx.send(m);
        }
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        drop(self.tx.take());
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                tracing::error!("the monitor's writer thread panicked; its last scalars are lost");
            }
        }
        if let Some(e) = self.failed.lock().unwrap_or_else(|p| p.into_inner()).take() {
            tracing::error!("monitor: {e}");
        }
        signals::unregister();
    }
}

/// SIGINT/SIGTERM while writers are live: the handler records the signal; every writer thread
/// flushes, and the last one to do so restores the default action and raises the signal
/// again, so the process ends as it would have, with its monitor files complete. The handler
/// is installed only over the default action (a program's own handler is left alone).
mod signals {
    use super::*;

    static PENDING: AtomicI32 = AtomicI32::new(0);
    static FLUSHED: AtomicUsize = AtomicUsize::new(0);
    static LIVE: Mutex<(usize, bool)> = Mutex::new((0, false));

    extern "C" fn record(sig: libc::c_int) {
        // Only an atomic store: async-signal-safe.
        PENDING.store(sig, Ordering::SeqCst);
    }

    fn default_action(sig: libc::c_int) -> bool {
        // SAFETY: querying the disposition (a null new action) changes nothing.
        unsafe {
            let mut old: libc::sigaction = std::mem::zeroed();
            libc::sigaction(sig, std::ptr::null(), &mut old) == 0
                && old.sa_sigaction == libc::SIG_DFL
        }
    }

    pub(super) fn register() {
        let mut live = LIVE.lock().unwrap_or_else(|p| p.into_inner());
        live.0 += 1;
        if live.0 == 1 && default_action(libc::SIGINT) && default_action(libc::SIGTERM) {
            let handler = record as extern "C" fn(libc::c_int) as libc::sighandler_t;
            // SAFETY: `record` is async-signal-safe.
            unsafe {
                libc::signal(libc::SIGINT, handler);
                libc::signal(libc::SIGTERM, handler);
            }
            live.1 = true;
        }
    }

    pub(super) fn unregister() {
        let mut live = LIVE.lock().unwrap_or_else(|p| p.into_inner());
        live.0 = live.0.saturating_sub(1);
        if live.0 == 0 && live.1 {
            restore();
            live.1 = false;
        }
    }

    fn restore() {
        // SAFETY: restoring the default action has no precondition.
        unsafe {
            libc::signal(libc::SIGINT, libc::SIG_DFL);
            libc::signal(libc::SIGTERM, libc::SIG_DFL);
        }
    }

    pub(super) fn pending() -> Option<i32> {
        match PENDING.load(Ordering::SeqCst) {
            0 => None,
            s => Some(s),
        }
    }

    /// One writer has flushed after `sig`; the last re-raises it.
    pub(super) fn flushed(sig: i32) {
        let live = LIVE.lock().unwrap_or_else(|p| p.into_inner()).0;
        if FLUSHED.fetch_add(1, Ordering::SeqCst) + 1 >= live {
            restore();
            // SAFETY: raising a signal whose action is now the default ends the process.
            unsafe { libc::raise(sig) };
        }
        // Every other writer waits here for the process to end.
        std::thread::sleep(Duration::from_secs(3600));
    }
}
