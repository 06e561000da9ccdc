//! The schedule's device arm: the streams a backend orders work on, and events that order one
//! stream (or a host lane) after a point in another's work without stopping the thread that
//! issued it. The engine names streams and passes events along; only the backend knows what
//! they are. The CPU completes every operation before it returns, so its events are complete
//! when recorded and a wait orders nothing; a GPU records and waits on real device events.

use std::any::Any;

use super::CpuBackend;
use crate::{Error, Result};

/// A device's streams, as the engine names them. Work on one stream runs in issue order; work
/// on different streams may overlap unless an event orders it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Stream {
    /// Kernels: forward, backward, reductions into gradient accumulators, on-device steps.
    Compute,
    /// Host-to-device copies (parameters after a host optimizer step, batches).
    HostToDevice,
    /// Device-to-host copies (gradients for a host optimizer step, losses).
    DeviceToHost,
}

/// A device's own event, behind [`StreamEvent::Device`].
pub trait DeviceEvent: Send + Sync + std::fmt::Debug {
    /// Waits on the calling thread until the recorded work has finished.
    fn synchronize(&self) -> Result<()>;
    /// Whether the recorded work has finished.
    fn query(&self) -> Result<bool>;
    /// The backend's own type, for its [`StreamOps::wait_event`].
    fn as_any(&self) -> &dyn Any;
}

/// A point in one stream's work.
#[derive(Debug)]
pub enum StreamEvent {
    /// Work that was complete when it was issued (the CPU's).
    Complete,
    /// An event of a device.
    Device(Box<dyn DeviceEvent>),
}

impl StreamEvent {
    /// Waits on the calling thread (any thread: a host lane waits here) until the work before
    /// the event has finished.
    pub fn synchronize(&self) -> Result<()> {
        match self {
            StreamEvent::Complete => Ok(()),
            StreamEvent::Device(e) => e.synchronize(),
        }
    }

    /// Whether the work before the event has finished.
    pub fn is_complete(&self) -> Result<bool> {
        match self {
            StreamEvent::Complete => Ok(true),
            StreamEvent::Device(e) => e.query(),
        }
    }
}

/// Ordering between a backend's streams.
pub trait StreamOps {
    /// An event marking the work issued on `s` so far.
    fn record(&self, s: Stream) -> Result<StreamEvent>;

    /// Makes work issued on `s` after this call wait until `e`'s work has finished; the
    /// calling thread does not wait. An event of another device is an error.
    fn wait_event(&self, s: Stream, e: &StreamEvent) -> Result<()>;
}

/// The error for an event a backend cannot wait on.
pub fn foreign_event(backend: &str, e: &StreamEvent) -> Error {
    Error::Invalid(format!(
        "{backend}: cannot order a stream after an event of another device ({e:?})"
    ))
}

impl StreamOps for CpuBackend {
    fn record(&self, _s: Stream) -> Result<StreamEvent> {
        Ok(StreamEvent::Complete)
    }

    fn wait_event(&self, _s: Stream, e: &StreamEvent) -> Result<()> {
        match e {
            StreamEvent::Complete => Ok(()),
            StreamEvent::Device(_) => Err(foreign_event("cpu", e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Elsewhere;

    impl DeviceEvent for Elsewhere {
        fn synchronize(&self) -> Result<()> {
            Ok(())
        }
        fn query(&self) -> Result<bool> {
            Ok(false)
        }
        fn as_any(&self) -> &dyn Any {
            self
        }
    }

    #[test]
    fn the_cpu_records_complete_events_and_refuses_foreign_ones() {
        let cpu = CpuBackend;
        for s in [Stream::Compute, Stream::HostToDevice, Stream::DeviceToHost] {
            let e = cpu.record(s).unwrap();
            assert!(e.is_complete().unwrap());
            e.synchronize().unwrap();
            cpu.wait_event(Stream::DeviceToHost, &e).unwrap();
        }
        let other = StreamEvent::Device(Box::new(Elsewhere));
        assert!(!other.is_complete().unwrap());
        let err = cpu.wait_event(Stream::Compute, &other).unwrap_err();
        assert!(err.to_string().contains("another device"), "{err}");
    }
}
