//! SIGINT/SIGTERM capture in the launcher (the handler only records the signal) and their
//! forwarding to the ranks.

use std::process::Child;
use std::sync::atomic::{AtomicI32, Ordering};

static PENDING: AtomicI32 = AtomicI32::new(0);

extern "C" fn record(sig: libc::c_int) {
    // Only an atomic store: async-signal-safe.
    PENDING.store(sig, Ordering::SeqCst);
}

/// Routes SIGINT and SIGTERM to the recorder instead of terminating the launcher, so that
/// it can pass them on and still reap its ranks.
pub(super) fn install() {
    let handler = record as extern "C" fn(libc::c_int) as libc::sighandler_t;
    // SAFETY: `record` is async-signal-safe; installing a handler has no other precondition.
    unsafe {
        libc::signal(libc::SIGINT, handler);
        libc::signal(libc::SIGTERM, handler);
    }
}

/// The signal received since the last call, if any.
pub(super) fn take() -> Option<i32> {
    match PENDING.swap(0, Ordering::SeqCst) {
        0 => None,
        s => Some(s),
    }
}

/// Sends `sig` to every rank that is still running.
pub(super) fn forward(ranks: &mut [(usize, Child)], sig: i32) {
    for (_, c) in ranks.iter_mut() {
        if matches!(c.try_wait(), Ok(None)) {
            if let Ok(pid) = libc::pid_t::try_from(c.id()) {
                // SAFETY: plain syscall on a child we have not reaped, so the pid is ours.
                unsafe { libc::kill(pid, sig) };
            }
        }
    }
}
