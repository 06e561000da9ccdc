//! Small uploads the host does not wait for: a step's launch descriptors, scalars and token
//! ids go through a ring of page-locked host memory, copied asynchronously on the stream that
//! uses them. A synchronous upload makes the host wait for every kernel queued before it; a
//! step issues dozens, so the device would idle between them.
//!
//! The bytes are copied into the ring before the call returns (the caller's slice is free at
//! once), and a region of the ring is written again only after the event recorded behind its
//! copy has completed: almost always already, as the ring holds many steps' uploads; otherwise
//! the host waits for that event (a counted sync). Uploads larger than a quarter of the ring,
//! and every upload when the driver will not page-lock the ring, are synchronous copies, as
//! before (an asynchronous copy from pageable memory would wait for the stream anyway).

use std::alloc::Layout;
use std::collections::VecDeque;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use super::driver::{DevPtr, Driver, Event, StreamKind};
use crate::Result;

/// Bytes of the ring: four times the largest upload it takes.
const RING_BYTES: usize = 4 << 20;
/// Each upload starts at a multiple of this.
const ALIGN: usize = 256;
/// The host page (the ring shares no page with other registered memory).
const PAGE: usize = 4096;

/// The ring of one device.
#[derive(Debug)]
pub(crate) struct UploadRing {
    driver: Arc<dyn Driver>,
    state: Mutex<Option<Ring>>,
}

#[derive(Debug)]
struct Ring {
    /// The page-locked memory; `None` when the driver refused to register it.
    mem: Option<Pages>,
    head: usize,
    /// Regions whose copies may still be queued, oldest first.
    pending: VecDeque<(usize, usize, Event)>,
    idle: Vec<Event>,
}

/// Page-aligned host memory of `RING_BYTES`.
#[derive(Debug)]
struct Pages(NonNull<u8>);

// SAFETY: the memory is only touched under the ring's mutex (and by the device's copies).
unsafe impl Send for Pages {}

fn layout() -> Layout {
    // RING_BYTES and PAGE are non-zero powers of two.
    Layout::from_size_align(RING_BYTES, PAGE).expect("a valid layout")
}

impl UploadRing {
    pub(crate) fn new(driver: Arc<dyn Driver>) -> Self {
        UploadRing {
            driver,
            state: Mutex::new(None),
        }
    }

    /// Copies `src` to `dst` on stream `s`, in stream order; `src` is free on return.
    pub(crate) fn upload(&self, src: &[u8], dst: DevPtr, s: StreamKind) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let ring = st.get_or_insert_with(|| Ring::open(&*self.driver));
        let Some(mem) = ring.mem.as_ref().map(|m| m.0) else {
            return self.driver.copy_htod(src, dst, s);
        };
        if src.len() > RING_BYTES / 4 {
            return self.driver.copy_htod(src, dst, s);
        }
        let at = ring.reserve(&*self.driver, src.len())?;
        // SAFETY: `at..at + len` lies in the ring (`reserve`) and no queued copy reads it.
        let host = unsafe { mem.as_ptr().add(at) };
        // SAFETY: as above; `src` is a distinct borrowed slice.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), host, src.len()) };
        // SAFETY: the region stays allocated and unwritten until the event recorded below has
        // completed (`reserve` waits for it; dropping the ring waits for every one).
        unsafe { self.driver.copy_htod_async(host, src.len(), dst, s) }?;
        let e = match ring.idle.pop() {
            Some(e) => e,
            None => self.driver.event_create()?,
        };
        self.driver.event_record(e, s)?;
        ring.pending.push_back((at, at + src.len(), e));
        Ok(())
    }
}

impl Ring {
    /// The ring, page-locked if the driver allows (else every upload is synchronous).
    fn open(driver: &dyn Driver) -> Ring {
        // SAFETY: the layout has a non-zero size.
        let mem = NonNull::new(unsafe { std::alloc::alloc(layout()) }).map(Pages);
        let mem = mem.and_then(|m| {
            // SAFETY: the memory stays allocated until `Drop` unregisters it.
            match unsafe { driver.host_register(m.0.as_ptr(), RING_BYTES) } {
                Ok(()) => Some(m),
                Err(e) => {
                    tracing::debug!("upload ring left pageable, uploads synchronous: {e}");
                    // SAFETY: allocated above with this layout, never registered.
                    unsafe { std::alloc::dealloc(m.0.as_ptr(), layout()) };
                    None
                }
            }
        });
        Ring {
            mem,
            head: 0,
            pending: VecDeque::new(),
            idle: Vec::new(),
        }
    }

    /// The offset of `len` free bytes: after the last upload, or from the start when they
    /// do not fit before the end; older copies still queued there are waited for.
    fn reserve(&mut self, driver: &dyn Driver, len: usize) -> Result<usize> {
        while let Some(&(_, _, e)) = self.pending.front() {
            if !driver.event_query(e)? {
                break;
            }
            self.pending.pop_front();
            self.idle.push(e);
        }
        let start = if self.head + len <= RING_BYTES {
            self.head
        } else {
            0
        };
        let end = start + len;
        while self.pending.iter().any(|&(a, b, _)| a < end && start < b) {
            if let Some((_, _, e)) = self.pending.pop_front() {
                driver.event_synchronize(e)?;
                self.idle.push(e);
            }
        }
        self.head = end.next_multiple_of(ALIGN);
        Ok(start)
    }
}

impl Drop for UploadRing {
    fn drop(&mut self) {
        let st = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        let Some(mut ring) = st.take() else {
            return;
        };
        let d = &*self.driver;
        let mut settled = true;
        for (_, _, e) in ring.pending.drain(..) {
            settled &= d.event_synchronize(e).is_ok();
            ring.idle.push(e);
        }
        for e in ring.idle.drain(..) {
            let _ = d.event_destroy(e);
        }
        let Some(mem) = ring.mem else {
            return;
        };
        // SAFETY: registered in `Ring::open`; no copy reads it any more (waited above).
        let freed = settled && unsafe { d.host_unregister(mem.0.as_ptr()) }.is_ok();
        if freed {
            // SAFETY: allocated in `Ring::open` with this layout and unregistered.
            unsafe { std::alloc::dealloc(mem.0.as_ptr(), layout()) };
        } else {
            // Memory a copy may still read, or the driver still holds locked, stays allocated.
            tracing::warn!("upload ring could not be released; its pages are kept");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::driver::{EmuDriver, EmuOptions, Observed};

    /// Uploads land in stream order without a host wait, wrap around the ring, and the ring
    /// is registered once and released on drop.
    #[test]
    fn uploads_are_asynchronous_and_wrap() {
        let emu = Arc::new(EmuDriver::new(EmuOptions::default()).unwrap());
        let d = Observed::new(emu.clone());
        let ring = UploadRing::new(d.clone());
        let n = RING_BYTES / 4;
        let p = d.malloc(n).unwrap();
        let before = d.activity();
        for i in 0..9u8 {
            let src = vec![i; n - usize::from(i)];
            ring.upload(&src, p, StreamKind::Compute).unwrap();
            let mut back = vec![0u8; src.len()];
            d.copy_dtoh(p, &mut back, StreamKind::Compute).unwrap();
            assert_eq!(back, src, "upload {i}");
        }
        let a = d.activity() - before;
        // Only the nine checking downloads waited: the emulator's events complete at once.
        assert_eq!(a.host_syncs, 9, "{a:?}");
        assert_eq!(emu.registered_host_bytes(), RING_BYTES);
        // Too large for the ring: a synchronous copy.
        let big = vec![1u8; n + 1];
        let q = d.malloc(n + 1).unwrap();
        ring.upload(&big, q, StreamKind::Compute).unwrap();
        assert_eq!((d.activity() - before).host_syncs, 10);
        drop(ring);
        assert_eq!(emu.registered_host_bytes(), 0);
        // SAFETY: nothing uses them any more.
        unsafe { d.free(p) }.unwrap();
        unsafe { d.free(q) }.unwrap();
    }
}
