//! [`StreamOps`] on the CUDA device: driver events recorded on the driver's streams (cudarc's
//! `cuEventRecord`/`cuStreamWaitEvent` on a GPU; on the emulator, whose streams run in issue
//! order, every handle is still checked).

use std::any::Any;
use std::sync::Arc;

use super::backend::CudaBackend;
use super::device::CudaDevice;
use super::driver::{Event, StreamKind};
use crate::backend::stream::{foreign_event, DeviceEvent, Stream, StreamEvent, StreamOps};
use crate::Result;

/// A recorded driver event; destroyed when the last holder drops it.
struct CudaEvent {
    dev: Arc<CudaDevice>,
    e: Event,
}

impl std::fmt::Debug for CudaEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("CudaEvent").field(&self.e).finish()
    }
}

impl DeviceEvent for CudaEvent {
    fn synchronize(&self) -> Result<()> {
        self.dev.driver().event_synchronize(self.e)
    }

    fn query(&self) -> Result<bool> {
        self.dev.driver().event_query(self.e)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        // Work the event marks may still run; a stream already waiting on it keeps waiting.
        let _ = self.dev.driver().event_destroy(self.e);
    }
}

/// The driver's stream for an engine's stream name.
pub(crate) fn kind(s: Stream) -> StreamKind {
    match s {
        Stream::Compute => StreamKind::Compute,
        Stream::HostToDevice => StreamKind::HostToDevice,
        Stream::DeviceToHost => StreamKind::DeviceToHost,
    }
}

/// An event marking the work issued on `dev`'s stream `s` so far.
pub(crate) fn record_on(dev: &Arc<CudaDevice>, s: Stream) -> Result<StreamEvent> {
    let ev = CudaEvent {
        dev: dev.clone(),
        e: dev.driver().event_create()?,
    };
    // On a failed record `ev` is dropped, which destroys the driver's event.
    dev.driver().event_record(ev.e, kind(s))?;
    Ok(StreamEvent::Device(Box::new(ev)))
}

/// Orders what `dev`'s stream `waiter` does next after everything issued on its stream `on`
/// so far; the event goes at once (a queued wait outlives it).
pub(crate) fn wait_for_stream(dev: &Arc<CudaDevice>, waiter: Stream, on: Stream) -> Result<()> {
    let ev = CudaEvent {
        dev: dev.clone(),
        e: dev.driver().event_create()?,
    };
    dev.driver().event_record(ev.e, kind(on))?;
    dev.driver().stream_wait_event(kind(waiter), ev.e)
}

impl StreamOps for CudaBackend {
    fn record(&self, s: Stream) -> Result<StreamEvent> {
        record_on(&self.dev, s)
    }

    fn wait_event(&self, s: Stream, e: &StreamEvent) -> Result<()> {
        let ours = match e {
            StreamEvent::Complete => return Ok(()),
            StreamEvent::Device(d) => d
                .as_any()
                .downcast_ref::<CudaEvent>()
                .filter(|c| Arc::ptr_eq(&c.dev, &self.dev)),
        };
        match ours {
            Some(c) => self.dev.driver().stream_wait_event(kind(s), c.e),
            None => Err(foreign_event("cuda", e)),
        }
    }
}
