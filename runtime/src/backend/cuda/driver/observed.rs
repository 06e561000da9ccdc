//! [`Observed`]: any [`Driver`] with counts of what it was asked to do, and on request the
//! order it was asked in.
//!
//! The counts are where "host syncs per step" and "kernel launches per step" come from. They
//! are taken here, in the driver layer, and not in the backend, so that every path to the device
//! is counted (the allocator's frees and the page-locked pool's copies included) and the
//! emulator counts exactly what a GPU would be asked to do. The trace is the order of issue per
//! stream: on the emulator, where streams run synchronously, it is how a test proves that copies
//! went to the copy streams and that the compute stream waited on events only where it uses
//! their data.

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::{DevPtr, DeviceInfo, Driver, Event, Gemm, Kernel, LaunchConfig, StreamKind};
use crate::backend::DeviceActivity;
use crate::Result;

/// One operation as issued, for [`Observed::take_trace`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TraceOp {
    /// A kernel launch, by registry name.
    Launch(String),
    /// A cuBLASLt matmul.
    Gemm,
    /// A host-to-device copy.
    CopyHtoD {
        /// Bytes copied.
        bytes: usize,
        /// Whether the host waited for it.
        wait: bool,
    },
    /// A device-to-host copy.
    CopyDtoH {
        /// Bytes copied.
        bytes: usize,
        /// Whether the host waited for it.
        wait: bool,
    },
    /// A device-to-device copy.
    CopyDtoD {
        /// Bytes copied.
        bytes: usize,
    },
    /// A memset.
    Memset {
        /// Bytes set.
        bytes: usize,
    },
    /// An event recorded at this point of the stream.
    Record(Event),
    /// Later work on the stream waits for the event.
    Wait(Event),
    /// The host waited for the whole stream.
    Synchronize,
    /// The host waited for the event (recorded on whichever stream).
    HostWaitEvent(Event),
    /// A buffer freed (the host waits for the device).
    Free,
}

/// One traced operation: the stream it was issued on (`None` for operations of no stream:
/// host waits on events, frees) and what it was.
pub type Traced = (Option<StreamKind>, TraceOp);

#[derive(Debug, Default)]
struct Counters {
    host_syncs: AtomicU64,
    launches: AtomicU64,
    gemms: AtomicU64,
    memsets: AtomicU64,
    copies: AtomicU64,
    copy_bytes: AtomicU64,
    gemm_fallbacks: AtomicU64,
}

/// A driver with counters and an optional trace; forwards every call unchanged.
#[derive(Debug)]
pub struct Observed {
    inner: Arc<dyn Driver>,
    counts: Counters,
    /// Kernel names by table index, learnt from [`Driver::kernel`] (for the trace).
    names: Mutex<Vec<Option<String>>>,
    /// Whether `trace` records: every launch asks, so it asks an atomic, not the lock.
    tracing: AtomicBool,
    trace: Mutex<Option<Vec<Traced>>>,
}

impl Observed {
    /// `inner`, observed.
    pub fn new(inner: Arc<dyn Driver>) -> Arc<Self> {
        Arc::new(Observed {
            inner,
            counts: Counters::default(),
            names: Mutex::new(Vec::new()),
            tracing: AtomicBool::new(false),
            trace: Mutex::new(None),
        })
    }

    /// Everything counted since the driver was opened.
    pub fn activity(&self) -> DeviceActivity {
        let c = &self.counts;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        DeviceActivity {
            host_syncs: get(&c.host_syncs),
            kernel_launches: get(&c.launches),
            gemms: get(&c.gemms),
            memsets: get(&c.memsets),
            copies: get(&c.copies),
            copy_bytes: get(&c.copy_bytes),
            gemm_fallbacks: get(&c.gemm_fallbacks),
        }
    }

    /// Starts recording every operation in issue order (dropping any earlier record).
    pub fn start_trace(&self) {
        *self.trace.lock().unwrap_or_else(|e| e.into_inner()) = Some(Vec::new());
        self.tracing.store(true, Ordering::Release);
    }

    /// The operations issued since [`Observed::start_trace`], and stops recording.
    pub fn take_trace(&self) -> Vec<Traced> {
        self.tracing.store(false, Ordering::Release);
        self.trace
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .unwrap_or_default()
    }

    fn note(&self, s: Option<StreamKind>, op: impl FnOnce() -> TraceOp) {
        if !self.tracing.load(Ordering::Acquire) {
            return;
        }
        let mut t = self.trace.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(t) = t.as_mut() {
            t.push((s, op()));
        }
    }

    fn bump(a: &AtomicU64, n: u64) {
        a.fetch_add(n, Ordering::Relaxed);
    }

    fn copy(&self, bytes: usize, sync: bool) {
        Self::bump(&self.counts.copies, 1);
        Self::bump(&self.counts.copy_bytes, bytes as u64);
        if sync {
            Self::bump(&self.counts.host_syncs, 1);
        }
    }

    fn kernel_name(&self, k: Kernel) -> String {
        let names = self.names.lock().unwrap_or_else(|e| e.into_inner());
        names
            .get(k.index())
            .cloned()
            .flatten()
            .unwrap_or_else(|| format!("kernel #{}", k.index()))
    }
}

/// Methods the observer passes on unchanged: nothing in them is counted or traced.
macro_rules! forward {
    (
        $(fn $f:ident(&self $(, $a:ident: $t:ty)*) $(-> $r:ty)?;)*
        $(unsafe fn $u:ident(&self $(, $b:ident: $bt:ty)*) $(-> $ur:ty)?;)*
    ) => {
        $(fn $f(&self $(, $a: $t)*) $(-> $r)? {
            self.inner.$f($($a),*)
        })*
        $(unsafe fn $u(&self $(, $b: $bt)*) $(-> $ur)? {
            // SAFETY: the caller's contract, passed on unchanged.
            unsafe { self.inner.$u($($b),*) }
        })*
    };
}

impl Driver for Observed {
    forward! {
        fn info(&self) -> &DeviceInfo;
        fn malloc(&self, bytes: usize) -> Result<DevPtr>;
        fn event_create(&self) -> Result<Event>;
        fn event_query(&self, e: Event) -> Result<bool>;
        fn event_destroy(&self, e: Event) -> Result<()>;
        fn allocated(&self) -> u64;
        fn check_live(&self, op: &str, what: &str, p: DevPtr, bytes: u64) -> Result<()>;
        fn check_event_live(&self, op: &str, e: Event) -> Result<()>;
        fn peer_id(&self) -> u64;
        fn native_stream(&self, s: StreamKind) -> Option<u64>;
        fn note_buffer(&self, p: DevPtr, bytes: u64);
        unsafe fn host_register(&self, ptr: *mut u8, len: usize) -> Result<()>;
        unsafe fn host_unregister(&self, ptr: *mut u8) -> Result<()>;
    }

    unsafe fn free(&self, p: DevPtr) -> Result<()> {
        Self::bump(&self.counts.host_syncs, 1);
        self.note(None, || TraceOp::Free);
        // SAFETY: the caller's contract, passed on unchanged.
        unsafe { self.inner.free(p) }
    }

    fn memset_zero(&self, p: DevPtr, bytes: usize, s: StreamKind) -> Result<()> {
        Self::bump(&self.counts.memsets, 1);
        self.note(Some(s), || TraceOp::Memset { bytes });
        self.inner.memset_zero(p, bytes, s)
    }

    fn copy_htod(&self, src: &[u8], dst: DevPtr, s: StreamKind) -> Result<()> {
        let bytes = src.len();
        self.copy(bytes, true);
        self.note(Some(s), || TraceOp::CopyHtoD { bytes, wait: true });
        self.inner.copy_htod(src, dst, s)
    }

    fn copy_dtoh(&self, src: DevPtr, dst: &mut [u8], s: StreamKind) -> Result<()> {
        let bytes = dst.len();
        self.copy(bytes, true);
        self.note(Some(s), || TraceOp::CopyDtoH { bytes, wait: true });
        self.inner.copy_dtoh(src, dst, s)
    }

    fn copy_dtod(&self, src: DevPtr, dst: DevPtr, bytes: usize, s: StreamKind) -> Result<()> {
        self.copy(bytes, false);
        self.note(Some(s), || TraceOp::CopyDtoD { bytes });
        self.inner.copy_dtod(src, dst, bytes, s)
    }

    unsafe fn copy_htod_async(&self, src: *const [u8], dst: DevPtr, s: StreamKind) -> Result<()> {
        let bytes = src.len();
        self.copy(bytes, false);
        self.note(Some(s), || TraceOp::CopyHtoD { bytes, wait: false });
        // SAFETY: the caller's contract, passed on unchanged.
        unsafe { self.inner.copy_htod_async(src, dst, s) }
    }

    unsafe fn copy_dtoh_async(&self, src: DevPtr, dst: *mut [u8], s: StreamKind) -> Result<()> {
        let bytes = dst.len();
        self.copy(bytes, false);
        self.note(Some(s), || TraceOp::CopyDtoH { bytes, wait: false });
        // SAFETY: the caller's contract, passed on unchanged.
        unsafe { self.inner.copy_dtoh_async(src, dst, s) }
    }

    fn kernel(&self, name: &str) -> Result<Kernel> {
        let k = self.inner.kernel(name)?;
        let mut names = self.names.lock().unwrap_or_else(|e| e.into_inner());
        if names.len() <= k.index() {
            names.resize(k.index() + 1, None);
        }
        names[k.index()] = Some(name.to_string());
        Ok(k)
    }

    unsafe fn launch(
        &self,
        k: Kernel,
        cfg: &LaunchConfig,
        params: &mut [*mut c_void],
        s: StreamKind,
    ) -> Result<()> {
        Self::bump(&self.counts.launches, 1);
        self.note(Some(s), || TraceOp::Launch(self.kernel_name(k)));
        // SAFETY: the caller's contract, passed on unchanged.
        unsafe { self.inner.launch(k, cfg, params, s) }
    }

    fn gemm(&self, g: &Gemm, s: StreamKind) -> Result<()> {
        // A refused epilogue ran nothing: the backend's separate kernels are counted instead.
        let r = self.inner.gemm(g, s);
        if matches!(r, Err(crate::Error::GemmRefused { .. })) {
            Self::bump(&self.counts.gemm_fallbacks, 1);
            return r;
        }
        Self::bump(&self.counts.launches, 1);
        Self::bump(&self.counts.gemms, 1);
        self.note(Some(s), || TraceOp::Gemm);
        r
    }

    fn synchronize(&self, s: StreamKind) -> Result<()> {
        Self::bump(&self.counts.host_syncs, 1);
        self.note(Some(s), || TraceOp::Synchronize);
        self.inner.synchronize(s)
    }

    fn event_record(&self, e: Event, s: StreamKind) -> Result<()> {
        self.note(Some(s), || TraceOp::Record(e));
        self.inner.event_record(e, s)
    }

    fn stream_wait_event(&self, s: StreamKind, e: Event) -> Result<()> {
        self.note(Some(s), || TraceOp::Wait(e));
        self.inner.stream_wait_event(s, e)
    }

    fn event_synchronize(&self, e: Event) -> Result<()> {
        Self::bump(&self.counts.host_syncs, 1);
        self.note(None, || TraceOp::HostWaitEvent(e));
        self.inner.event_synchronize(e)
    }

    unsafe fn copy_unified(
        &self,
        src: DevPtr,
        dst: DevPtr,
        bytes: usize,
        s: StreamKind,
        owners: [u64; 2],
    ) -> Result<()> {
        self.copy(bytes, false);
        self.note(Some(s), || TraceOp::CopyDtoD { bytes });
        // SAFETY: the caller's contract, passed on unchanged.
        unsafe { self.inner.copy_unified(src, dst, bytes, s, owners) }
    }

    unsafe fn stream_wait_unified(&self, s: StreamKind, owner: u64, e: Event) -> Result<()> {
        self.note(Some(s), || TraceOp::Wait(e));
        // SAFETY: the caller's contract, passed on unchanged.
        unsafe { self.inner.stream_wait_unified(s, owner, e) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::driver::{EmuDriver, EmuOptions};

    #[test]
    fn counts_and_traces_what_each_stream_was_asked_to_do() {
        let d = Observed::new(Arc::new(EmuDriver::new(EmuOptions::default()).unwrap()));
        let p = d.malloc(1024).unwrap();
        let host = vec![7u8; 1024];
        let mut back = vec![0u8; 512];
        d.copy_htod(&host, p, StreamKind::Compute).unwrap();
        d.start_trace();
        // SAFETY: `host` outlives the copy (the stream is synchronized below).
        unsafe { d.copy_htod_async(&host[..], p, StreamKind::HostToDevice) }.unwrap();
        let e = d.event_create().unwrap();
        d.event_record(e, StreamKind::HostToDevice).unwrap();
        d.stream_wait_event(StreamKind::Compute, e).unwrap();
        d.memset_zero(p, 256, StreamKind::Compute).unwrap();
        d.copy_dtoh(p.offset(256), &mut back, StreamKind::DeviceToHost)
            .unwrap();
        d.event_synchronize(e).unwrap();
        d.synchronize(StreamKind::HostToDevice).unwrap();
        let trace = d.take_trace();
        // SAFETY: nothing uses `p` any more.
        unsafe { d.free(p) }.unwrap();

        let a = d.activity();
        // The first synchronous copy, the synchronous download, the event and stream waits,
        // the free: five times the host waited.
        assert_eq!(a.host_syncs, 5, "{a:?}");
        assert_eq!((a.copies, a.copy_bytes), (3, 1024 + 1024 + 512), "{a:?}");
        assert_eq!((a.memsets, a.kernel_launches, a.gemms), (1, 0, 0), "{a:?}");
        use StreamKind::*;
        let want = vec![
            (
                Some(HostToDevice),
                TraceOp::CopyHtoD {
                    bytes: 1024,
                    wait: false,
                },
            ),
            (Some(HostToDevice), TraceOp::Record(e)),
            (Some(Compute), TraceOp::Wait(e)),
            (Some(Compute), TraceOp::Memset { bytes: 256 }),
            (
                Some(DeviceToHost),
                TraceOp::CopyDtoH {
                    bytes: 512,
                    wait: true,
                },
            ),
            (None, TraceOp::HostWaitEvent(e)),
            (Some(HostToDevice), TraceOp::Synchronize),
        ];
        assert_eq!(trace, want);
        // Taking the trace stops it.
        assert!(d.take_trace().is_empty());
    }
}
