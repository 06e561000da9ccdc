//! The size-only driver (the "meta" device, as PyTorch calls a device with sizes and no data):
//! a GPU described by a [`DeviceInfo`], whose allocations are addresses with no memory behind
//! them and whose copies, memsets, launches and GEMMs are checked exactly as the emulator
//! checks them (`checks.rs`: live ranges, launch configurations, GEMM descriptions, the order
//! between streams) and then do nothing.
//!
//! The caching allocator sits on it unchanged, so the CUDA backend over it allocates and frees
//! what it would on that GPU: its counters are the figure a real run shows, with no GPU, no
//! emulator library and no compiler. Nothing is computed, so whatever the host reads back
//! (losses, norms, flags) is what its buffer held before the copy: a download leaves it
//! untouched, since in a size-only run a host buffer may be lazily zero pages that a write
//! would make resident.

use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};

use super::checks::Checks;
use super::gemm::Gemm;
use super::{
    builtin_programs, DevPtr, DeviceInfo, Driver, Event, Kernel, LaunchConfig, StreamKind,
};
use crate::{Error, Result};

/// An H100 80GB's memory as an estimate prices it by default (80 GiB).
pub const H100_MEMORY: u64 = 80 << 30;

/// The alignment of every allocation (cudaMalloc guarantees at least 256 bytes).
const ALIGN: u64 = 256;

/// Where the addresses of every size-only device of the process start: far above anything
/// Linux maps unasked (user space below 2^47), so a stray dereference faults instead of
/// reading host memory, and leaving 2^52 bytes before the top of a 57-bit space.
const BASE: u64 = 0x00F0_0000_0000_0000;

/// The next address handed out, for every size-only device of the process: with unified
/// addressing no two devices share an address, and `copy_peer`'s overlap check relies on it.
static NEXT: AtomicU64 = AtomicU64::new(BASE);

impl DeviceInfo {
    /// The GPU an estimate prices by default, size-only: an H100 80GB HBM3 (compute capability
    /// 9.0, 132 SMs, 227 KiB of opt-in dynamic shared memory per block) with `total_memory`
    /// bytes ([`H100_MEMORY`] unless a config's `device_memory_limit` or a user's card says
    /// otherwise).
    pub fn h100_sizes_only(total_memory: Option<u64>) -> DeviceInfo {
        DeviceInfo {
            name: "NVIDIA H100 80GB HBM3".into(),
            ordinal: 0,
            compute_capability: (9, 0),
            total_memory: total_memory.unwrap_or(H100_MEMORY),
            multiprocessors: 132,
            max_dyn_smem_per_block: 227 * 1024,
            driver_version: None,
            nvrtc_version: None,
            cublaslt_version: None,
            emulated: false,
            sizes_only: true,
        }
    }
}

/// The size-only driver (see the module documentation).
#[derive(Debug)]
pub struct MetaDriver {
    /// What every call is checked against, shared with the emulator.
    checks: Checks,
}

impl MetaDriver {
    /// A size-only device described by `info` (marked [`DeviceInfo::sizes_only`], not
    /// emulated), knowing the builtin kernel registry's kernels by name; nothing is compiled.
    pub fn new(mut info: DeviceInfo) -> Result<Self> {
        info.sizes_only = true;
        info.emulated = false;
        Ok(MetaDriver {
            checks: Checks::new(info, builtin_programs())?,
        })
    }

    /// Host bytes currently registered with [`Driver::host_register`].
    pub fn registered_host_bytes(&self) -> usize {
        self.checks.registered_host_bytes()
    }
}

/// `bytes` of fresh address space, 256-byte aligned; never 0 and never given again.
fn addresses(bytes: usize) -> Result<DevPtr> {
    let len = (bytes as u64).div_ceil(ALIGN) * ALIGN;
    let start = NEXT.fetch_add(len, Ordering::Relaxed);
    if start.checked_add(len).is_none_or(|end| end > u64::MAX / 2) {
        return Err(Error::Device {
            op: "cuMemAlloc".into(),
            detail: format!(
                "CUDA_ERROR_OUT_OF_MEMORY: the size-only devices' address space is spent \
                 ({bytes} bytes requested at {start:#x})"
            ),
        });
    }
    Ok(DevPtr(start))
}

impl Driver for MetaDriver {
    fn info(&self) -> &DeviceInfo {
        &self.checks.info
    }

    fn malloc(&self, bytes: usize) -> Result<DevPtr> {
        let mut mem = self.checks.admit(bytes)?;
        let p = addresses(bytes)?;
        mem.insert(p.0, bytes as u64);
        Ok(p)
    }

    unsafe fn free(&self, p: DevPtr) -> Result<()> {
        self.checks.free(p).map(|_| ())
    }

    fn memset_zero(&self, p: DevPtr, bytes: usize, s: StreamKind) -> Result<()> {
        self.checks.memset(p, bytes, s).map(|_| ())
    }

    fn copy_htod(&self, src: &[u8], dst: DevPtr, s: StreamKind) -> Result<()> {
        drop(self.checks.copy_htod(dst, src.len(), s)?);
        self.checks.synchronized(s);
        Ok(())
    }

    fn copy_dtoh(&self, src: DevPtr, dst: &mut [u8], s: StreamKind) -> Result<()> {
        drop(self.checks.copy_dtoh(src, dst.len(), s)?);
        self.checks.synchronized(s);
        Ok(())
    }

    fn copy_dtod(&self, src: DevPtr, dst: DevPtr, bytes: usize, s: StreamKind) -> Result<()> {
        self.checks.copy_dtod((src, dst), bytes, s).map(|_| ())
    }

    unsafe fn copy_htod_async(
        &self,
        _src: *const u8,
        len: usize,
        dst: DevPtr,
        s: StreamKind,
    ) -> Result<()> {
        self.checks.copy_htod(dst, len, s).map(|_| ())
    }

    unsafe fn copy_dtoh_async(
        &self,
        src: DevPtr,
        _dst: *mut u8,
        len: usize,
        s: StreamKind,
    ) -> Result<()> {
        self.checks.copy_dtoh(src, len, s).map(|_| ())
    }

    fn kernel(&self, name: &str) -> Result<Kernel> {
        Ok(Kernel(self.checks.lookup(name)? as u32))
    }

    unsafe fn launch(
        &self,
        k: Kernel,
        cfg: &LaunchConfig,
        params: &mut [*mut c_void],
        s: StreamKind,
    ) -> Result<()> {
        // SAFETY: the caller's contract: `params` matches the kernel's parameters.
        unsafe { self.checks.launch(k, cfg, params, s) }.map(|_| ())
    }

    fn gemm(&self, g: &Gemm, s: StreamKind) -> Result<()> {
        self.checks.gemm(g, s).map(|_| ())
    }

    fn synchronize(&self, s: StreamKind) -> Result<()> {
        self.checks.synchronized(s);
        Ok(())
    }

    fn event_create(&self) -> Result<Event> {
        Ok(self.checks.event_create())
    }

    fn event_record(&self, e: Event, s: StreamKind) -> Result<()> {
        self.checks.event_record(e, s)
    }

    fn stream_wait_event(&self, s: StreamKind, e: Event) -> Result<()> {
        self.checks.stream_wait_event(s, e)
    }

    fn event_query(&self, e: Event) -> Result<bool> {
        // Nothing runs, so everything recorded has finished.
        self.checks.event_synchronize("cuEventQuery", e)?;
        Ok(true)
    }

    fn event_synchronize(&self, e: Event) -> Result<()> {
        self.checks.event_synchronize("cuEventSynchronize", e)
    }

    fn event_destroy(&self, e: Event) -> Result<()> {
        self.checks.event_destroy(e)
    }

    fn allocated(&self) -> u64 {
        self.checks.memory().allocated()
    }

    unsafe fn host_register(&self, ptr: *mut u8, len: usize) -> Result<()> {
        self.checks.host_register(ptr, len)
    }

    unsafe fn host_unregister(&self, ptr: *mut u8) -> Result<()> {
        self.checks.host_unregister(ptr)
    }

    fn check_live(&self, op: &str, what: &str, p: DevPtr, bytes: u64) -> Result<()> {
        self.checks.memory().check(op, what, p, bytes)
    }

    unsafe fn copy_unified(
        &self,
        src: DevPtr,
        dst: DevPtr,
        bytes: usize,
        s: StreamKind,
        owners: [u64; 2],
    ) -> Result<()> {
        self.checks.copy_unified((src, dst), bytes, s, owners)
    }

    fn check_event_live(&self, op: &str, e: Event) -> Result<()> {
        self.checks.check_event_live(op, e)
    }

    unsafe fn stream_wait_unified(&self, s: StreamKind, owner: u64, e: Event) -> Result<()> {
        self.checks.stream_wait_unified(s, owner, e);
        Ok(())
    }

    fn peer_id(&self) -> u64 {
        self.checks.id
    }

    fn note_buffer(&self, p: DevPtr, bytes: u64) {
        self.checks.note_buffer(p, bytes);
    }
}
