//! The emulator's check of the order between streams of one process's devices.
//!
//! Emulated streams run every operation when it is issued, so a missing event wait never shows
//! as stale data here; on a GPU it would. This book makes it an error instead, with vector
//! clocks: every stream counts what it issued; an event remembers what its stream (and,
//! through earlier waits, other streams) had issued when it was recorded; a stream that waits
//! for it inherits that knowledge; a host synchronisation marks work finished for everyone.
//!
//! Two rules, about memory that a stream other than its device's compute stream touches
//! through [`Driver::copy_unified`](super::Driver::copy_unified) (a peer copy, the local
//! communicator's collective stream) or an asynchronous copy from or to the host (the copy
//! streams):
//! - the copy must be ordered after the last operation of the owner's compute stream that
//!   touched the same memory (the producer, or a reader it would overwrite);
//! - the owner's compute stream, before an operation that touches that memory again, must be
//!   ordered after the copy.
//!
//! What an operation touches: exact ranges for copies, memsets and GEMM operands; for a kernel,
//! the whole allocator buffer each of its declared pointer arguments points into (the caching
//! allocator tells the driver its buffers, [`Driver::note_buffer`](super::Driver::note_buffer)).
//! Memory reached only through a device-side descriptor (the optimizer's `OptTensor`s) is not
//! seen, so the check can miss an order there, never invent one.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Mutex, MutexGuard, OnceLock};

use super::StreamKind;
use crate::{Error, Result};

/// A stream: (driver id, [`StreamKind::index`]).
type Sid = (u64, usize);

/// What is known to have happened before a point: per stream, the count of its operations.
type Clock = HashMap<Sid, u64>;

/// Bytes `start..end` of device memory.
pub(super) type Span = (u64, u64);

/// Compute-stream operations remembered per device, beyond which the oldest are forgotten
/// (a host synchronisation forgets the finished ones first).
const HISTORY: usize = 1 << 16;

#[derive(Debug, Default)]
struct Stream {
    issued: u64,
    /// Operations the host saw finish.
    done: u64,
    seen: Clock,
}

/// An operation's touch of some memory: the stream, its position there, the bytes.
type Touch = (Sid, u64, Span);

#[derive(Debug, Default)]
struct Book {
    streams: HashMap<Sid, Stream>,
    /// Recorded events by (driver id, event id): the recording stream's knowledge.
    events: HashMap<(u64, u64), Clock>,
    /// Per driver: its compute stream's recent operations and what they touched.
    history: HashMap<u64, VecDeque<Touch>>,
    /// Per driver: touches of its memory by other streams, not yet known ordered.
    touched: HashMap<u64, Vec<Touch>>,
    /// Per driver: its allocator's buffers, start to end.
    buffers: HashMap<u64, BTreeMap<u64, u64>>,
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

fn overlap(a: Span, b: Span) -> bool {
    a.0 < b.1 && b.0 < a.1
}

fn order_error(detail: String) -> Error {
    Error::Device {
        op: "stream order (emulator)".into(),
        detail: format!("unordered access between streams: {detail}"),
    }
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

    /// Counts an operation on `s` touching `spans`; on a compute stream, first checks the
    /// second rule and remembers the touches.
    fn issue(&mut self, s: Sid, spans: &[Span]) -> Result<u64> {
        if s.1 == COMPUTE {
            let mut touched = self.touched.remove(&s.0).unwrap_or_default();
            touched.retain(|&(of, pos, _)| !self.covered(s, of, pos));
            let late = touched
                .iter()
                .find(|t| spans.iter().any(|&sp| overlap(sp, t.2)))
                .copied();
            if !touched.is_empty() {
                self.touched.insert(s.0, touched);
            }
            if let Some((of, pos, _)) = late {
                return Err(order_error(format!(
                    "{} touches memory that operation {pos} of {} accessed, without waiting \
                     for it",
                    name(s),
                    name(of)
                )));
            }
        }
        let st = self.stream(s);
        st.issued += 1;
        let (pos, done) = (st.issued, st.done);
        if s.1 == COMPUTE && !spans.is_empty() {
            let h = self.history.entry(s.0).or_default();
            while h.front().is_some_and(|t| t.1 <= done) || h.len() >= HISTORY {
                h.pop_front();
            }
            h.extend(spans.iter().map(|&sp| (s, pos, sp)));
        }
        Ok(pos)
    }

    /// The last operation of `owner`'s compute stream that touched `span`.
    fn last_touch(&self, owner: u64, span: Span) -> u64 {
        self.history.get(&owner).map_or(0, |h| {
            h.iter()
                .rev()
                .find(|t| overlap(t.2, span))
                .map_or(0, |t| t.1)
        })
    }
}

/// Counts an operation of driver `id` on stream `s` touching `spans`.
pub(super) fn issue(id: u64, s: StreamKind, spans: &[Span]) -> Result<()> {
    book().issue((id, s.index()), spans).map(|_| ())
}

/// The spans a kernel's pointer arguments reach on driver `id`: each the allocator buffer it
/// points into, else the byte it points at.
pub(super) fn reach(id: u64, ptrs: impl Iterator<Item = u64>) -> Vec<Span> {
    let b = book();
    let bufs = b.buffers.get(&id);
    ptrs.filter(|&p| p != 0)
        .map(|p| {
            bufs.and_then(|m| m.range(..=p).next_back())
                .filter(|&(_, &end)| p < end)
                .map_or((p, p + 1), |(&start, &end)| (start, end))
        })
        .collect()
}

/// `bytes` at `p` are now one buffer of driver `id`'s allocator.
pub(super) fn buffer(id: u64, p: u64, bytes: u64) {
    let mut b = book();
    let m = b.buffers.entry(id).or_default();
    let end = p + bytes.max(1);
    let stale: Vec<u64> = m
        .range(..end)
        .rev()
        .take_while(|&(_, &e)| e > p)
        .map(|(&s, _)| s)
        .collect();
    for s in stale {
        m.remove(&s);
    }
    m.insert(p, end);
}

/// A peer copy of driver `id` on stream `s`, `bytes` from `src` (memory of driver
/// `owners[0]`) to `dst` (of `owners[1]`).
pub(super) fn access(
    id: u64,
    s: StreamKind,
    (src, dst, bytes): (u64, u64, u64),
    owners: [u64; 2],
) -> Result<()> {
    let mut b = book();
    let x = (id, s.index());
    let spans = [(src, src + bytes), (dst, dst + bytes)];
    for (owner, span) in owners.into_iter().zip(spans) {
        let of = (owner, COMPUTE);
        let pos = b.last_touch(owner, span);
        if !b.covered(x, of, pos) {
            return Err(order_error(format!(
                "{} copies memory of emulated device {owner} without waiting for operation \
                 {pos} of {}, which touched it",
                name(x),
                name(of)
            )));
        }
    }
    let own: Vec<Span> = owners
        .into_iter()
        .zip(spans)
        .filter(|&(o, _)| o == id)
        .map(|(_, sp)| sp)
        .collect();
    let pos = b.issue(x, &own)?;
    for (owner, span) in owners.into_iter().zip(spans) {
        if x != (owner, COMPUTE) {
            b.touched.entry(owner).or_default().push((x, pos, span));
        }
    }
    Ok(())
}

/// A copy between host memory and `span` of driver `id`'s own memory on stream `s`. On a copy
/// stream it is held to the peer copy's two rules: a block the caching allocator hands out
/// again (home: the compute stream) may still be read or written there by work queued before.
pub(super) fn host_copy(id: u64, s: StreamKind, span: Span) -> Result<()> {
    let x = (id, s.index());
    let mut b = book();
    if x.1 == COMPUTE {
        return b.issue(x, &[span]).map(|_| ());
    }
    let of = (id, COMPUTE);
    let last = b.last_touch(id, span);
    if !b.covered(x, of, last) {
        return Err(order_error(format!(
            "{} copies device memory without waiting for operation {last} of {}, which \
             touched it",
            name(x),
            name(of)
        )));
    }
    let pos = b.issue(x, &[span])?;
    b.touched.entry(id).or_default().push((x, pos, span));
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

/// Driver `id` is gone: forget its streams, events, history and buffers.
pub(super) fn closed(id: u64) {
    let mut b = book();
    b.streams.retain(|s, _| s.0 != id);
    b.events.retain(|s, _| s.0 != id);
    b.history.remove(&id);
    b.touched.remove(&id);
    b.buffers.remove(&id);
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::super::{copy_peer, wait_peer_event, EmuDriver, EmuOptions};
    use super::*;
    use crate::backend::cuda::driver::Driver;

    fn device() -> Arc<dyn Driver> {
        Arc::new(EmuDriver::new(EmuOptions::default()).expect("emulated device"))
    }

    /// `a` produces a buffer on its compute stream; `b` copies it on its collective stream.
    fn produce(a: &dyn Driver, b: &dyn Driver) -> (super::super::DevPtr, super::super::DevPtr) {
        let (pa, pb) = (a.malloc(64).unwrap(), b.malloc(64).unwrap());
        a.memset_zero(pa, 64, StreamKind::Compute).unwrap();
        b.memset_zero(pb, 64, StreamKind::Compute).unwrap();
        (pa, pb)
    }

    fn copy(
        b: &dyn Driver,
        from: (&dyn Driver, super::super::DevPtr),
        to: super::super::DevPtr,
    ) -> Result<()> {
        copy_peer(b, from, (b, to), 64, StreamKind::Collective)
    }

    #[test]
    fn a_peer_copy_without_a_wait_for_the_producer_is_an_error() {
        let (a, b) = (device(), device());
        let (pa, pb) = produce(&*a, &*b);
        let err = copy(&*b, (&*a, pa), pb).unwrap_err().to_string();
        assert!(
            err.contains("unordered access between streams")
                && err.contains(&format!("copies memory of emulated device {}", a.peer_id())),
            "{err}"
        );
        // Waiting for an event recorded after the producer (and after b's own) orders it.
        let (ea, eb) = (a.event_create().unwrap(), b.event_create().unwrap());
        a.event_record(ea, StreamKind::Compute).unwrap();
        b.event_record(eb, StreamKind::Compute).unwrap();
        wait_peer_event(&*b, StreamKind::Collective, &*a, ea).unwrap();
        wait_peer_event(&*b, StreamKind::Collective, &*b, eb).unwrap();
        copy(&*b, (&*a, pa), pb).unwrap();
        // a may not overwrite pa before b's copy out of it is known to be done.
        assert!(a.memset_zero(pa, 64, StreamKind::Compute).is_err());
        b.synchronize(StreamKind::Collective).unwrap();
        // New work on a's compute stream: the old wait no longer covers it.
        a.memset_zero(pa, 64, StreamKind::Compute).unwrap();
        assert!(copy(&*b, (&*a, pa), pb).is_err());
        // A host synchronisation of the producer's stream orders it too.
        a.synchronize(StreamKind::Compute).unwrap();
        copy(&*b, (&*a, pa), pb).unwrap();
    }

    #[test]
    fn compute_after_a_peer_wrote_its_memory_must_wait_for_the_peer() {
        let (a, b) = (device(), device());
        let (pa, pb) = produce(&*a, &*b);
        let (ea, eb) = (a.event_create().unwrap(), b.event_create().unwrap());
        a.event_record(ea, StreamKind::Compute).unwrap();
        b.event_record(eb, StreamKind::Compute).unwrap();
        wait_peer_event(&*b, StreamKind::Collective, &*a, ea).unwrap();
        wait_peer_event(&*b, StreamKind::Collective, &*b, eb).unwrap();
        // b writes into a's buffer from its collective stream.
        copy_peer(&*b, (&*b, pb), (&*a, pa), 64, StreamKind::Collective).unwrap();
        // Other memory of a is free to use meanwhile (the rank's other work overlaps).
        let pc = a.malloc(64).unwrap();
        a.memset_zero(pc, 64, StreamKind::Compute).unwrap();
        let err = a
            .memset_zero(pa, 64, StreamKind::Compute)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("without waiting for it")
                && err.contains(&format!(
                    "emulated device {}'s Collective stream",
                    b.peer_id()
                )),
            "{err}"
        );
        let done = b.event_create().unwrap();
        b.event_record(done, StreamKind::Collective).unwrap();
        wait_peer_event(&*a, StreamKind::Compute, &*b, done).unwrap();
        a.memset_zero(pa, 64, StreamKind::Compute).unwrap();
        // b's own compute stream waits for its collective stream (it read b's scratch) alike.
        assert!(b.memset_zero(pb, 64, StreamKind::Compute).is_err());
        b.stream_wait_event(StreamKind::Compute, done).unwrap();
        b.memset_zero(pb, 64, StreamKind::Compute).unwrap();
    }

    #[test]
    fn a_wait_for_a_destroyed_peer_event_is_refused_by_its_owner() {
        let (a, b) = (device(), device());
        let e = a.event_create().unwrap();
        a.event_destroy(e).unwrap();
        let err = wait_peer_event(&*b, StreamKind::Collective, &*a, e)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("cuStreamWaitEvent") && err.contains("not live"),
            "{err}"
        );
    }
}
