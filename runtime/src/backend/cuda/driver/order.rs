//! The emulator's check of the order between streams of different devices of one process.
//!
//! Emulated streams run every operation when it is issued, so a missing event wait never shows
//! as stale data here; on a GPU it would. This book makes it an error instead, with vector
//! clocks: every stream counts what it issued; an event remembers what its stream (and,
//! through earlier waits, other streams) had issued when it was recorded; a stream that waits
//! for it inherits that knowledge; a host synchronisation marks work finished for everyone.
//!
//! Two rules, both about memory one stream touches on behalf of another:
//! - an access through [`Driver::copy_unified`](super::Driver::copy_unified) (a peer copy) on
//!   stream X to memory of device D must be ordered after everything D's compute stream has
//!   issued (X waited for an event recorded after it, or the host saw it finish);
//! - D's compute stream, before its next operation, must be ordered after every such access
//!   to D's memory by another stream (or the host saw that stream finish).
//!
//! So the local communicator's owner keeps its compute stream quiet while peers use its
//! buffers, as it does: it is blocked inside the collective until it waited for them.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, OnceLock};

use super::StreamKind;
use crate::{Error, Result};

/// A stream: (driver id, [`StreamKind::index`]).
type Sid = (u64, usize);

/// What is known to have happened before a point: per stream, the count of its operations.
type Clock = HashMap<Sid, u64>;

#[derive(Debug, Default)]
struct Stream {
    issued: u64,
    /// Operations the host saw finish.
    done: u64,
    seen: Clock,
}

#[derive(Debug, Default)]
struct Book {
    streams: HashMap<Sid, Stream>,
    /// Recorded events by (driver id, event id): the recording stream's knowledge.
    events: HashMap<(u64, u64), Clock>,
    /// Per driver: accesses to its memory by other streams, the latest per stream.
    touched: HashMap<u64, Clock>,
}

const COMPUTE: usize = 0;

fn book() -> MutexGuard<'static, Book> {
    static BOOK: OnceLock<Mutex<Book>> = OnceLock::new();
    BOOK.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

fn name(s: Sid) -> String {
    let k = StreamKind::ALL
        .get(s.1)
        .map_or_else(|| format!("#{}", s.1), |k| format!("{k:?}"));
    format!("emulated device {}'s {k} stream", s.0)
}

impl Book {
    fn stream(&mut self, s: Sid) -> &mut Stream {
        self.streams.entry(s).or_default()
    }

    /// Whether operation `pos` of stream `of` happens before what stream `x` issues next.
    fn covered(&self, x: Sid, of: Sid, pos: u64) -> bool {
        if x == of || pos == 0 {
            return true;
        }
        let done = self.streams.get(&of).map_or(0, |s| s.done);
        let seen = self
            .streams
            .get(&x)
            .and_then(|s| s.seen.get(&of))
            .copied()
            .unwrap_or(0);
        done >= pos || seen >= pos
    }

    /// Counts an operation on `s`; on a compute stream, first checks the second rule.
    fn issue(&mut self, s: Sid) -> Result<u64> {
        if s.1 == COMPUTE {
            let touched = self.touched.remove(&s.0).unwrap_or_default();
            let late: Vec<_> = touched
                .iter()
                .filter(|&(&of, &pos)| !self.covered(s, of, pos))
                .map(|(&of, &pos)| (of, pos))
                .collect();
            if let Some(&(of, pos)) = late.first() {
                self.touched.insert(s.0, touched);
                return Err(order_error(format!(
                    "{} issued work without waiting for operation {pos} of {}, which \
                     accessed this device's memory",
                    name(s),
                    name(of)
                )));
            }
        }
        let st = self.stream(s);
        st.issued += 1;
        Ok(st.issued)
    }
}

fn order_error(detail: String) -> Error {
    Error::Device {
        op: "stream order (emulator)".into(),
        detail: format!("unordered access between streams: {detail}"),
    }
}

/// Counts an operation of driver `id` on stream `s` (see the module documentation).
pub(super) fn issue(id: u64, s: StreamKind) -> Result<()> {
    book().issue((id, s.index())).map(|_| ())
}

/// A peer copy of driver `id` on stream `s` touching memory of drivers `owners`.
pub(super) fn access(id: u64, s: StreamKind, owners: [u64; 2]) -> Result<()> {
    let mut b = book();
    let x = (id, s.index());
    for owner in owners {
        let of = (owner, COMPUTE);
        let pos = b.streams.get(&of).map_or(0, |s| s.issued);
        if !b.covered(x, of, pos) {
            return Err(order_error(format!(
                "{} copies memory of emulated device {owner} without waiting for operation \
                 {pos} of {}",
                name(x),
                name(of)
            )));
        }
    }
    let pos = b.issue(x)?;
    for owner in owners {
        if x != (owner, COMPUTE) {
            let t = b.touched.entry(owner).or_default().entry(x).or_default();
            *t = (*t).max(pos);
        }
    }
    Ok(())
}

/// Event `e` of driver `id` recorded on stream `s`.
pub(super) fn record(id: u64, s: StreamKind, e: u64) {
    let mut b = book();
    let x = (id, s.index());
    let st = b.stream(x);
    let mut clock = st.seen.clone();
    clock.insert(x, st.issued);
    b.events.insert((id, e), clock);
}

/// Stream `s` of driver `id` waits for event `e` of driver `owner`.
pub(super) fn wait(id: u64, s: StreamKind, owner: u64, e: u64) {
    let mut b = book();
    let Some(clock) = b.events.get(&(owner, e)).cloned() else {
        return;
    };
    let seen = &mut b.stream((id, s.index())).seen;
    for (of, pos) in clock {
        let v = seen.entry(of).or_default();
        *v = (*v).max(pos);
    }
}

/// The host saw stream `s` of driver `id` finish what it issued.
pub(super) fn synchronized(id: u64, s: StreamKind) {
    let mut b = book();
    let st = b.stream((id, s.index()));
    st.done = st.issued;
}

/// The host saw event `e` of driver `id` complete.
pub(super) fn event_synchronized(id: u64, e: u64) {
    let mut b = book();
    let Some(clock) = b.events.get(&(id, e)).cloned() else {
        return;
    };
    for (of, pos) in clock {
        let st = b.stream(of);
        st.done = st.done.max(pos);
    }
}

/// Event `e` of driver `id` destroyed (streams that waited keep what they learnt).
pub(super) fn destroyed(id: u64, e: u64) {
    book().events.remove(&(id, e));
}

/// Driver `id` is gone: forget its streams and events.
pub(super) fn closed(id: u64) {
    let mut b = book();
    b.streams.retain(|s, _| s.0 != id);
    b.events.retain(|s, _| s.0 != id);
    b.touched.remove(&id);
}
