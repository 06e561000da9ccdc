//! The one [`Driver`] over [`Checks`]: every call is checked as `checks.rs` checks it, then
//! handed to [`Work`], what the device does with a call it admitted. The emulator
//! (`emu.rs`) moves bytes and runs kernels; the size-only device (`meta.rs`) does nothing.
//! Both drivers are this type, so they cannot drift apart in what they refuse, in the order
//! book's entries or in the host waits they report.

use std::ffi::{c_void, CStr};

use super::checks::Checks;
use super::gemm::Gemm;
use super::{DevPtr, DeviceInfo, Driver, Event, Kernel, LaunchConfig, StreamKind};
use crate::Result;

/// What a checked device does with a call once [`Checks`] admitted it. Beyond handing out
/// addresses, by default nothing: the size-only device's work, which the emulator overrides.
pub trait Work: Send + Sync + std::fmt::Debug {
    /// Fresh device memory of `bytes` (more than 0, within the device's memory), 256-byte
    /// aligned; `None` when the host cannot provide it (an out-of-memory refusal).
    fn alloc(&self, bytes: usize) -> Result<Option<DevPtr>>;

    /// Returns memory from [`Work::alloc`] (`len` bytes at `p`).
    ///
    /// # Safety
    /// `p` came from `alloc` with `len` bytes, is released once, and nothing reaches it after.
    unsafe fn release(&self, _p: DevPtr, _len: u64) {}

    /// Zeroes `len` bytes at `p`.
    ///
    /// # Safety
    /// The range lies inside a live allocation of this device.
    unsafe fn zero(&self, _p: DevPtr, _len: usize) {}

    /// Copies `len` bytes from `src` to `dst` (host or device addresses: with unified
    /// addressing, both are addresses of the process). Where nothing moves, a download leaves
    /// the host buffer as it was.
    ///
    /// # Safety
    /// Both ranges are valid for the copy and do not overlap.
    unsafe fn copy(&self, _src: *const u8, _dst: *mut u8, _len: usize) {}

    /// Whether kernel `name` of program `file` can run here.
    fn loadable(&self, _name: &str, _file: &str) -> Result<()> {
        Ok(())
    }

    /// Runs kernel `k` (its name as a C string) over `args`.
    ///
    /// # Safety
    /// `args` holds one pointer per parameter of the kernel, each to a value of its type,
    /// device pointers among them to live memory large enough for what the kernel touches.
    unsafe fn launch(
        &self,
        _k: &CStr,
        _cfg: &LaunchConfig,
        _args: &mut [*mut c_void],
    ) -> Result<()> {
        Ok(())
    }

    /// Computes the product `g` describes.
    ///
    /// # Safety
    /// `g` is validated and every operand range lies inside a live allocation.
    unsafe fn gemm(&self, _g: &Gemm) {}
}

/// A device whose every call is checked against [`Checks`] and then done by `W`
/// ([`super::EmuDriver`], [`super::MetaDriver`]).
#[derive(Debug)]
pub struct Checked<W: Work> {
    /// What every call is checked against.
    pub(super) checks: Checks,
    pub(super) work: W,
}

impl<W: Work> Checked<W> {
    /// Host bytes currently registered with [`Driver::host_register`].
    pub fn registered_host_bytes(&self) -> usize {
        self.checks.registered_host_bytes()
    }
}

impl<W: Work> Drop for Checked<W> {
    fn drop(&mut self) {
        // Like destroying a context: everything still allocated goes back.
        for (start, len) in self.checks.memory_mut().live() {
            // SAFETY: allocated by `malloc` and not yet freed; nothing can reach it any more.
            unsafe { self.work.release(DevPtr(start), len) };
        }
    }
}

impl<W: Work> Driver for Checked<W> {
    fn info(&self) -> &DeviceInfo {
        &self.checks.info
    }

    fn malloc(&self, bytes: usize) -> Result<DevPtr> {
        let mut mem = self.checks.admit(bytes)?;
        let Some(p) = self.work.alloc(bytes)? else {
            let why = "the host allocator refused".to_string();
            return Err(self.checks.out_of_memory(&mem, bytes, why));
        };
        mem.insert(p.0, bytes as u64);
        Ok(p)
    }

    unsafe fn free(&self, p: DevPtr) -> Result<()> {
        let len = self.checks.free(p)?;
        // SAFETY: removed from the table above, so released exactly once; no other operation
        // reaches a pointer no longer in the table.
        unsafe { self.work.release(p, len) };
        Ok(())
    }

    fn memset_zero(&self, p: DevPtr, bytes: usize, s: StreamKind) -> Result<()> {
        let _mem = self.checks.memset(p, bytes, s)?;
        // SAFETY: checked to lie inside a live allocation; the lock excludes frees.
        unsafe { self.work.zero(p, bytes) };
        Ok(())
    }

    fn copy_dtod(&self, src: DevPtr, dst: DevPtr, bytes: usize, s: StreamKind) -> Result<()> {
        let _mem = self.checks.copy_dtod((src, dst), bytes, s)?;
        // SAFETY: both ranges checked inside live allocations and disjoint.
        unsafe { self.work.copy(src.0 as *const u8, dst.0 as *mut u8, bytes) };
        Ok(())
    }

    unsafe fn copy_htod_async(&self, src: *const [u8], dst: DevPtr, s: StreamKind) -> Result<()> {
        let op = ("cuMemcpyHtoDAsync", "destination");
        let _mem = self.checks.host_copy(op, dst, src.len(), s)?;
        // SAFETY: the caller guarantees `src` is readable; the destination is checked.
        unsafe { self.work.copy(src.cast(), dst.0 as *mut u8, src.len()) };
        Ok(())
    }

    unsafe fn copy_dtoh_async(&self, src: DevPtr, dst: *mut [u8], s: StreamKind) -> Result<()> {
        let _mem = self
            .checks
            .host_copy(("cuMemcpyDtoHAsync", "source"), src, dst.len(), s)?;
        // SAFETY: the caller guarantees `dst` is writable; the source is checked.
        unsafe { self.work.copy(src.0 as *const u8, dst.cast(), dst.len()) };
        Ok(())
    }

    fn kernel(&self, name: &str) -> Result<Kernel> {
        let i = self.checks.lookup(name)?;
        let file = &self.checks.programs[self.checks.kernels[i].0].file;
        self.work.loadable(name, file)?;
        Ok(Kernel(i as u32))
    }

    unsafe fn launch(
        &self,
        k: Kernel,
        cfg: &LaunchConfig,
        params: &mut [*mut c_void],
        s: StreamKind,
    ) -> Result<()> {
        // SAFETY: the caller's contract: `params` matches the kernel's parameters.
        let (_, kernel) = unsafe { self.checks.launch(k, cfg, params, s) }?;
        // Kernels read and write device memory directly: keep frees out while one runs.
        let _mem = self.checks.memory();
        // SAFETY: the caller's contract, and the configuration is checked.
        unsafe { self.work.launch(kernel, cfg, params) }
    }

    fn gemm(&self, g: &Gemm, s: StreamKind) -> Result<()> {
        let _mem = self.checks.gemm(g, s)?;
        // SAFETY: validated, and every operand range lies inside a live allocation; the lock
        // keeps frees out until it is done.
        unsafe { self.work.gemm(g) };
        Ok(())
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
        // The host learns that the event's work finished (it always has: work runs at issue,
        // or not at all).
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
        self.checks.copy_unified((src, dst), bytes, s, owners)?;
        // No table lock here: the ranges may belong to other drivers, whose owners keep them
        // alive for the copy (the caller's contract).
        // SAFETY: the caller checked both ranges live and disjoint.
        unsafe { self.work.copy(src.0 as *const u8, dst.0 as *mut u8, bytes) };
        Ok(())
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
