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

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use memmap2::MmapMut;

use super::driver::{DevPtr, Driver, Event, StreamKind};
use crate::Result;

/// Bytes of the ring: four times the largest upload it takes.
const RING_BYTES: usize = crate::backend::memory::UPLOAD_RING_BYTES as usize;
/// Each upload starts at a multiple of this.
const ALIGN: usize = 256;

/// The ring of one device.
#[derive(Debug)]
pub(crate) struct UploadRing {
    driver: Arc<dyn Driver>,
    /// Bytes of the ring (`RING_BYTES`; tests take less).
    bytes: usize,
    state: Mutex<Option<Ring>>,
}

#[derive(Debug)]
struct Ring {
    /// The page-locked memory: anonymous pages of its own, so it shares no page with other
    /// registered memory (and leaves the allocator's heuristics alone); `None` when the
    /// driver refused to register it.
    mem: Option<MmapMut>,
    bytes: usize,
    head: usize,
    /// Regions whose copies may still be queued, oldest first.
    pending: VecDeque<(usize, usize, Event)>,
    idle: Vec<Event>,
}

impl UploadRing {
    pub(crate) fn new(driver: Arc<dyn Driver>) -> Self {
        Self::with_bytes(driver, RING_BYTES)
    }

    fn with_bytes(driver: Arc<dyn Driver>, bytes: usize) -> Self {
        UploadRing {
            driver,
            bytes,
            state: Mutex::new(None),
        }
    }

    /// Host bytes page-locked for the ring (0 before its first upload, or when refused).
    pub(crate) fn page_locked_bytes(&self) -> u64 {
        let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.as_ref()
            .and_then(|r| r.mem.as_ref().map(|_| r.bytes as u64))
            .unwrap_or(0)
    }

    /// Copies `src` to `dst` on stream `s`, in stream order; `src` is free on return.
    pub(crate) fn upload(&self, src: &[u8], dst: DevPtr, s: StreamKind) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let ring = st.get_or_insert_with(|| Ring::open(&*self.driver, self.bytes));
        if ring.mem.is_none() || src.len() > ring.bytes / 4 {
            return self.driver.copy_htod(src, dst, s);
        }
        let at = ring.reserve(&*self.driver, src.len())?;
        let Some(mem) = ring.mem.as_mut() else {
            return self.driver.copy_htod(src, dst, s);
        };
        // `at..at + len` lies in the ring (`reserve`) and no queued copy reads it any more.
        let region = &mut mem[at..at + src.len()];
        region.copy_from_slice(src);
        // SAFETY: the region stays allocated and unwritten until the event recorded below has
        // completed (`reserve` waits for it; dropping the ring waits for every one).
        unsafe { self.driver.copy_htod_async(region, dst, s) }?;
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
    fn open(driver: &dyn Driver, bytes: usize) -> Ring {
        let mem = match MmapMut::map_anon(bytes) {
            Ok(m) => Some(m),
            Err(e) => {
                tracing::debug!("no upload ring, uploads synchronous: {e}");
                None
            }
        };
        let mem = mem.and_then(|mut m| {
            // SAFETY: the mapping stays alive until `Drop` unregisters it (or leaks it).
            match unsafe { driver.host_register(m.as_mut_ptr(), bytes) } {
                Ok(()) => Some(m),
                Err(e) => {
                    tracing::debug!("upload ring left pageable, uploads synchronous: {e}");
                    None
                }
            }
        });
        Ring {
            mem,
            bytes,
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
        let start = if self.head + len <= self.bytes {
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
        let Some(mut mem) = ring.mem else {
            return;
        };
        // SAFETY: registered in `Ring::open`; no copy reads it any more (waited above).
        let freed = settled && unsafe { d.host_unregister(mem.as_mut_ptr()) }.is_ok();
        if !freed {
            // Memory a copy may still read, or the driver still holds locked, stays mapped.
            tracing::warn!("upload ring could not be released; its pages are kept");
            std::mem::forget(mem);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::driver::{EmuDriver, EmuOptions, Observed};

    /// Uploads land in stream order without a host wait, wrap around the ring, and the ring
    /// is registered once and released on drop. (A small ring, so every buffer here stays
    /// under glibc's mmap threshold: freeing a larger one, the emulator's device memory
    /// included, raises the threshold for the whole test process, and the page-locked pool's
    /// test needs its 1 MiB buffers on pages of their own.)
    #[test]
    fn uploads_are_asynchronous_and_wrap() {
        let emu = Arc::new(EmuDriver::new(EmuOptions::default()).unwrap());
        let d = Observed::new(emu.clone());
        let bytes = 256 << 10;
        let ring = UploadRing::with_bytes(d.clone(), bytes);
        let n = 20 << 10;
        let p = d.malloc(n).unwrap();
        let before = d.activity();
        let uploads = bytes / n + 3;
        for i in 0..uploads {
            let src = vec![i as u8; n - i];
            ring.upload(&src, p, StreamKind::Compute).unwrap();
            let mut back = vec![0u8; src.len()];
            d.copy_dtoh(p, &mut back, StreamKind::Compute).unwrap();
            assert_eq!(back, src, "upload {i}");
        }
        let a = d.activity() - before;
        // Only the checking downloads waited: the emulator's events complete at once.
        assert_eq!(a.host_syncs, uploads as u64, "{a:?}");
        assert_eq!(emu.registered_host_bytes(), bytes);
        // Too large for the ring: a synchronous copy.
        let big = vec![1u8; bytes / 4 + 1];
        let q = d.malloc(big.len()).unwrap();
        ring.upload(&big, q, StreamKind::Compute).unwrap();
        assert_eq!((d.activity() - before).host_syncs, uploads as u64 + 1);
        drop(ring);
        assert_eq!(emu.registered_host_bytes(), 0);
        // SAFETY: nothing uses them any more.
        unsafe { d.free(p) }.unwrap();
        unsafe { d.free(q) }.unwrap();
    }
}
