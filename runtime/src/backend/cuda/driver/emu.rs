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
use std::collections::{HashMap, HashSet};
use std::ffi::{c_char, c_void, CString};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use super::gemm::Gemm;
use super::order;
use super::table::AllocTable;
use super::{
    build_builtin_emulator, builtin_programs, kernel_table, unknown_kernel, DevPtr, DeviceInfo,
    Driver, Event, Kernel, LaunchConfig, Program, StreamKind,
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
    info: DeviceInfo,
    /// The memory table; held during every operation that touches device memory, so a free
    /// cannot race with a copy, a GEMM or a kernel.
    memory: Mutex<AllocTable>,
    programs: Vec<Program>,
    /// Per kernel: its program index, name and the name as a C string for the library.
    kernels: Vec<(usize, String, CString)>,
    lib: Option<Arc<EmuLib>>,
    events: Mutex<HashSet<u64>>,
    next_event: AtomicU64,
    /// Registered host ranges: start address -> (first page, page after the last, bytes).
    registered: Mutex<HashMap<usize, (usize, usize, usize)>>,
    /// This driver's identity in the process's stream-order book (`order.rs`).
    id: u64,
    /// Epilogues (cuBLASLt's names) whose products are refused as a real cuBLASLt refuses a
    /// product its heuristic has no algorithm for: to test the backend's separate kernels.
    refused: Vec<&'static str>,
}

/// The page size CUDA pins host memory in.
const HOST_PAGE: usize = 4096;

impl EmuDriver {
    /// An emulated device as `options` describe it (loads the library, if any, once per
    /// process).
    pub fn new(options: EmuOptions) -> Result<Self> {
        let table = kernel_table(&options.programs)?;
        let kernels = table
            .into_iter()
            .map(|(p, name)| {
                let c = CString::new(name.as_str())
                    .map_err(|_| Error::Invalid(format!("kernel name {name:?} contains NUL")))?;
                Ok((p, name, c))
            })
            .collect::<Result<Vec<_>>>()?;
        let lib = options.library.as_deref().map(load_library).transpose()?;
        Ok(EmuDriver {
            info: DeviceInfo {
                name: "ferrozero CUDA emulator (CPU)".into(),
                ordinal: 0,
                compute_capability: (9, 0),
                total_memory: options.total_memory,
                multiprocessors: 132,
                max_dyn_smem_per_block: EMU_MAX_DYN_SMEM,
                driver_version: None,
                nvrtc_version: None,
                cublaslt_version: None,
                emulated: true,
            },
            memory: Mutex::new(AllocTable::default()),
            programs: options.programs,
            kernels,
            lib,
            events: Mutex::new(HashSet::new()),
            next_event: AtomicU64::new(1),
            registered: Mutex::new(HashMap::new()),
            id: {
                static NEXT: AtomicU64 = AtomicU64::new(1);
                NEXT.fetch_add(1, Ordering::Relaxed)
            },
            refused: Vec::new(),
        })
    }

    /// This driver, refusing every product with one of `epilogues` (cuBLASLt's names, e.g.
    /// `CUBLASLT_EPILOGUE_BGRADA`) with [`Error::GemmRefused`], as a real cuBLASLt does when its
    /// heuristic returns no algorithm.
    pub fn refusing(mut self, epilogues: &[&'static str]) -> Self {
        self.refused = epilogues.to_vec();
        self
    }

    /// Host bytes currently registered with [`Driver::host_register`].
    pub fn registered_host_bytes(&self) -> usize {
        let r = self.registered.lock().unwrap_or_else(|e| e.into_inner());
        r.values().map(|&(_, _, len)| len).sum()
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

    fn memory(&self) -> MutexGuard<'_, AllocTable> {
        // A panic while holding the table cannot leave it inconsistent in a way that matters
        // more than the panic itself; keep serving.
        self.memory.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn check_event(&self, op: &str, e: Event) -> Result<()> {
        if self
            .events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(&e.0)
        {
            Ok(())
        } else {
            Err(Error::Device {
                op: op.into(),
                detail: format!("CUDA_ERROR_INVALID_HANDLE: event {} is not live", e.0),
            })
        }
    }
}

/// The bytes `p..p + bytes`, for the order check.
fn span(p: DevPtr, bytes: usize) -> order::Span {
    (p.0, p.0 + bytes as u64)
}

impl EmuDriver {
    /// What kernel `name`'s declared pointer arguments reach (none for a kernel the registry's
    /// parameter table does not declare: a test's own).
    ///
    /// # Safety
    /// `params` holds one pointer per parameter of `name`, each to a value of its type.
    unsafe fn reach(&self, name: &str, params: &[*mut c_void]) -> Vec<order::Span> {
        use crate::backend::cuda::kernels::params::{params_of, ArgKind};
        let Some((declared, _)) = params_of(name) else {
            return Vec::new();
        };
        let ptrs = declared
            .iter()
            .zip(params)
            .filter(|(d, _)| d.ty.kind() == ArgKind::Ptr)
            // SAFETY: a pointer parameter's value is a device address (8 bytes).
            .map(|(_, &v)| unsafe { *(v as *const u64) });
        order::reach(self.id, ptrs)
    }
}

impl Drop for EmuDriver {
    fn drop(&mut self) {
        order::closed(self.id);
        // Like destroying a context: everything still allocated goes back.
        let mem = self.memory.get_mut().unwrap_or_else(|e| e.into_inner());
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
        &self.info
    }

    fn malloc(&self, bytes: usize) -> Result<DevPtr> {
        if bytes == 0 {
            return Err(Error::Device {
                op: "cuMemAlloc".into(),
                detail: "CUDA_ERROR_INVALID_VALUE: zero bytes requested".into(),
            });
        }
        let mut mem = self.memory();
        let total = self.info.total_memory;
        if mem.allocated().saturating_add(bytes as u64) > total {
            return Err(Error::DeviceMemory {
                requested: bytes as u64,
                live: mem.allocated(),
                peak: mem.peak(),
                limit: total,
                detail: format!(
                    "cuMemAlloc: CUDA_ERROR_OUT_OF_MEMORY: out of memory (emulated device of \
                     {total} bytes)"
                ),
            });
        }
        let layout = Layout::from_size_align(bytes, ALIGN).map_err(|e| Error::Device {
            op: "cuMemAlloc".into(),
            detail: format!("CUDA_ERROR_INVALID_VALUE: {bytes} bytes: {e}"),
        })?;
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { std::alloc::alloc(layout) };
        if p.is_null() {
            return Err(Error::DeviceMemory {
                requested: bytes as u64,
                live: mem.allocated(),
                peak: mem.peak(),
                limit: total,
                detail: "cuMemAlloc: CUDA_ERROR_OUT_OF_MEMORY: the host allocator refused".into(),
            });
        }
        // SAFETY: `p` is a fresh allocation of `bytes` bytes.
        unsafe { std::ptr::write_bytes(p, 0xFF, bytes) };
        mem.insert(p as u64, bytes as u64);
        Ok(DevPtr(p as u64))
    }

    unsafe fn free(&self, p: DevPtr) -> Result<()> {
        let len = self.memory().remove(p)?;
        // cuMemFree waits for the device.
        StreamKind::ALL
            .into_iter()
            .for_each(|s| order::synchronized(self.id, s));
        // SAFETY: allocated in `malloc` with this layout, removed from the table above, so it
        // is freed exactly once; the table lock keeps every other operation off it.
        unsafe {
            std::alloc::dealloc(
                p.0 as *mut u8,
                Layout::from_size_align_unchecked(len as usize, ALIGN),
            )
        };
        Ok(())
    }

    fn memset_zero(&self, p: DevPtr, bytes: usize, s: StreamKind) -> Result<()> {
        order::issue(self.id, s, &[span(p, bytes)])?;
        let mem = self.memory();
        mem.check("cuMemsetD8Async", "destination", p, bytes as u64)?;
        // SAFETY: checked to lie inside a live allocation; the lock excludes frees.
        unsafe { std::ptr::write_bytes(p.0 as *mut u8, 0, bytes) };
        Ok(())
    }

    fn copy_htod(&self, src: &[u8], dst: DevPtr, s: StreamKind) -> Result<()> {
        // SAFETY: `src` is a valid slice for the duration of the (synchronous) copy.
        unsafe { self.copy_htod_async(src.as_ptr(), src.len(), dst, s) }?;
        order::synchronized(self.id, s);
        Ok(())
    }

    fn copy_dtoh(&self, src: DevPtr, dst: &mut [u8], s: StreamKind) -> Result<()> {
        // SAFETY: `dst` is a valid, exclusive slice for the duration of the (synchronous) copy.
        unsafe { self.copy_dtoh_async(src, dst.as_mut_ptr(), dst.len(), s) }?;
        order::synchronized(self.id, s);
        Ok(())
    }

    fn check_live(&self, op: &str, what: &str, p: DevPtr, bytes: u64) -> Result<()> {
        self.memory().check(op, what, p, bytes)
    }

    unsafe fn copy_unified(
        &self,
        src: DevPtr,
        dst: DevPtr,
        bytes: usize,
        s: StreamKind,
        owners: [u64; 2],
    ) -> Result<()> {
        order::access(self.id, s, (src.0, dst.0, bytes as u64), owners)?;
        // No table lock here: the ranges may belong to other drivers, whose owners keep them
        // alive for the copy (the caller's contract); emulated device memory is host memory.
        // SAFETY: the caller checked both ranges live and disjoint.
        unsafe { std::ptr::copy_nonoverlapping(src.0 as *const u8, dst.0 as *mut u8, bytes) };
        Ok(())
    }

    fn copy_dtod(&self, src: DevPtr, dst: DevPtr, bytes: usize, s: StreamKind) -> Result<()> {
        order::issue(self.id, s, &[span(src, bytes), span(dst, bytes)])?;
        let mem = self.memory();
        mem.check_copy(src, dst, bytes as u64)?;
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
        order::host_copy(self.id, s, span(dst, len))?;
        let mem = self.memory();
        mem.check("cuMemcpyHtoDAsync", "destination", dst, len as u64)?;
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
        order::host_copy(self.id, s, span(src, len))?;
        let mem = self.memory();
        mem.check("cuMemcpyDtoHAsync", "source", src, len as u64)?;
        // SAFETY: the caller guarantees `dst..dst + len` is writable; the source is checked.
        unsafe { std::ptr::copy(src.0 as *const u8, dst, len) };
        Ok(())
    }

    fn kernel(&self, name: &str) -> Result<Kernel> {
        let Some(i) = self.kernels.iter().position(|(_, n, _)| n == name) else {
            return Err(unknown_kernel(name, &self.programs));
        };
        if self.lib.is_none() {
            return Err(Error::Device {
                op: "cuModuleLoadData".into(),
                detail: format!(
                    "kernel {name} ({}) cannot run: this emulated device has no emulator library",
                    self.programs[self.kernels[i].0].file
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
        let Some((_, name, cname)) = self.kernels.get(k.index()) else {
            return Err(Error::Device {
                op: "cuLaunchKernel".into(),
                detail: format!(
                    "CUDA_ERROR_INVALID_HANDLE: kernel handle {} is not from this device ({} \
                     kernels)",
                    k.0,
                    self.kernels.len()
                ),
            });
        };
        cfg.validate(name, self.info.max_dyn_smem_per_block)?;
        // SAFETY: the caller's contract: `params` matches the kernel's parameters.
        order::issue(self.id, s, &unsafe { self.reach(name, params) })?;
        let Some(lib) = &self.lib else {
            return Err(Error::Device {
                op: "cuLaunchKernel".into(),
                detail: format!("kernel {name}: this emulated device has no emulator library"),
            });
        };
        // Kernels read and write device memory directly: keep frees out while one runs.
        let _mem = self.memory();
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
        g.validate()?;
        if self.refused.contains(&g.epilogue.cublas_name()) {
            return Err(Error::GemmRefused {
                epilogue: g.epilogue.cublas_name(),
                detail: format!(
                    "CUBLAS_STATUS_NOT_SUPPORTED (the emulator refuses it) for {}",
                    g.describe()
                ),
            });
        }
        let spans: Vec<_> = g
            .ranges()?
            .iter()
            .map(|r| (r.start, r.start + r.bytes))
            .collect();
        order::issue(self.id, s, &spans)?;
        let mem = self.memory();
        for r in g.ranges()? {
            mem.check("cublasLtMatmul", r.what, DevPtr(r.start), r.bytes)?;
        }
        // SAFETY: validated, and every operand range lies inside a live allocation; the lock
        // keeps frees out until it is done.
        unsafe { g.reference() };
        Ok(())
    }

    fn synchronize(&self, s: StreamKind) -> Result<()> {
        order::synchronized(self.id, s);
        Ok(())
    }

    fn event_create(&self) -> Result<Event> {
        let id = self.next_event.fetch_add(1, Ordering::Relaxed);
        self.events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id);
        Ok(Event(id))
    }

    fn event_record(&self, e: Event, s: StreamKind) -> Result<()> {
        self.check_event("cuEventRecord", e)?;
        order::record(self.id, s, e.0);
        Ok(())
    }

    fn stream_wait_event(&self, s: StreamKind, e: Event) -> Result<()> {
        self.check_event("cuStreamWaitEvent", e)?;
        order::wait(self.id, s, self.id, e.0);
        Ok(())
    }

    fn check_event_live(&self, op: &str, e: Event) -> Result<()> {
        self.check_event(op, e)
    }

    unsafe fn stream_wait_unified(&self, s: StreamKind, owner: u64, e: Event) -> Result<()> {
        order::wait(self.id, s, owner, e.0);
        Ok(())
    }

    fn peer_id(&self) -> u64 {
        self.id
    }

    fn note_buffer(&self, p: DevPtr, bytes: u64) {
        order::buffer(self.id, p.0, bytes);
    }

    fn event_query(&self, e: Event) -> Result<bool> {
        self.check_event("cuEventQuery", e)?;
        // The host learns that the event's work finished (it always has, here).
        order::event_synchronized(self.id, e.0);
        Ok(true)
    }

    fn event_synchronize(&self, e: Event) -> Result<()> {
        self.check_event("cuEventSynchronize", e)?;
        order::event_synchronized(self.id, e.0);
        Ok(())
    }

    fn event_destroy(&self, e: Event) -> Result<()> {
        if self
            .events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&e.0)
        {
            order::destroyed(self.id, e.0);
            Ok(())
        } else {
            Err(Error::Device {
                op: "cuEventDestroy".into(),
                detail: format!("CUDA_ERROR_INVALID_HANDLE: event {} is not live", e.0),
            })
        }
    }

    fn allocated(&self) -> u64 {
        self.memory().allocated()
    }

    unsafe fn host_register(&self, ptr: *mut u8, len: usize) -> Result<()> {
        let refuse = |why: &str| Error::Device {
            op: "cuMemHostRegister".into(),
            detail: why.into(),
        };
        if ptr.is_null() || len == 0 {
            return Err(refuse(
                "CUDA_ERROR_INVALID_VALUE: null pointer or zero bytes",
            ));
        }
        let (first, end) = (
            ptr as usize / HOST_PAGE,
            (ptr as usize + len).div_ceil(HOST_PAGE),
        );
        let mut r = self.registered.lock().unwrap_or_else(|e| e.into_inner());
        if r.values().any(|&(f, e, _)| first < e && f < end) {
            return Err(refuse(
                "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED: part of the range is registered",
            ));
        }
        r.insert(ptr as usize, (first, end, len));
        Ok(())
    }

    unsafe fn host_unregister(&self, ptr: *mut u8) -> Result<()> {
        let mut r = self.registered.lock().unwrap_or_else(|e| e.into_inner());
        match r.remove(&(ptr as usize)) {
            Some(_) => Ok(()),
            None => Err(Error::Device {
                op: "cuMemHostUnregister".into(),
                detail: "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED: no registered range starts there"
                    .into(),
            }),
        }
    }
}
