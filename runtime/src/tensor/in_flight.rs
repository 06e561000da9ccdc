//! Host copies of device memory in flight on a copy stream: the offloaded optimizer's gradients
//! going down on the device-to-host stream and its updated parameters going up on the
//! host-to-device stream while the compute stream goes on. A [`HostCopy`] owns its host buffer
//! (page-locked staging memory of the device) for as long as a copy may read or write it: the
//! elements are reachable only after the copy's event has completed ([`HostCopy::ready`]), and
//! the buffer goes back to the device's staging pool only then (on drop, error paths too).
//!
//! A host view needs no copy: [`View::download_async`] gives `None` and the caller reads the
//! view in place; an upload into a host view is the plain copy, complete on return.

use std::fmt;
use std::sync::Arc;

use super::{BufMut, BufRef, FlatBuf, View, ViewMut};
use crate::backend::{Stream, StreamEvent};
use crate::Result;

/// Staging buffers smaller than this stay pageable: a registration (a driver call each way)
/// is not worth it.
pub const PAGE_LOCK_MIN_BYTES: u64 = 1 << 20;

/// Whether a device's staging pool page-locks a buffer of `bytes`. Written once here, below
/// both the backends that register and the estimator that prices the registrations
/// (`engine::rules::staging_page_locked`).
pub fn staging_page_locked(bytes: u64) -> bool {
    bytes >= PAGE_LOCK_MIN_BYTES
}

/// Where a staging buffer goes back to when no copy uses it any more (the device's pool).
pub trait StagingHome: Send + Sync + fmt::Debug {
    /// Takes back a buffer whose copies have all completed.
    fn give(&self, b: FlatBuf);
}

/// A host buffer that a copy stream may be reading or writing, with the event that marks the
/// end of that copy.
pub struct HostCopy {
    host: FlatBuf,
    /// The event after the last copy issued on `host`; `None` once the host has waited for it.
    busy: Option<StreamEvent>,
    home: Arc<dyn StagingHome>,
}

impl fmt::Debug for HostCopy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostCopy")
            .field("dtype", &self.host.dtype())
            .field("len", &self.host.len())
            .field("busy", &self.busy.is_some())
            .finish()
    }
}

impl HostCopy {
    /// `host`, staging memory of `home`, with the copy `busy` marks in flight on it.
    // Only a device makes copies in flight; a build without one has no caller.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn new(
        host: FlatBuf,
        busy: Option<StreamEvent>,
        home: Arc<dyn StagingHome>,
    ) -> Self {
        HostCopy { host, busy, home }
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.host.len()
    }

    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.host.len() == 0
    }

    /// Element type.
    pub fn dtype(&self) -> super::DType {
        self.host.dtype()
    }

    /// Waits on this thread until the copy in flight (if any) has completed.
    pub fn wait(&mut self) -> Result<()> {
        if let Some(e) = &self.busy {
            e.synchronize()?;
            self.busy = None;
        }
        Ok(())
    }

    /// The elements, once the copy in flight has completed (waits for it).
    pub fn ready(&mut self) -> Result<BufMut<'_>> {
        self.wait()?;
        Ok(self.host.as_mut())
    }

    /// The elements read-only, once the copy in flight has completed (waits for it).
    pub fn ready_ref(&mut self) -> Result<BufRef<'_>> {
        self.wait()?;
        Ok(self.host.as_ref())
    }

    /// Whether the copy in flight has completed, without waiting for it.
    pub fn poll(&mut self) -> Result<bool> {
        if let Some(e) = &self.busy {
            if !e.is_complete()? {
                return Ok(false);
            }
            self.busy = None;
        }
        Ok(true)
    }

    /// The event that marks the end of the copy in flight, for ordering a stream after it
    /// ([`crate::backend::StreamOps::wait_event`]); `None` when the host already waited.
    pub fn event(&self) -> Option<&StreamEvent> {
        self.busy.as_ref()
    }

    /// Queues a copy of the elements into `dst` (same dtype and length) on stream `s` and
    /// returns without waiting: the copy's event is kept here, so the elements stay untouched
    /// until it completes. Work that reads `dst` must wait for [`HostCopy::event`] first. An
    /// upload into host memory is the plain copy.
    pub fn upload_async(&mut self, dst: ViewMut<'_>, s: Stream) -> Result<()> {
        self.wait()?;
        match dst {
            ViewMut::Host(b) => {
                super::storage::copy_view(View::Host(self.host.as_ref()), ViewMut::Host(b))
            }
            ViewMut::Cuda(c) => {
                // SAFETY: `self.host` stays allocated and unwritten until `busy` completes:
                // `ready`, `wait` and `drop` wait for it first.
                self.busy = unsafe { c.upload_async(self.host.as_ref(), s) }?;
                Ok(())
            }
            meta @ ViewMut::Meta(_) => {
                super::storage::copy_view(View::Host(self.host.as_ref()), meta)
            }
        }
    }
}

impl Drop for HostCopy {
    fn drop(&mut self) {
        if let Err(e) = self.wait() {
            // The copy may still use the buffer: leaking it is the only safe way out.
            tracing::error!("a copy in flight failed; its staging buffer is leaked: {e}");
            std::mem::forget(std::mem::replace(&mut self.host, FlatBuf::F32(Vec::new())));
            return;
        }
        self.home
            .give(std::mem::replace(&mut self.host, FlatBuf::F32(Vec::new())));
    }
}

/// Host memory page-locked with a device's driver for as long as this guard lives: drop it
/// before the memory is freed (a struct holds it in a field declared before the buffer's).
pub struct HostPin {
    bytes: u64,
    release: Box<dyn FnMut() + Send + Sync>,
}

impl HostPin {
    /// A guard over `bytes` of registered memory that `release` unregisters.
    // Only a device registers memory; a build without one has no caller.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn new(bytes: u64, release: Box<dyn FnMut() + Send + Sync>) -> Self {
        HostPin { bytes, release }
    }

    /// Bytes page-locked.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl fmt::Debug for HostPin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostPin")
            .field("bytes", &self.bytes)
            .finish()
    }
}

impl Drop for HostPin {
    fn drop(&mut self) {
        (self.release)()
    }
}

impl View<'_> {
    /// Queues a copy of these elements into page-locked host memory on stream `s` (a copy
    /// stream; order it after the work that wrote them with an event first) and returns at
    /// once; `None` for a host view, which is read in place.
    pub fn download_async(&self, s: Stream) -> Result<Option<HostCopy>> {
        match self {
            View::Host(_) | View::Meta(_) => Ok(None),
            View::Cuda(c) => c.download_async(s).map(Some),
        }
    }
}

impl ViewMut<'_> {
    /// Queues a copy of `src` (same dtype and length) into these elements on stream `s`
    /// straight from `src`'s memory (at the bus's speed when it is page-locked, see
    /// [`HostPin`]); the event after it, `None` when the copy was complete on return (any
    /// pair but host memory into device memory is the plain copy).
    ///
    /// # Safety
    /// Nothing may write `src`'s elements, or free them, until the event has completed.
    pub unsafe fn upload_async_from(self, src: View<'_>, s: Stream) -> Result<Option<StreamEvent>> {
        match (src, self) {
            // SAFETY: the caller keeps `src` as it is until the event completes.
            (View::Host(h), ViewMut::Cuda(c)) => unsafe { c.upload_async(h, s) },
            (src, dst) => super::storage::copy_view(src, dst).map(|()| None),
        }
    }

    /// Staging memory shaped as this view, contents unspecified, for a host routine that
    /// overwrites every element before [`HostCopy::upload_async`]; `None` for a host view,
    /// which is written in place.
    pub fn staging_copy(&self) -> Option<HostCopy> {
        match self {
            ViewMut::Host(_) | ViewMut::Meta(_) => None,
            ViewMut::Cuda(c) => Some(c.as_view().staging_copy()),
        }
    }
}
