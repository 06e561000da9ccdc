//! A communicator's two events per device, `ready` (recorded on the compute stream before a
//! collective) and `done` (recorded after it), created on the device's first collective and
//! reused by every later one. The local and NCCL communicators order device collectives with
//! them instead of host fences; each says in its own module how it records and waits.

use std::cell::RefCell;
use std::sync::Arc;

use crate::backend::cuda::driver::Event;
use crate::backend::cuda::CudaDevice;
use crate::Result;

/// One device's `ready` and `done` events.
struct Mark {
    dev: Arc<CudaDevice>,
    ready: Event,
    done: Event,
}

impl Drop for Mark {
    fn drop(&mut self) {
        // Dropped with its communicator, after its last collective was settled; streams
        // already waiting on an event keep waiting on the recorded work.
        let _ = self.dev.driver().event_destroy(self.ready);
        let _ = self.dev.driver().event_destroy(self.done);
    }
}

/// A communicator's events, per device it has run collectives on.
#[derive(Default)]
pub(crate) struct Marks(RefCell<Vec<Mark>>);

impl Marks {
    /// `(ready, done)` on `dev`, created on its first collective.
    pub(crate) fn of(&self, dev: &Arc<CudaDevice>) -> Result<(Event, Event)> {
        let mut list = self.0.borrow_mut();
        if let Some(m) = list.iter().find(|m| Arc::ptr_eq(&m.dev, dev)) {
            return Ok((m.ready, m.done));
        }
        let d = dev.driver();
        let ready = d.event_create()?;
        let done = d.event_create().inspect_err(|_| {
            let _ = d.event_destroy(ready);
        })?;
        list.push(Mark {
            dev: Arc::clone(dev),
            ready,
            done,
        });
        Ok((ready, done))
    }
}
