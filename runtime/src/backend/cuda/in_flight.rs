//! The CUDA arm of [`HostCopy`]: downloads into the device's page-locked staging buffers and
//! uploads from them, queued on a copy stream with `copy_dtoh_async` / `copy_htod_async` and
//! followed by an event on that stream, so the issuing thread never waits for the bus.

use std::sync::Arc;

use super::device::CudaDevice;
use super::storage::{CudaView, CudaViewMut};
use super::stream::{kind, record_on, wait_for_stream};
use crate::backend::{Stream, StreamEvent};
use crate::tensor::in_flight::{HostCopy, StagingHome};
use crate::tensor::BufRef;
use crate::{Error, Result};

impl StagingHome for CudaDevice {
    fn give(&self, b: crate::tensor::FlatBuf) {
        self.give_staging(b)
    }
}

impl CudaView<'_> {
    /// Queues a copy of these elements into staging memory (page-locked where the driver
    /// allows) on stream `s` and returns at once with the copy in flight.
    pub fn download_async(&self, s: Stream) -> Result<HostCopy> {
        let dev = self.device();
        let mut host = dev.take_staging(self.dtype(), self.len());
        if self.is_empty() {
            return Ok(HostCopy::new(host, None, dev.clone()));
        }
        let dst: *mut [u8] = host.as_mut().bytes_mut();
        // SAFETY: the buffer moves into the `HostCopy`, which keeps it allocated and unread
        // until the event recorded after the copy has completed.
        let queued = unsafe { dev.driver().copy_dtoh_async(self.ptr(), dst, kind(s)) };
        match queued.and_then(|()| record_on(dev, s)) {
            Ok(e) => Ok(HostCopy::new(host, Some(e), dev.clone())),
            Err(e) => {
                // The copy may be queued although the event failed: let the stream pass it
                // before the buffer is reused.
                if dev.driver().synchronize(kind(s)).is_ok() {
                    dev.give_staging(host);
                }
                Err(e)
            }
        }
    }

    /// Staging memory shaped as this view with no copy in flight, contents unspecified.
    pub fn staging_copy(&self) -> HostCopy {
        HostCopy::new(self.staging(), None, self.device().clone())
    }
}

impl CudaViewMut<'_> {
    /// Queues a copy of `src` into these elements on stream `s`; the event after it, `None`
    /// for an empty view.
    ///
    /// # Safety
    /// `src` must stay allocated and unwritten until the returned event has completed.
    pub(crate) unsafe fn upload_async(
        self,
        src: BufRef<'_>,
        s: Stream,
    ) -> Result<Option<StreamEvent>> {
        if (src.len(), src.dtype()) != (self.len(), self.dtype()) {
            return Err(Error::Shape {
                op: "device upload",
                expected: format!("{} {:?} elements", self.len(), self.dtype()),
                got: format!("{} {:?}", src.len(), src.dtype()),
            });
        }
        if self.is_empty() {
            return Ok(None);
        }
        let dev: &Arc<CudaDevice> = self.device();
        let bytes = src.bytes();
        // The caching allocator's blocks belong to the compute stream: a block handed out
        // again may still be read or written there by kernels queued before, so a copy stream
        // writing into it waits for them (on the emulator, the stream-order book checks it).
        if s != Stream::Compute {
            wait_for_stream(dev, s, Stream::Compute)?;
        }
        // SAFETY: the caller keeps `src` as it is until the event has completed.
        unsafe { dev.driver().copy_htod_async(bytes, self.ptr(), kind(s))? };
        record_on(dev, s).map(Some).inspect_err(|_| {
            // The copy is queued without an event to wait for: the stream is the only one.
            let _ = dev.driver().synchronize(kind(s));
        })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::backend::cuda::driver::{EmuDriver, EmuOptions, StreamKind, TraceOp};
    use crate::backend::cuda::CudaBackend;
    use crate::backend::{MemoryOps, StreamOps};
    use crate::tensor::{DType, View};

    /// A download queued on the device-to-host stream lands in a registered staging buffer
    /// without the host waiting at issue; the same buffer goes up again on the host-to-device
    /// stream; a host view needs no copy.
    #[test]
    fn copies_in_flight_go_on_the_copy_streams() {
        let drv = Arc::new(EmuDriver::new(EmuOptions::default()).unwrap());
        let be = CudaBackend::new(CudaDevice::new(drv.clone(), None), DType::F32);
        let n = 1 << 19;
        let vals: Vec<f32> = (0..n).map(|i| i as f32).collect();
        let src = be.upload(BufRef::F32(&vals)).unwrap();
        let mut dst = be.zeros(DType::F32, n).unwrap();
        let obs = be.device().observed();
        obs.start_trace();
        let mut down = src
            .view()
            .download_async(Stream::DeviceToHost)
            .unwrap()
            .expect("a device view is copied");
        assert!(down.event().is_some(), "the copy is in flight");
        let BufRef::F32(h) = down.ready_ref().unwrap() else {
            panic!("f32 staging")
        };
        assert_eq!(h, &vals[..]);
        assert_eq!(drv.registered_host_bytes(), n * 4, "page-locked staging");
        down.upload_async(dst.view_mut(), Stream::HostToDevice)
            .unwrap();
        let up = down.event().expect("the upload is in flight");
        be.wait_event(Stream::Compute, up).unwrap();
        let trace = obs.take_trace();
        let bytes = n * 4;
        assert!(trace.contains(&(
            Some(StreamKind::DeviceToHost),
            TraceOp::CopyDtoH { bytes, wait: false }
        )));
        assert!(trace.contains(&(
            Some(StreamKind::HostToDevice),
            TraceOp::CopyHtoD { bytes, wait: false }
        )));
        drop(down);
        assert_eq!(dst.to_vec_f32().unwrap(), vals);
        let host = [1.0f32, 2.0];
        assert!(View::Host(BufRef::F32(&host))
            .download_async(Stream::DeviceToHost)
            .unwrap()
            .is_none());
    }
}
