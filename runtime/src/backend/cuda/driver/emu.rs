//! The emulated driver: device memory is host memory, streams and events are synchronous,
//! kernels run in the CPU emulator library (`fz_emu_launch`), GEMMs in the reference loop of
//! `gemm/reference.rs`.
//!
//! It is how the CUDA backend is tested without a GPU, so it is strict where a GPU would fault
//! or silently misbehave: every copy, memset, free and GEMM operand is checked against a table
//! of live allocations (an out-of-range, freed or foreign pointer is an [`Error::Device`] naming
//! the call, never undefined behaviour), overlapping copy ranges and unknown kernels are
//! rejected, allocations come back filled with 0xFF (NaN in every float type) instead of zeros,
//! and memory is limited to a configurable total (16 GiB by default).
//!
//! Kernel launches are the one thing it cannot check: a kernel runs on the host addresses it is
//! given. Launch configurations are checked like the GPU checks them.
//!
//! Streams run every operation at issue, so a missing event wait cannot show as stale data;
//! instead every operation is entered in the process's order book (`order.rs`), which refuses
//! memory touched across streams without an event or host wait between them.

use std::alloc::Layout;
use std::collections::HashMap;
use std::ffi::{c_char, c_void};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use super::checks::Checks;
use super::gemm::Gemm;
use super::{
    build_builtin_emulator, builtin_programs, DevPtr, DeviceInfo, Driver, Event, Kernel,
    LaunchConfig, Program, StreamKind,
};
use crate::{Error, Result};

/// The emulated device's memory unless [`EmuOptions::total_memory`] says otherwise.
pub const EMU_DEFAULT_TOTAL_MEMORY: u64 = 16 << 30;

/// The alignment of every emulated allocation (cudaMalloc guarantees at least 256 bytes).
const ALIGN: usize = 256;

/// H100's per-block dynamic shared memory limit (227 KiB), which the emulator enforces too.
const EMU_MAX_DYN_SMEM: u32 = 227 * 1024;

/// How to build an [`EmuDriver`].
#[derive(Debug, Clone)]
pub struct EmuOptions {
    /// Device memory in bytes: allocations beyond it fail as out of memory.
    pub total_memory: u64,
    /// The emulator library exporting `fz_emu_launch` (built by `emu::build_library`, or a
    /// test's own); without one, kernels cannot be launched.
    pub library: Option<PathBuf>,
    /// The kernel sources whose kernels the library contains.
    pub programs: Vec<Program>,
}

impl Default for EmuOptions {
    fn default() -> Self {
        EmuOptions {
            total_memory: EMU_DEFAULT_TOTAL_MEMORY,
            library: None,
            programs: Vec::new(),
        }
    }
}

/// `fz_emu_launch`'s signature (see the kernels registry's emulator).
type LaunchFn = unsafe extern "C" fn(
    kernel: *const c_char,
    grid: *const u32,
    block: *const u32,
    dyn_smem_bytes: u64,
    params: *mut *mut c_void,
    err: *mut c_char,
    err_len: u64,
) -> i32;

/// A loaded emulator library (kept loaded for the life of the process).
struct EmuLib {
    path: PathBuf,
    launch: LaunchFn,
    _lib: libloading::Library,
}

impl std::fmt::Debug for EmuLib {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "EmuLib({})", self.path.display())
    }
}

/// Loads `path` once per process (a second driver over the same library shares it).
fn load_library(path: &Path) -> Result<Arc<EmuLib>> {
    static LIBS: OnceLock<Mutex<HashMap<PathBuf, Arc<EmuLib>>>> = OnceLock::new();
    let mut libs = LIBS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(lib) = libs.get(path) {
        return Ok(lib.clone());
    }
    let fail = |detail: String| Error::Device {
        op: "dlopen(emulator library)".into(),
        detail: format!("{}: {detail}", path.display()),
    };
    // SAFETY: the library is ours (the kernels registry's emulator or a test's), its
    // initialisers have no preconditions, and it stays loaded for the rest of the process.
    let lib = unsafe { libloading::Library::new(path) }.map_err(|e| fail(e.to_string()))?;
    // SAFETY: `fz_emu_launch` has exactly the `LaunchFn` signature (the emulator's contract);
    // the pointer is used only while `_lib` keeps the library loaded.
    let launch = unsafe { lib.get::<LaunchFn>(b"fz_emu_launch\0") }
        .map(|s| *s)
        .map_err(|e| fail(format!("no fz_emu_launch symbol: {e}")))?;
    let lib = Arc::new(EmuLib {
        path: path.to_path_buf(),
        launch,
        _lib: lib,
    });
    libs.insert(path.to_path_buf(), lib.clone());
    Ok(lib)
}

/// Where the builtin emulator library is built: `$FERROZERO_EMU_DIR`, else `ferrozero-emu`
/// inside the nearest `target` directory above the running executable (tests and examples run
/// from there), else the system temporary directory.
pub(crate) fn emu_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("FERROZERO_EMU_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    if let Ok(exe) = std::env::current_exe() {
        if let Some(t) = exe
            .ancestors()
            .find(|a| a.file_name().is_some_and(|n| n == "target"))
        {
            return t.join("ferrozero-emu");
        }
    }
    std::env::temp_dir().join("ferrozero-emu")
}

/// The emulated driver (see the module documentation).
#[derive(Debug)]
pub struct EmuDriver {
    /// What every call is checked against, shared with the size-only driver.
    checks: Checks,
    lib: Option<Arc<EmuLib>>,
}

/// H100's shape as the emulator describes itself: what launch grids and shared memory are
/// checked against.
fn emu_info(total_memory: u64) -> DeviceInfo {
    DeviceInfo {
        name: "ferrozero CUDA emulator (CPU)".into(),
        ordinal: 0,
        compute_capability: (9, 0),
        total_memory,
        multiprocessors: 132,
        max_dyn_smem_per_block: EMU_MAX_DYN_SMEM,
        driver_version: None,
        nvrtc_version: None,
        cublaslt_version: None,
        emulated: true,
        sizes_only: false,
    }
}

impl EmuDriver {
    /// An emulated device as `options` describe it (loads the library, if any, once per
    /// process).
    pub fn new(options: EmuOptions) -> Result<Self> {
        let checks = Checks::new(emu_info(options.total_memory), options.programs)?;
        let lib = options.library.as_deref().map(load_library).transpose()?;
        Ok(EmuDriver { checks, lib })
    }

    /// This driver, refusing every product with one of `epilogues` (cuBLASLt's names, e.g.
    /// `CUBLASLT_EPILOGUE_BGRADA`) with [`Error::GemmRefused`], as a real cuBLASLt does when its
    /// heuristic returns no algorithm.
    pub fn refusing(mut self, epilogues: &[&'static str]) -> Self {
        self.checks.refused = epilogues.to_vec();
        self
    }

    /// Host bytes currently registered with [`Driver::host_register`].
    pub fn registered_host_bytes(&self) -> usize {
        self.checks.registered_host_bytes()
    }

    /// The emulator with ferrozero's kernel registry; its library is built (once per process,
    /// reused across processes by content hash) under `$FERROZERO_EMU_DIR`, else
    /// `ferrozero-emu` in the nearest `target` directory above the running executable, else the
    /// system temporary directory.
    pub fn builtin() -> Result<Self> {
        static BUILT: OnceLock<Option<std::result::Result<PathBuf, String>>> = OnceLock::new();
        let built = BUILT.get_or_init(|| build_builtin_emulator(&emu_dir()));
        let library = match built {
            None => None,
            Some(Ok(path)) => Some(path.clone()),
            Some(Err(e)) => {
                return Err(Error::Device {
                    op: "emu::build_library".into(),
                    detail: e.clone(),
                })
            }
        };
        EmuDriver::new(EmuOptions {
            library,
            programs: builtin_programs(),
            ..EmuOptions::default()
        })
    }
}

impl Drop for EmuDriver {
    fn drop(&mut self) {
        // Like destroying a context: everything still allocated goes back.
        let mem = self.checks.memory_mut();
        for (start, len) in mem.live() {
            // SAFETY: allocated in `malloc` with exactly this layout and not yet freed.
            unsafe {
                std::alloc::dealloc(
                    start as *mut u8,
                    Layout::from_size_align_unchecked(len as usize, ALIGN),
                )
            };
        }
    }
}

impl Driver for EmuDriver {
    fn info(&self) -> &DeviceInfo {
        &self.checks.info
    }

    fn malloc(&self, bytes: usize) -> Result<DevPtr> {
        let mut mem = self.checks.admit(bytes)?;
        let layout = Layout::from_size_align(bytes, ALIGN).map_err(|e| Error::Device {
            op: "cuMemAlloc".into(),
            detail: format!("CUDA_ERROR_INVALID_VALUE: {bytes} bytes: {e}"),
        })?;
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { std::alloc::alloc(layout) };
        if p.is_null() {
            let why = "the host allocator refused".to_string();
            return Err(self.checks.out_of_memory(&mem, bytes, why));
        }
        // SAFETY: `p` is a fresh allocation of `bytes` bytes.
        unsafe { std::ptr::write_bytes(p, 0xFF, bytes) };
        mem.insert(p as u64, bytes as u64);
        Ok(DevPtr(p as u64))
    }

    unsafe fn free(&self, p: DevPtr) -> Result<()> {
        let len = self.checks.free(p)?;
        // SAFETY: allocated in `malloc` with this layout, removed from the table above, so it
        // is freed exactly once; no other operation reaches a pointer no longer in the table.
        unsafe {
            std::alloc::dealloc(
                p.0 as *mut u8,
                Layout::from_size_align_unchecked(len as usize, ALIGN),
            )
        };
        Ok(())
    }

    fn memset_zero(&self, p: DevPtr, bytes: usize, s: StreamKind) -> Result<()> {
        let _mem = self.checks.memset(p, bytes, s)?;
        // SAFETY: checked to lie inside a live allocation; the lock excludes frees.
        unsafe { std::ptr::write_bytes(p.0 as *mut u8, 0, bytes) };
        Ok(())
    }

    fn copy_htod(&self, src: &[u8], dst: DevPtr, s: StreamKind) -> Result<()> {
        // SAFETY: `src` is a valid slice for the duration of the (synchronous) copy.
        unsafe { self.copy_htod_async(src.as_ptr(), src.len(), dst, s) }?;
        self.checks.synchronized(s);
        Ok(())
    }

    fn copy_dtoh(&self, src: DevPtr, dst: &mut [u8], s: StreamKind) -> Result<()> {
        // SAFETY: `dst` is a valid, exclusive slice for the duration of the (synchronous) copy.
        unsafe { self.copy_dtoh_async(src, dst.as_mut_ptr(), dst.len(), s) }?;
        self.checks.synchronized(s);
        Ok(())
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
        // alive for the copy (the caller's contract); emulated device memory is host memory.
        // SAFETY: the caller checked both ranges live and disjoint.
        unsafe { std::ptr::copy_nonoverlapping(src.0 as *const u8, dst.0 as *mut u8, bytes) };
        Ok(())
    }

    fn copy_dtod(&self, src: DevPtr, dst: DevPtr, bytes: usize, s: StreamKind) -> Result<()> {
        let _mem = self.checks.copy_dtod((src, dst), bytes, s)?;
        // SAFETY: both ranges checked inside live allocations and disjoint.
        unsafe { std::ptr::copy_nonoverlapping(src.0 as *const u8, dst.0 as *mut u8, bytes) };
        Ok(())
    }

    unsafe fn copy_htod_async(
        &self,
        src: *const u8,
        len: usize,
        dst: DevPtr,
        s: StreamKind,
    ) -> Result<()> {
        let _mem = self.checks.copy_htod(dst, len, s)?;
        // SAFETY: the caller guarantees `src..src + len` is readable; the destination is checked.
        unsafe { std::ptr::copy(src, dst.0 as *mut u8, len) };
        Ok(())
    }

    unsafe fn copy_dtoh_async(
        &self,
        src: DevPtr,
        dst: *mut u8,
        len: usize,
        s: StreamKind,
    ) -> Result<()> {
        let _mem = self.checks.copy_dtoh(src, len, s)?;
        // SAFETY: the caller guarantees `dst..dst + len` is writable; the source is checked.
        unsafe { std::ptr::copy(src.0 as *const u8, dst, len) };
        Ok(())
    }

    fn kernel(&self, name: &str) -> Result<Kernel> {
        let i = self.checks.lookup(name)?;
        if self.lib.is_none() {
            return Err(Error::Device {
                op: "cuModuleLoadData".into(),
                detail: format!(
                    "kernel {name} ({}) cannot run: this emulated device has no emulator library",
                    self.checks.programs[self.checks.kernels[i].0].file
                ),
            });
        }
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
        let (name, cname) = unsafe { self.checks.launch(k, cfg, params, s) }?;
        let Some(lib) = &self.lib else {
            return Err(Error::Device {
                op: "cuLaunchKernel".into(),
                detail: format!("kernel {name}: this emulated device has no emulator library"),
            });
        };
        // Kernels read and write device memory directly: keep frees out while one runs.
        let _mem = self.checks.memory();
        let mut err = vec![0u8; 1024];
        // SAFETY: the caller guarantees `params` matches the kernel's parameters and points to
        // live memory; the grid, block and error buffers outlive the call.
        let rc = unsafe {
            (lib.launch)(
                cname.as_ptr(),
                cfg.grid.as_ptr(),
                cfg.block.as_ptr(),
                u64::from(cfg.dyn_smem),
                params.as_mut_ptr(),
                err.as_mut_ptr() as *mut c_char,
                err.len() as u64,
            )
        };
        if rc != 0 {
            let end = err.iter().position(|&b| b == 0).unwrap_or(err.len());
            return Err(Error::Device {
                op: "cuLaunchKernel".into(),
                detail: format!(
                    "kernel {name} (grid {:?}, block {:?}, {} bytes dynamic shared memory) failed \
                     in the emulator ({rc}): {}",
                    cfg.grid,
                    cfg.block,
                    cfg.dyn_smem,
                    String::from_utf8_lossy(&err[..end])
                ),
            });
        }
        Ok(())
    }

    fn gemm(&self, g: &Gemm, s: StreamKind) -> Result<()> {
        let _mem = self.checks.gemm(g, s)?;
        // SAFETY: validated, and every operand range lies inside a live allocation; the lock
        // keeps frees out until it is done.
        unsafe { g.reference() };
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

    fn event_query(&self, e: Event) -> Result<bool> {
        // The host learns that the event's work finished (it always has, here).
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
}
