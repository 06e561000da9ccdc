//! Ordering NCCL's work on device buffers by events instead of host fences. A collective
//! whose buffers are all memory of one device is queued on that device's collective stream:
//! before it, `ready` is recorded on the compute stream (which wrote the buffers) and the
//! collective stream waits for it; after it, `done` is recorded on the collective stream and
//! the compute stream waits for it before anything reads the results or writes the buffers
//! again. The host waits for neither; it learns that `done` passed when the communicator
//! settles the collective ([`End::finished`]). The copy streams (offload prefetches) are left
//! running, as the local communicator leaves them.
//!
//! A communicator's two events per device are reused by every collective: it settles one
//! collective before it starts the next, so `done` is never recorded again while a wait for
//! its last record could still be issued.

use std::sync::Arc;

use super::api::NcclOp;
use crate::backend::cuda::driver::{Event, StreamKind};
use crate::backend::cuda::CudaDevice;
use crate::tensor::View;
use crate::Result;

/// The stream NCCL's collectives on a device's buffers are queued on.
pub const STREAM: StreamKind = StreamKind::Collective;

/// A device that holds a collective's buffers.
pub(super) type Dev = Arc<CudaDevice>;

/// The device that holds every buffer of `op`, when one does (`None`: a host buffer among
/// them, or buffers on two devices; such an op goes through the library's own stream).
pub(super) fn device_of(op: &NcclOp<'_>) -> Option<Dev> {
    match op.views() {
        (View::Cuda(a), View::Cuda(b)) if Arc::ptr_eq(a.device(), b.device()) => {
            Some(Arc::clone(a.device()))
        }
        _ => None,
    }
}

pub(super) use crate::comm::events::Marks;

/// The end of a collective queued on a device's collective stream.
pub(super) struct End {
    dev: Dev,
    done: Event,
}

impl End {
    /// Whether the device has passed the collective (the host does not wait).
    pub(super) fn finished(&self) -> Result<bool> {
        self.dev.driver().event_query(self.done)
    }
}

impl Marks {
    /// Makes `dev`'s collective stream wait for the work queued on its compute stream so far.
    pub(super) fn before(&self, dev: &Dev) -> Result<()> {
        let (ready, _) = self.of(dev)?;
        let d = dev.driver();
        d.event_record(ready, StreamKind::Compute)?;
        d.stream_wait_event(STREAM, ready)
    }

    /// Marks the end of the collective just queued on `dev`'s collective stream and makes the
    /// compute stream wait for it.
    pub(super) fn after(&self, dev: &Dev) -> Result<End> {
        let (_, done) = self.of(dev)?;
        let d = dev.driver();
        d.event_record(done, STREAM)?;
        d.stream_wait_event(StreamKind::Compute, done)?;
        Ok(End {
            dev: Arc::clone(dev),
            done,
        })
    }
}
