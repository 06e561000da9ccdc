//! The real driver over cudarc 0.19: the device's primary context, four non-blocking streams
//! (compute, host-to-device, device-to-host, collective), raw device memory (`cuMemAlloc`/`cuMemFree`;
//! the caching allocator sits on top, so the driver is asked rarely and stream-ordered
//! allocation buys nothing), modules loaded from NVRTC's cached CUBIN, kernels launched with
//! raw parameter arrays (`cuLaunchKernel`), cuBLASLt with a 32 MiB workspace per stream and
//! each product's descriptors and algorithm cached per `PlanKey`, and events (which another
//! driver of the process may wait for: `stream_wait_unified`).
//!
//! Host copies: `copy_htod` queues `cuMemcpyHtoDAsync` and then synchronizes that stream, so
//! the source may be reused on return whether it is pageable or page-locked (for pageable
//! memory the driver stages it anyway; an overlapped upload uses `copy_htod_async` from
//! page-locked memory). `copy_dtoh` likewise synchronizes, so the data is present on return.
//!
//! Every cudarc, cuBLASLt and NVRTC failure becomes [`Error::Device`] with the call's name and
//! the library's own error name and message. Pointers and ranges are checked against the table
//! of this driver's allocations first, exactly as the emulator checks them.

use std::collections::HashSet;
use std::ffi::c_void;
use std::fmt;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use cudarc::cublaslt::sys as ltsys;
use cudarc::driver::{
    result as cu, sys as cusys, CudaContext, CudaFunction, CudaModule, CudaStream,
};
use cudarc::nvrtc::Ptx;

use super::cublaslt::Blas;
use super::gemm::Gemm;
use super::nvrtc::{self, ImageKind, Target};
use super::table::AllocTable;
use super::{
    freeze, kernel_table, thaw, unknown_kernel, DevPtr, DeviceInfo, Driver, Event, Frozen, Kernel,
    LaunchConfig, Program, StreamKind,
};
use crate::{Error, Result};

/// The oldest driver this build talks to: CUDA 12.0 (every driver call used here exists there,
/// and NVRTC 12 CUBINs load on any 12.x driver).
const MIN_DRIVER: (u32, u32) = (12, 0);

/// Dynamic shared memory a kernel may use without opting in.
const DEFAULT_DYN_SMEM: u32 = 48 * 1024;

/// The driver's name and message for an error, e.g. `CUDA_ERROR_OUT_OF_MEMORY: out of memory`.
pub(super) fn driver_words(e: cu::DriverError) -> String {
    let name = e
        .error_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("{:?}", e.0));
    match e.error_string() {
        Ok(msg) => format!("{name}: {}", msg.to_string_lossy()),
        Err(_) => name,
    }
}

pub(super) fn cu_err(op: &str, e: cu::DriverError) -> Error {
    Error::Device {
        op: op.into(),
        detail: driver_words(e),
    }
}

/// Loads and initialises the driver library once per process; the CUDA version it supports.
fn init_driver() -> Result<(u32, u32)> {
    static INIT: OnceLock<std::result::Result<(u32, u32), String>> = OnceLock::new();
    INIT.get_or_init(|| {
        // SAFETY: only tries to open the library. cudarc panics on any driver call when the
        // library is missing, so nothing below runs without this check.
        if !unsafe { cusys::is_culib_present() } {
            return Err(
                "no CUDA device: the NVIDIA driver library (libcuda.so / libcuda.so.1) \
                        could not be loaded; is the NVIDIA driver installed, and its library \
                        directory on the loader's path (LD_LIBRARY_PATH)?"
                    .into(),
            );
        }
        let mut v = 0;
        // SAFETY: a valid out-pointer; cuDriverGetVersion needs no cuInit.
        unsafe { cusys::cuDriverGetVersion(&mut v) }
            .result()
            .map_err(|e| format!("no CUDA device: cuDriverGetVersion: {}", driver_words(e)))?;
        let version = (v as u32 / 1000, (v as u32 % 1000) / 10);
        if version < MIN_DRIVER {
            return Err(format!(
                "no CUDA device: the NVIDIA driver is too old: it supports CUDA {}.{}, ferrozero \
                 needs {}.{} or newer (a 525 or newer driver)",
                version.0, version.1, MIN_DRIVER.0, MIN_DRIVER.1
            ));
        }
        cu::init().map_err(|e| match e.0 {
            cusys::CUresult::CUDA_ERROR_NO_DEVICE => "no CUDA device: the NVIDIA driver is \
                installed but sees no GPU (cuInit: CUDA_ERROR_NO_DEVICE); check nvidia-smi and \
                CUDA_VISIBLE_DEVICES"
                .to_string(),
            cusys::CUresult::CUDA_ERROR_SYSTEM_DRIVER_MISMATCH => format!(
                "no CUDA device: the NVIDIA kernel driver and its user-space library \
                 (libcuda) are different versions (cuInit: {})",
                driver_words(e)
            ),
            _ => format!("no CUDA device: cuInit failed: {}", driver_words(e)),
        })?;
        Ok(version)
    })
    .clone()
    .map_err(|why| Error::Unavailable { what: "CUDA", why })
}

/// The number of CUDA devices, or [`Error::Unavailable`] saying why there is no CUDA at all (no
/// driver library, a driver too old, or none of its GPUs visible).
pub fn device_count() -> Result<usize> {
    init_driver()?;
    cu::device::get_count()
        .map(|n| n.max(0) as usize)
        .map_err(|e| cu_err("cuDeviceGetCount", e))
}

/// A kernel function and the dynamic shared memory it has been allowed so far.
#[derive(Debug)]
struct Func {
    f: CudaFunction,
    smem_allowed: AtomicU32,
}

/// A GPU (see the module documentation).
pub struct CudaDriver {
    info: DeviceInfo,
    programs: Vec<Program>,
    kernels: Vec<(usize, String)>,
    /// What NVRTC compiles for this device, or why it cannot.
    target: std::result::Result<Target, String>,
    /// Per program: its loaded module. Dropped before the streams and the context.
    modules: Vec<OnceLock<Frozen<Arc<CudaModule>>>>,
    /// Per kernel: its function.
    functions: Vec<OnceLock<Frozen<Arc<Func>>>>,
    /// cuBLASLt, or why it cannot be used.
    blas: std::result::Result<Blas, String>,
    table: Mutex<AllocTable>,
    events: Mutex<HashSet<u64>>,
    streams: [Arc<CudaStream>; 4],
    ctx: Arc<CudaContext>,
}

// SAFETY: the raw handles inside (the cuBLASLt handle, events) are used only through this
// driver: the cuBLASLt handle and workspaces under `Blas::state`'s mutex, events (thread-safe
// in the driver API) through a table that rejects destroyed ones. Contexts, streams, modules and
// functions are cudarc's own Send + Sync types.
unsafe impl Send for CudaDriver {}
// SAFETY: as above.
unsafe impl Sync for CudaDriver {}

impl fmt::Debug for CudaDriver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaDriver")
            .field("info", &self.info)
            .field("kernels", &self.kernels.len())
            .field("target", &self.target)
            .finish_non_exhaustive()
    }
}

impl CudaDriver {
    /// Opens GPU `ordinal` with kernels from `programs`. Without a usable GPU:
    /// [`Error::Unavailable`] saying "no CUDA device" and why; never panics.
    pub fn open(ordinal: usize, programs: Vec<Program>) -> Result<Self> {
        let driver_version = init_driver()?;
        let count = device_count()?;
        if ordinal >= count {
            return Err(Error::Unavailable {
                what: "CUDA",
                why: if count == 0 {
                    "no CUDA device: the driver reports no GPU".into()
                } else {
                    format!("no CUDA device {ordinal}: the driver reports {count} (0..{count})")
                },
            });
        }
        let kernels = kernel_table(&programs)?;
        let ctx = CudaContext::new(ordinal).map_err(|e| cu_err("cuDevicePrimaryCtxRetain", e))?;
        let stream = || ctx.new_stream().map_err(|e| cu_err("cuStreamCreate", e));
        let streams = [stream()?, stream()?, stream()?, stream()?];
        let attr = |a: cusys::CUdevice_attribute, what: &str| {
            ctx.attribute(a)
                .map(|v| v.max(0) as u32)
                .map_err(|e| cu_err(&format!("cuDeviceGetAttribute({what})"), e))
        };
        use cusys::CUdevice_attribute as A;
        let cc = (
            attr(
                A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                "compute capability",
            )?,
            attr(
                A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                "compute capability",
            )?,
        );
        let blas = Blas::new(&ctx);
        let info = DeviceInfo {
            name: ctx.name().map_err(|e| cu_err("cuDeviceGetName", e))?,
            ordinal,
            compute_capability: cc,
            total_memory: ctx.total_mem().map_err(|e| cu_err("cuDeviceTotalMem", e))? as u64,
            multiprocessors: attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, "SM count")?,
            max_dyn_smem_per_block: attr(
                A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                "shared memory per block",
            )?,
            driver_version: Some(driver_version),
            nvrtc_version: nvrtc::version().ok(),
            cublaslt_version: blas.as_ref().ok().map(|b| b.version),
            emulated: false,
            sizes_only: false,
        };
        let target = nvrtc::target_for(cc).map_err(|e| e.to_string());
        Ok(CudaDriver {
            modules: programs.iter().map(|_| OnceLock::new()).collect(),
            functions: kernels.iter().map(|_| OnceLock::new()).collect(),
            info,
            programs,
            kernels,
            target,
            blas,
            table: Mutex::new(AllocTable::default()),
            events: Mutex::new(HashSet::new()),
            streams,
            ctx,
        })
    }

    /// The cudarc context (for code that needs cudarc's own types, e.g. NCCL later).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The cudarc stream behind `s`.
    pub fn stream(&self, s: StreamKind) -> &Arc<CudaStream> {
        &self.streams[s.index()]
    }

    fn cu_stream(&self, s: StreamKind) -> cusys::CUstream {
        self.streams[s.index()].cu_stream()
    }

    /// Makes this device's context current on the calling thread (every call starts so, since
    /// the engine calls from many threads).
    fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| cu_err("cuCtxSetCurrent", e))
    }

    fn table(&self) -> MutexGuard<'_, AllocTable> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues `copy`, an upload or a download (`op`) of `len` bytes at device address `p`
    /// (`what` it is to the call), once the range is checked.
    fn host_copy(
        &self,
        (op, what): (&str, &str),
        p: DevPtr,
        len: usize,
        copy: impl FnOnce() -> cusys::CUresult,
    ) -> Result<()> {
        self.table().check(op, what, p, len as u64)?;
        if len == 0 {
            return Ok(());
        }
        self.bind()?;
        copy().result().map_err(|e| cu_err(op, e))
    }

    fn check_event(&self, op: &str, e: Event) -> Result<cusys::CUevent> {
        if self
            .events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(&e.0)
        {
            Ok(e.0 as usize as cusys::CUevent)
        } else {
            Err(Error::Device {
                op: op.into(),
                detail: format!("CUDA_ERROR_INVALID_HANDLE: event {:#x} is not live", e.0),
            })
        }
    }

    /// The module of program `p`, compiled (or read from the kernel cache) and loaded on first
    /// use.
    fn module(&self, p: usize) -> Result<Arc<CudaModule>> {
        thaw(self.modules[p].get_or_init(|| self.load_module(p).map_err(freeze)))
    }

    fn load_module(&self, p: usize) -> Result<Arc<CudaModule>> {
        let program = &self.programs[p];
        let target = self
            .target
            .clone()
            .map_err(|why| Error::Unavailable { what: "NVRTC", why })?;
        // What NVRTC produces must be loadable by this driver: a CUBIN needs a driver of the
        // same major version or newer, PTX one at least as new as NVRTC itself.
        if let (Some(nv), Some(drv)) = (self.info.nvrtc_version, self.info.driver_version) {
            let too_old = match target.kind {
                ImageKind::Cubin => drv.0 < nv.0,
                ImageKind::Ptx => drv < nv,
            };
            if too_old {
                return Err(Error::Unavailable {
                    what: "CUDA",
                    why: format!(
                        "the NVIDIA driver is too old: it supports CUDA {}.{}, and NVRTC {}.{} \
                         produces {:?} it cannot load; update the driver or use an older NVRTC",
                        drv.0, drv.1, nv.0, nv.1, target.kind
                    ),
                });
            }
        }
        let compiled = nvrtc::compile_once(program, target)?;
        match self.load_image(program, &compiled.image, target) {
            Err(e) if compiled.from_cache => {
                // A valid-looking entry the driver refuses: compile afresh rather than fail.
                tracing::warn!(
                    "cached kernel image {:?} failed to load ({e}); recompiling",
                    compiled.path
                );
                let image = nvrtc::compile_uncached(program, target)?;
                self.load_image(program, &image, target)
            }
            other => other,
        }
    }

    fn load_image(
        &self,
        program: &Program,
        image: &[u8],
        target: Target,
    ) -> Result<Arc<CudaModule>> {
        self.bind()?;
        let ptx = match target.kind {
            ImageKind::Cubin => Ptx::from_binary(image.to_vec()),
            ImageKind::Ptx => Ptx::from_src(String::from_utf8_lossy(image).into_owned()),
        };
        self.ctx.load_module(ptx).map_err(|e| Error::Device {
            op: "cuModuleLoadData".into(),
            detail: format!(
                "{} ({} for {}): {}",
                driver_words(e),
                program.file,
                target.arch_option(),
                match target.kind {
                    ImageKind::Cubin => "CUBIN",
                    ImageKind::Ptx => "PTX, JIT-compiled by the driver",
                }
            ),
        })
    }

    fn function(&self, k: usize) -> Result<Arc<Func>> {
        thaw(self.functions[k].get_or_init(|| {
            let (p, name) = &self.kernels[k];
            let module = self.module(*p).map_err(freeze)?;
            self.bind().map_err(freeze)?;
            module
                .load_function(name)
                .map(|f| {
                    Arc::new(Func {
                        f,
                        smem_allowed: AtomicU32::new(DEFAULT_DYN_SMEM),
                    })
                })
                .map_err(|e| {
                    (
                        "cuModuleGetFunction".to_string(),
                        format!("{} ({name} in {})", driver_words(e), self.programs[*p].file),
                    )
                })
        }))
    }

    fn blas(&self, g: &Gemm) -> Result<&Blas> {
        self.blas.as_ref().map_err(|why| Error::Device {
            op: "cublasLtCreate".into(),
            detail: format!("{why}; cannot run {}", g.describe()),
        })
    }
}

impl Drop for CudaDriver {
    fn drop(&mut self) {
        if self.bind().is_err() {
            return;
        }
        for s in &self.streams {
            if let Err(e) = s.synchronize() {
                tracing::error!(
                    "CUDA driver: synchronizing a stream at close: {}",
                    driver_words(e)
                );
            }
        }
        if let Ok(blas) = &self.blas {
            blas.free_workspaces();
        }
        for &e in self.events.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            // SAFETY: live events of this driver, destroyed once.
            let _ = unsafe { cu::event::destroy(e as usize as cusys::CUevent) };
        }
        let table = self.table.get_mut().unwrap_or_else(|e| e.into_inner());
        let leaked: Vec<(u64, u64)> = table.live().collect();
        if !leaked.is_empty() {
            tracing::warn!(
                "CUDA driver closed with {} allocations ({} bytes) still live; freeing them",
                leaked.len(),
                table.allocated()
            );
        }
        for (p, _) in leaked {
            // SAFETY: allocated by `malloc`, streams are idle, nothing can use it any more.
            let _ = unsafe { cu::free_sync(p) };
        }
    }
}

impl Driver for CudaDriver {
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
        self.bind()?;
        let mut table = self.table();
        // SAFETY: the context is current; the memory is returned uninitialised, as documented.
        match unsafe { cu::malloc_sync(bytes) } {
            Ok(p) => {
                table.insert(p, bytes as u64);
                Ok(DevPtr(p))
            }
            Err(e) if e.0 == cusys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                Err(Error::DeviceMemory {
                    requested: bytes as u64,
                    live: table.allocated(),
                    peak: table.peak(),
                    limit: self.info.total_memory,
                    detail: format!("cuMemAlloc: {}", driver_words(e)),
                })
            }
            Err(e) => Err(cu_err("cuMemAlloc", e)),
        }
    }

    unsafe fn free(&self, p: DevPtr) -> Result<()> {
        self.bind()?;
        // cuMemFree does not wait for work queued on non-blocking streams in every case the
        // documentation leaves open: wait for all three, so queued work never sees freed memory.
        for s in StreamKind::ALL {
            self.synchronize(s)?;
        }
        let mut table = self.table();
        // SAFETY: `p` starts a live allocation of this driver (checked by `remove` before the
        // driver sees it); the caller guarantees nothing uses it any more.
        let len = table.remove(p)?;
        if let Err(e) = unsafe { cu::free_sync(p.0) } {
            table.insert(p.0, len);
            return Err(cu_err("cuMemFree", e));
        }
        Ok(())
    }

    fn memset_zero(&self, p: DevPtr, bytes: usize, s: StreamKind) -> Result<()> {
        self.table()
            .check("cuMemsetD8Async", "destination", p, bytes as u64)?;
        if bytes == 0 {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the range lies inside a live allocation.
        unsafe { cu::memset_d8_async(p.0, 0, bytes, self.cu_stream(s)) }
            .map_err(|e| cu_err("cuMemsetD8Async", e))
    }

    fn copy_dtod(&self, src: DevPtr, dst: DevPtr, bytes: usize, s: StreamKind) -> Result<()> {
        self.table().check_copy(src, dst, bytes as u64)?;
        if bytes == 0 {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: both ranges lie inside live allocations and do not overlap.
        unsafe { cu::memcpy_dtod_async(dst.0, src.0, bytes, self.cu_stream(s)) }
            .map_err(|e| cu_err("cuMemcpyDtoDAsync", e))
    }

    fn check_live(&self, op: &str, what: &str, p: DevPtr, bytes: u64) -> Result<()> {
        self.table().check(op, what, p, bytes)
    }

    unsafe fn copy_unified(
        &self,
        src: DevPtr,
        dst: DevPtr,
        bytes: usize,
        s: StreamKind,
        _owners: [u64; 2],
    ) -> Result<()> {
        self.bind()?;
        // Ranks of one process open the primary context of their GPU, so with unified
        // addressing cuMemcpyAsync reaches another rank's memory on this GPU or a peer one.
        // SAFETY: the caller checked both ranges against their owners and keeps them alive.
        unsafe { cusys::cuMemcpyAsync(dst.0, src.0, bytes, self.cu_stream(s)) }
            .result()
            .map_err(|e| cu_err("cuMemcpyAsync", e))
    }

    unsafe fn copy_htod_async(&self, src: *const [u8], dst: DevPtr, s: StreamKind) -> Result<()> {
        let cs = self.cu_stream(s);
        self.host_copy(("cuMemcpyHtoDAsync", "destination"), dst, src.len(), || {
            // SAFETY: the destination is checked; the caller keeps the source valid until the
            // stream passes the copy.
            unsafe { cusys::cuMemcpyHtoDAsync_v2(dst.0, src.cast(), src.len(), cs) }
        })
    }

    unsafe fn copy_dtoh_async(&self, src: DevPtr, dst: *mut [u8], s: StreamKind) -> Result<()> {
        let cs = self.cu_stream(s);
        self.host_copy(("cuMemcpyDtoHAsync", "source"), src, dst.len(), || {
            // SAFETY: the source is checked; the caller keeps the destination valid and
            // untouched until the stream passes the copy.
            unsafe { cusys::cuMemcpyDtoHAsync_v2(dst.cast(), src.0, dst.len(), cs) }
        })
    }

    unsafe fn host_register(&self, ptr: *mut u8, len: usize) -> Result<()> {
        self.bind()?;
        // SAFETY: the caller keeps the range allocated until it is unregistered.
        unsafe {
            cusys::cuMemHostRegister_v2(ptr as *mut c_void, len, cusys::CU_MEMHOSTREGISTER_PORTABLE)
        }
        .result()
        .map_err(|e| cu_err("cuMemHostRegister", e))
    }

    unsafe fn host_unregister(&self, ptr: *mut u8) -> Result<()> {
        self.bind()?;
        // SAFETY: the caller guarantees no queued copy uses the range.
        unsafe { cusys::cuMemHostUnregister(ptr as *mut c_void) }
            .result()
            .map_err(|e| cu_err("cuMemHostUnregister", e))
    }

    fn kernel(&self, name: &str) -> Result<Kernel> {
        let Some(k) = self.kernels.iter().position(|(_, n)| n == name) else {
            return Err(unknown_kernel(name, &self.programs));
        };
        self.function(k)?;
        Ok(Kernel(k as u32))
    }

    unsafe fn launch(
        &self,
        k: Kernel,
        cfg: &LaunchConfig,
        params: &mut [*mut c_void],
        s: StreamKind,
    ) -> Result<()> {
        let (_, name) = k.entry(&self.kernels)?;
        cfg.validate(name, self.info.max_dyn_smem_per_block)?;
        let func = self.function(k.index())?;
        self.bind()?;
        if cfg.dyn_smem > func.smem_allowed.load(Ordering::Relaxed) {
            // Above 48 KiB a kernel must opt in, once, to the amount it will use.
            func.f
                .set_attribute(
                    cusys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    cfg.dyn_smem as i32,
                )
                .map_err(|e| Error::Device {
                    op: "cuFuncSetAttribute".into(),
                    detail: format!(
                        "{} ({name}: {} bytes of dynamic shared memory)",
                        driver_words(e),
                        cfg.dyn_smem
                    ),
                })?;
            func.smem_allowed.fetch_max(cfg.dyn_smem, Ordering::Relaxed);
        }
        let g = cfg.grid;
        let b = cfg.block;
        // SAFETY: the function is loaded in this context; the caller guarantees the parameters.
        unsafe {
            cu::launch_kernel(
                func.f.cu_function(),
                (g[0], g[1], g[2]),
                (b[0], b[1], b[2]),
                cfg.dyn_smem,
                self.cu_stream(s),
                params,
            )
        }
        .map_err(|e| Error::Device {
            op: "cuLaunchKernel".into(),
            detail: format!(
                "{} ({name}, grid {:?}, block {:?}, {} bytes dynamic shared memory)",
                driver_words(e),
                g,
                b,
                cfg.dyn_smem
            ),
        })
    }

    fn gemm(&self, g: &Gemm, s: StreamKind) -> Result<()> {
        g.validate()?;
        {
            let table = self.table();
            for r in g.ranges()? {
                table.check("cublasLtMatmul", r.what, DevPtr(r.start), r.bytes)?;
            }
        }
        let blas = self.blas(g)?;
        self.bind()?;
        blas.run(g, s, self.cu_stream(s) as ltsys::cudaStream_t)
    }

    fn synchronize(&self, s: StreamKind) -> Result<()> {
        self.bind()?;
        self.streams[s.index()]
            .synchronize()
            .map_err(|e| cu_err("cuStreamSynchronize", e))
    }

    fn event_create(&self) -> Result<Event> {
        self.bind()?;
        let e = cu::event::create(cusys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(|e| cu_err("cuEventCreate", e))?;
        let id = e as usize as u64;
        self.events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id);
        Ok(Event(id))
    }

    fn event_record(&self, e: Event, s: StreamKind) -> Result<()> {
        let ev = self.check_event("cuEventRecord", e)?;
        self.bind()?;
        // SAFETY: a live event of this context and a live stream.
        unsafe { cu::event::record(ev, self.cu_stream(s)) }.map_err(|e| cu_err("cuEventRecord", e))
    }

    fn stream_wait_event(&self, s: StreamKind, e: Event) -> Result<()> {
        let ev = self.check_event("cuStreamWaitEvent", e)?;
        self.bind()?;
        // SAFETY: as above.
        unsafe {
            cu::stream::wait_event(
                self.cu_stream(s),
                ev,
                cusys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(|e| cu_err("cuStreamWaitEvent", e))
    }

    fn check_event_live(&self, op: &str, e: Event) -> Result<()> {
        self.check_event(op, e).map(|_| ())
    }

    unsafe fn stream_wait_unified(&self, s: StreamKind, _owner: u64, e: Event) -> Result<()> {
        self.bind()?;
        // SAFETY: the caller checked `e` live with its owner; an event handle of another
        // context is valid here (cuStreamWaitEvent accepts events of any context or device).
        unsafe {
            cu::stream::wait_event(
                self.cu_stream(s),
                e.0 as usize as cusys::CUevent,
                cusys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(|e| cu_err("cuStreamWaitEvent", e))
    }

    fn peer_id(&self) -> u64 {
        self as *const Self as u64
    }

    fn native_stream(&self, s: StreamKind) -> Option<u64> {
        Some(self.cu_stream(s) as u64)
    }

    fn event_query(&self, e: Event) -> Result<bool> {
        let ev = self.check_event("cuEventQuery", e)?;
        self.bind()?;
        // SAFETY: a live event.
        match unsafe { cu::event::query(ev) } {
            Ok(()) => Ok(true),
            Err(err) if err.0 == cusys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            Err(err) => Err(cu_err("cuEventQuery", err)),
        }
    }

    fn event_synchronize(&self, e: Event) -> Result<()> {
        let ev = self.check_event("cuEventSynchronize", e)?;
        self.bind()?;
        // SAFETY: a live event.
        unsafe { cu::event::synchronize(ev) }.map_err(|e| cu_err("cuEventSynchronize", e))
    }

    fn event_destroy(&self, e: Event) -> Result<()> {
        let mut events = self.events.lock().unwrap_or_else(|e| e.into_inner());
        if !events.remove(&e.0) {
            return Err(Error::Device {
                op: "cuEventDestroy".into(),
                detail: format!("CUDA_ERROR_INVALID_HANDLE: event {:#x} is not live", e.0),
            });
        }
        self.bind()?;
        // SAFETY: a live event of this driver, removed from the table, so destroyed once.
        unsafe { cu::event::destroy(e.0 as usize as cusys::CUevent) }
            .map_err(|e| cu_err("cuEventDestroy", e))
    }

    fn allocated(&self) -> u64 {
        self.table().allocated()
    }
}
