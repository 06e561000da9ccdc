//! The layer between the CUDA backend and the hardware: a [`Driver`] trait with three
//! implementations, and what sits directly on it.
//!
//! - [`CudaDriver`] (`real.rs`): a GPU through cudarc 0.19 (driver API, NVRTC, cuBLASLt), all
//!   loaded at run time, so this compiles and runs on machines without CUDA: opening it then
//!   fails with an error that says "no CUDA device" and why.
//! - [`EmuDriver`] (`emu.rs`): device memory is host memory, streams are synchronous, kernels
//!   run in the CPU emulator library (`backend::cuda::emu`), GEMMs in a reference loop that reads
//!   operands exactly as cuBLASLt does (column-major, leading dimensions, transposes,
//!   epilogues), so the backend's tests in CI catch what would fail on a GPU.
//! - [`MetaDriver`] (`meta.rs`): the size-only device: addresses with no memory behind them,
//!   every call checked as the emulator checks it and then nothing done, so the caching
//!   allocator over it holds exactly what it would hold on the GPU described, and a run
//!   prices that GPU without one (or any memory for its contents).
//!
//! Every driver checks every copy, memset, free and GEMM operand range against its table of
//! live allocations (`table.rs`) before anything runs, and rejects bad launch configurations
//! and GEMM descriptions with the same validation code, so an error reads the same on all;
//! the emulator and the size-only driver share all of it (`checks.rs`), and are one type,
//! [`Checked`] (`checked.rs`), differing only in their [`Work`]. Only what a kernel does with
//! its pointers is beyond checking.
//! - [`Allocator`] (`alloc.rs`): the stream-ordered caching allocator every device buffer comes
//!   from, with live/peak counters and the device-memory limit.
//! - [`nvrtc`]: compilation of kernel sources to CUBIN (or PTX) with a disk cache.
//! - [`Observed`] (`observed.rs`): the layer the backend calls through, counting host syncs,
//!   launches and copies (both drivers alike) and recording the issue order on request.
//! - [`Gemm`] (`gemm/`): one cuBLASLt matmul in cuBLASLt's own terms, validated by one function
//!   both drivers call, so both reject the same requests with the same words; `gemm/plan.rs`
//!   the key and bounded cache of the real driver's cuBLASLt descriptors.
//! - `order.rs`: the emulator's check that streams of the process's devices touching the same
//!   memory are ordered by events or host waits (emulated streams run at issue, so a missing
//!   wait would otherwise go unseen).
//!
//! Everything here speaks in raw device addresses ([`DevPtr`]); ownership and typing are the
//! backend's business (through [`DeviceBuffer`]).

mod alloc;
mod checked;
mod checks;
mod cublaslt;
mod emu;
mod gemm;
mod meta;
pub mod nvrtc;
mod observed;
mod order;
mod real;
mod registry;
mod table;

use std::ffi::c_void;
use std::fmt;
use std::sync::Arc;

pub use alloc::{
    Allocator, AllocatorStats, DeviceBuffer, LARGE_SEGMENT_ROUND, MIN_BLOCK, SMALL_MAX,
    SMALL_SEGMENT,
};
pub use checked::{Checked, Work};
pub use emu::{EmuDriver, EmuOptions, Emulated, EMU_DEFAULT_TOTAL_MEMORY};
pub use gemm::{Batch, Epilogue, Gemm, Op};
pub use meta::{MetaDriver, SizeOnly, H100_MEMORY};
pub use observed::{Observed, TraceOp, Traced};
pub use real::{device_count, CudaDriver};
pub use registry::{build_builtin_emulator, builtin_programs};

use crate::{Error, Result};

/// A device address; in the emulator, a host address; on the size-only device, an address
/// with nothing behind it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DevPtr(pub u64);

impl DevPtr {
    /// The null device pointer (never returned by [`Driver::malloc`]).
    pub const NULL: DevPtr = DevPtr(0);

    /// This address plus `bytes` (for views into a buffer).
    pub fn offset(self, bytes: u64) -> DevPtr {
        DevPtr(self.0 + bytes)
    }

    /// Whether this is the null pointer.
    pub fn is_null(self) -> bool {
        self.0 == 0
    }
}

impl fmt::Display for DevPtr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

/// The streams the engine uses: compute and one per copy direction, so uploads, downloads and
/// kernels can overlap.
///
/// Work on one stream runs in issue order; work on different streams may overlap unless ordered
/// with events ([`Driver::event_record`] and [`Driver::stream_wait_event`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StreamKind {
    /// Kernels and GEMMs.
    Compute,
    /// Host-to-device copies (parameter uploads, batches).
    HostToDevice,
    /// Device-to-host copies (offloaded gradients, losses).
    DeviceToHost,
    /// The local communicator's copies and reductions between the ranks' devices, ordered by
    /// events after the ranks' compute streams and before them again.
    Collective,
}

impl StreamKind {
    /// Every stream, in index order.
    pub const ALL: [StreamKind; 4] = [
        StreamKind::Compute,
        StreamKind::HostToDevice,
        StreamKind::DeviceToHost,
        StreamKind::Collective,
    ];

    /// A dense index (0..4) for per-stream tables.
    pub fn index(self) -> usize {
        match self {
            StreamKind::Compute => 0,
            StreamKind::HostToDevice => 1,
            StreamKind::DeviceToHost => 2,
            StreamKind::Collective => 3,
        }
    }
}

/// Grid, block and dynamic shared memory of a launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchConfig {
    /// Blocks in x, y, z.
    pub grid: [u32; 3],
    /// Threads per block in x, y, z.
    pub block: [u32; 3],
    /// Bytes of dynamic shared memory per block (`extern __shared__`).
    pub dyn_smem: u32,
}

impl LaunchConfig {
    /// A one-dimensional launch: `grid` blocks of `block` threads, no dynamic shared memory.
    pub fn linear(grid: u32, block: u32) -> Self {
        LaunchConfig {
            grid: [grid, 1, 1],
            block: [block, 1, 1],
            dyn_smem: 0,
        }
    }

    /// Enough blocks of `block` threads to give every one of `n` elements its own thread,
    /// capped at `max_grid` blocks (grid-stride kernels cover the rest).
    pub fn for_elements(n: u64, block: u32, max_grid: u32) -> Self {
        let blocks = n
            .div_ceil(u64::from(block.max(1)))
            .clamp(1, u64::from(max_grid.max(1)));
        LaunchConfig::linear(blocks as u32, block)
    }

    /// Checks the limits every CUDA device since compute capability 3.0 enforces (and the
    /// device's shared-memory limit), the same way for both drivers: a zero dimension, more than
    /// 1024 threads per block, block z over 64, grid y or z over 65535, or dynamic shared memory
    /// over `max_dyn_smem` is `CUDA_ERROR_INVALID_VALUE` on a GPU.
    pub fn validate(&self, kernel: &str, max_dyn_smem: u32) -> Result<()> {
        let bad = |why: String| {
            Err(Error::Device {
                op: "cuLaunchKernel".into(),
                detail: format!(
                    "CUDA_ERROR_INVALID_VALUE: kernel {kernel} with grid {:?}, block {:?}, \
                     {} bytes of dynamic shared memory: {why}",
                    self.grid, self.block, self.dyn_smem
                ),
            })
        };
        if self.grid.contains(&0) || self.block.contains(&0) {
            return bad("every grid and block dimension must be at least 1".into());
        }
        let threads =
            u64::from(self.block[0]) * u64::from(self.block[1]) * u64::from(self.block[2]);
        if threads > 1024 {
            return bad(format!("{threads} threads per block, the limit is 1024"));
        }
        if self.block[0] > 1024 || self.block[1] > 1024 || self.block[2] > 64 {
            return bad("block dimensions are limited to 1024 x 1024 x 64".into());
        }
        if self.grid[0] > i32::MAX as u32 || self.grid[1] > 65535 || self.grid[2] > 65535 {
            return bad("grid dimensions are limited to (2^31 - 1) x 65535 x 65535".into());
        }
        if self.dyn_smem > max_dyn_smem {
            return bad(format!(
                "the device allows at most {max_dyn_smem} bytes of dynamic shared memory per block"
            ));
        }
        Ok(())
    }
}

/// A loaded kernel function (by registry name): an index into its driver's kernel table, valid
/// only with the driver that returned it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Kernel(pub(crate) u32);

impl Kernel {
    /// The index in the driver's kernel table.
    pub fn index(self) -> usize {
        self.0 as usize
    }

    /// This handle's entry in a driver's kernel table, or the refusal of a handle from
    /// another device, in the same words from every driver.
    pub(crate) fn entry<T>(self, table: &[T]) -> Result<&T> {
        table.get(self.index()).ok_or_else(|| Error::Device {
            op: "cuLaunchKernel".into(),
            detail: format!(
                "CUDA_ERROR_INVALID_HANDLE: kernel handle {} is not from this device ({} kernels)",
                self.0,
                table.len()
            ),
        })
    }
}

/// A device event: a point in a stream's work that another stream can wait for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Event(pub(crate) u64);

/// What the device and its libraries are (for `ferrozero report` and logs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// The device's name, e.g. `NVIDIA H100 80GB HBM3`.
    pub name: String,
    /// The CUDA ordinal (0 for the emulator).
    pub ordinal: usize,
    /// Compute capability (major, minor), e.g. (9, 0).
    pub compute_capability: (u32, u32),
    /// Device memory in bytes.
    pub total_memory: u64,
    /// Streaming multiprocessors.
    pub multiprocessors: u32,
    /// The most dynamic shared memory a block may use (after opting in above 48 KiB).
    pub max_dyn_smem_per_block: u32,
    /// The CUDA version the driver supports (major, minor), e.g. (13, 0); `None` when emulated.
    pub driver_version: Option<(u32, u32)>,
    /// NVRTC's version, when the library could be loaded.
    pub nvrtc_version: Option<(u32, u32)>,
    /// cuBLASLt's version (major, minor, patch), when the library could be loaded.
    pub cublaslt_version: Option<(u32, u32, u32)>,
    /// Whether this is the CPU emulator rather than a GPU.
    pub emulated: bool,
    /// Whether this is the size-only device (`meta.rs`): a GPU described, its memory counted
    /// and every call checked, nothing computed.
    pub sizes_only: bool,
}

impl fmt::Display for DeviceInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let v2 = |v: Option<(u32, u32)>| match v {
            Some((a, b)) => format!("{a}.{b}"),
            None => "not found".into(),
        };
        // Neither the emulator nor the size-only device loads a library: say what stands in.
        let stand_in = match (self.sizes_only, self.emulated) {
            (true, _) => Some(("size-only", "none (size-only)")),
            (false, true) => Some(("emulated", "reference loop (emulated)")),
            (false, false) => None,
        };
        write!(
            f,
            "{} (device {}{}): compute capability {}.{}, {:.1} GiB, {} SMs, {} KiB shared memory \
             per block; driver CUDA {}, NVRTC {}, cuBLASLt {}",
            self.name,
            self.ordinal,
            stand_in.map_or(String::new(), |(kind, _)| format!(", {kind}")),
            self.compute_capability.0,
            self.compute_capability.1,
            self.total_memory as f64 / (1u64 << 30) as f64,
            self.multiprocessors,
            self.max_dyn_smem_per_block / 1024,
            match stand_in {
                Some((kind, _)) => format!("none ({kind})"),
                None => v2(self.driver_version),
            },
            v2(self.nvrtc_version),
            match (self.cublaslt_version, stand_in) {
                (Some((a, b, c)), _) => format!("{a}.{b}.{c}"),
                (None, Some((_, lib))) => lib.into(),
                (None, None) => "not found".into(),
            },
        )
    }
}

/// One CUDA C program the driver can compile and launch from: the driver's view of an entry in
/// the kernels registry (`kernels::KernelSource`), or a test's own source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Program {
    /// File name, e.g. `norm.cu`: NVRTC's program name (so it appears in compile errors) and the
    /// stem of its cache files.
    pub file: String,
    /// The complete text handed to NVRTC (for the registry: `kernels::program_text(src)`).
    pub text: String,
    /// Every `extern "C" __global__` function it defines.
    pub kernels: Vec<String>,
}

impl Program {
    /// A program from its file name, complete text and kernel names.
    pub fn new(file: &str, text: impl Into<String>, kernels: &[&str]) -> Self {
        Program {
            file: file.to_string(),
            text: text.into(),
            kernels: kernels.iter().map(|k| k.to_string()).collect(),
        }
    }
}

/// A failure remembered by a `OnceLock` (so a broken source is not recompiled on every call):
/// the call and the detail of the [`Error::Device`] it becomes again.
pub(crate) type Frozen<T> = std::result::Result<T, (String, String)>;

/// Makes an error storable in a [`Frozen`].
pub(crate) fn freeze(e: Error) -> (String, String) {
    match e {
        Error::Device { op, detail } => (op, detail),
        other => ("kernel load".into(), other.to_string()),
    }
}

/// The stored result again, errors as [`Error::Device`].
pub(crate) fn thaw<T: Clone>(r: &Frozen<T>) -> Result<T> {
    r.clone()
        .map_err(|(op, detail)| Error::Device { op, detail })
}

/// The flat kernel table both drivers build from their programs: (program index, name) per
/// kernel, in program order. Names must be unique across programs.
pub(crate) fn kernel_table(programs: &[Program]) -> Result<Vec<(usize, String)>> {
    let mut table: Vec<(usize, String)> = Vec::new();
    for (p, prog) in programs.iter().enumerate() {
        for k in &prog.kernels {
            if k.is_empty() || k.contains('\0') {
                return Err(Error::Invalid(format!(
                    "{}: kernel name {k:?} is empty or contains NUL",
                    prog.file
                )));
            }
            if let Some((q, _)) = table.iter().find(|(_, name)| name == k) {
                return Err(Error::Invalid(format!(
                    "kernel {k} is defined by both {} and {}",
                    programs[*q].file, prog.file
                )));
            }
            table.push((p, k.clone()));
        }
    }
    Ok(table)
}

/// The answer to an unknown kernel name, the same from both drivers.
pub(crate) fn unknown_kernel(name: &str, programs: &[Program]) -> Error {
    let known: Vec<&str> = programs
        .iter()
        .flat_map(|p| p.kernels.iter().map(String::as_str))
        .collect();
    Error::Device {
        op: "cuModuleGetFunction".into(),
        detail: format!(
            "CUDA_ERROR_NOT_FOUND: no kernel named {name} in the registry ({} kernels in {} \
             sources{})",
            known.len(),
            programs.len(),
            if known.is_empty() {
                String::new()
            } else {
                format!(": {}", known.join(", "))
            }
        ),
    }
}

/// The device operations the CUDA backend is written against. Both implementations behave the
/// same for every valid call and reject the same invalid ones (pointers and ranges outside live
/// allocations included, which a GPU alone would only fault on later).
///
/// Ordering: every operation is issued on a [`StreamKind`] and runs after earlier work on that
/// stream. `copy_htod` and `copy_dtoh` return only when the host memory may be reused or read;
/// everything else may still be running on return (the emulator finishes it before returning).
pub trait Driver: Send + Sync + fmt::Debug {
    /// What the device and its libraries are.
    fn info(&self) -> &DeviceInfo;

    /// Allocates `bytes` (more than 0) of device memory, 256-byte aligned, uninitialised (the
    /// emulator fills it with 0xFF bytes, a NaN in every float type, so a read before the first
    /// write shows). Raw: the [`Allocator`] sits on top. A refusal for lack of memory is
    /// [`Error::DeviceMemory`], anything else [`Error::Device`].
    fn malloc(&self, bytes: usize) -> Result<DevPtr>;

    /// Returns memory from [`Driver::malloc`]; waits for the device to finish using it.
    ///
    /// # Safety
    /// No buffer view of `p` may be used afterwards, and no queued work may still use it.
    unsafe fn free(&self, p: DevPtr) -> Result<()>;

    /// Sets `bytes` bytes at `p` to zero, in order on stream `s`.
    fn memset_zero(&self, p: DevPtr, bytes: usize, s: StreamKind) -> Result<()>;

    /// Copies `src` to `dst` on stream `s`; `src` may be reused when this returns (by
    /// default the copy is queued, then the stream synchronized).
    fn copy_htod(&self, src: &[u8], dst: DevPtr, s: StreamKind) -> Result<()> {
        // SAFETY: `src` stays borrowed until the stream has finished the copy (synchronized
        // below).
        unsafe { self.copy_htod_async(src, dst, s) }?;
        self.synchronize(s)
    }

    /// Copies `dst.len()` bytes from `src` into `dst` on stream `s`; the data is present when
    /// this returns (by default the copy is queued, then the stream synchronized).
    fn copy_dtoh(&self, src: DevPtr, dst: &mut [u8], s: StreamKind) -> Result<()> {
        // SAFETY: `dst` stays borrowed, and untouched, until the stream has finished the copy
        // (synchronized below).
        unsafe { self.copy_dtoh_async(src, dst, s) }?;
        self.synchronize(s)
    }

    /// Copies `bytes` bytes from `src` to `dst` on stream `s` (the ranges must not overlap).
    fn copy_dtod(&self, src: DevPtr, dst: DevPtr, bytes: usize, s: StreamKind) -> Result<()>;

    /// Queues a copy of the host bytes `src` to `dst` on stream `s` and returns at once: the
    /// way to overlap uploads from page-locked memory with compute.
    ///
    /// # Safety
    /// `src` must stay valid and unchanged until the stream has passed this copy (synchronize
    /// it, or wait for an event recorded after it). For the copy to be truly asynchronous, the
    /// memory should be page-locked.
    unsafe fn copy_htod_async(&self, src: *const [u8], dst: DevPtr, s: StreamKind) -> Result<()>;

    /// Queues a copy of `dst.len()` bytes from `src` into the host bytes `dst` on stream `s`
    /// and returns at once.
    ///
    /// # Safety
    /// `dst` must stay valid, and must not be read or written, until the stream has passed this
    /// copy.
    unsafe fn copy_dtoh_async(&self, src: DevPtr, dst: *mut [u8], s: StreamKind) -> Result<()>;

    /// The kernel called `name` in the registry; compiles (or reads from the disk cache) and
    /// loads its source on the first use of any of its kernels, once per process.
    fn kernel(&self, name: &str) -> Result<Kernel>;

    /// Launches `k` on stream `s`.
    ///
    /// # Safety
    /// `params` holds one pointer per kernel parameter, each to a value of exactly the
    /// parameter's type (cuLaunchKernel's `kernelParams`); device pointers among them must point
    /// to live device memory large enough for everything the kernel touches.
    unsafe fn launch(
        &self,
        k: Kernel,
        cfg: &LaunchConfig,
        params: &mut [*mut c_void],
        s: StreamKind,
    ) -> Result<()>;

    /// One cuBLASLt matmul on stream `s` (see [`Gemm`] for exactly what it computes).
    fn gemm(&self, g: &Gemm, s: StreamKind) -> Result<()>;

    /// Waits until all work queued on `s` has finished.
    fn synchronize(&self, s: StreamKind) -> Result<()>;

    /// A new event (not yet recorded: waiting for it returns at once).
    fn event_create(&self) -> Result<Event>;

    /// Marks the current end of stream `s`'s work in `e` (replacing any earlier record).
    fn event_record(&self, e: Event, s: StreamKind) -> Result<()>;

    /// Makes later work on `s` wait until `e`'s recorded work has finished (the host does not
    /// wait).
    fn stream_wait_event(&self, s: StreamKind, e: Event) -> Result<()>;

    /// Whether `e`'s recorded work has finished (true for an event never recorded).
    fn event_query(&self, e: Event) -> Result<bool>;

    /// Waits on the host until `e`'s recorded work has finished.
    fn event_synchronize(&self, e: Event) -> Result<()>;

    /// Destroys `e` (work it marks may still be running; streams already waiting keep waiting).
    fn event_destroy(&self, e: Event) -> Result<()>;

    /// Bytes currently allocated through [`Driver::malloc`] and not freed, by this driver.
    fn allocated(&self) -> u64;

    /// Page-locks `len` bytes of host memory at `ptr` for every context of the process
    /// (`cuMemHostRegister` with `CU_MEMHOSTREGISTER_PORTABLE`), so copies to and from it
    /// run at the bus's speed without a bounce through the driver's own buffers. A range
    /// that shares a page with one already registered is refused, as CUDA refuses it.
    ///
    /// # Safety
    /// The memory must stay allocated until [`Driver::host_unregister`] is called with `ptr`.
    unsafe fn host_register(&self, ptr: *mut u8, len: usize) -> Result<()>;

    /// Undoes [`Driver::host_register`] for the range starting at `ptr`.
    ///
    /// # Safety
    /// No queued copy may still use the range.
    unsafe fn host_unregister(&self, ptr: *mut u8) -> Result<()>;

    /// Checks that `p..p + bytes` lies inside one live allocation of this driver (the check
    /// every copy makes, for a copy that another driver of the process issues: [`copy_peer`]).
    fn check_live(&self, op: &str, what: &str, p: DevPtr, bytes: u64) -> Result<()>;

    /// Queues a copy of `bytes` bytes between any two device addresses of this process
    /// (unified addressing: either may belong to another driver, on this GPU or another) on
    /// this driver's stream `s`. `owners` are the [`Driver::peer_id`]s of the drivers owning
    /// source and destination (the emulator checks `s` is ordered after their compute streams).
    ///
    /// # Safety
    /// Both ranges must lie in live device allocations, must not overlap, and must stay
    /// allocated (and the source unchanged) until the stream has passed the copy; [`copy_peer`]
    /// checks the first two with the owning drivers.
    unsafe fn copy_unified(
        &self,
        src: DevPtr,
        dst: DevPtr,
        bytes: usize,
        s: StreamKind,
        owners: [u64; 2],
    ) -> Result<()>;

    /// Checks that `e` is a live event of this driver (for a wait another driver of the
    /// process issues: [`wait_peer_event`]).
    fn check_event_live(&self, op: &str, e: Event) -> Result<()>;

    /// Makes later work on `s` wait for event `e` of the driver whose [`Driver::peer_id`] is
    /// `owner` (this one or another of the process: CUDA lets a stream wait for an event of
    /// another context or device).
    ///
    /// # Safety
    /// `e` must be a live event of that driver ([`wait_peer_event`] checks it with the owner).
    unsafe fn stream_wait_unified(&self, s: StreamKind, owner: u64, e: Event) -> Result<()>;

    /// This driver's identity among the drivers of the process.
    fn peer_id(&self) -> u64;

    /// The native handle (`CUstream`) of stream `s`, for a library that queues its own work
    /// on the device's streams (NCCL, ordered with this driver's events); `None` where
    /// streams are emulated.
    fn native_stream(&self, _s: StreamKind) -> Option<u64> {
        None
    }

    /// Hears that `p..p + bytes` is now one buffer of the caching allocator: the emulator's
    /// order check takes a kernel's pointer argument as reaching the whole buffer it points
    /// into. Nothing to do on a GPU.
    fn note_buffer(&self, _p: DevPtr, _bytes: u64) {}
}

/// Makes later work on stream `s` of driver `on` wait for event `e` of driver `owner` (which
/// may be `on`): how a rank orders its work after a peer's, without the host waiting.
pub fn wait_peer_event(on: &dyn Driver, s: StreamKind, owner: &dyn Driver, e: Event) -> Result<()> {
    owner.check_event_live("cuStreamWaitEvent", e)?;
    // SAFETY: checked live with its owner, which keeps it until the waiting rank is done.
    unsafe { on.stream_wait_unified(s, owner.peer_id(), e) }
}

/// Copies `bytes` bytes from `src`, memory of driver `from`, to `dst`, memory of driver `to`,
/// on stream `s` of driver `on`: how ranks that share a process (each with its own driver)
/// exchange device buffers. Each range is checked by the driver that owns it.
pub fn copy_peer(
    on: &dyn Driver,
    (from, src): (&dyn Driver, DevPtr),
    (to, dst): (&dyn Driver, DevPtr),
    bytes: usize,
    s: StreamKind,
) -> Result<()> {
    const OP: &str = "cuMemcpyAsync";
    from.check_live(OP, "source", src, bytes as u64)?;
    to.check_live(OP, "destination", dst, bytes as u64)?;
    if bytes == 0 {
        return Ok(());
    }
    let b = bytes as u64;
    if src.0 < dst.0 + b && dst.0 < src.0 + b {
        return Err(Error::Device {
            op: OP.into(),
            detail: format!(
                "CUDA_ERROR_INVALID_VALUE: source [{src}, +{bytes}) and destination \
                 [{dst}, +{bytes}) overlap (undefined on a GPU)"
            ),
        });
    }
    // SAFETY: both ranges were checked against their owners' live allocations and are
    // disjoint; the caller keeps both alive until it synchronizes `on`'s stream.
    unsafe { on.copy_unified(src, dst, bytes, s, [from.peer_id(), to.peer_id()]) }
}

/// Opens GPU `ordinal` (primary context, four streams, cuBLASLt) with the builtin kernel
/// registry. Without a usable GPU: [`Error::Unavailable`] saying "no CUDA device" and why.
pub fn open(ordinal: usize) -> Result<Arc<dyn Driver>> {
    Ok(Arc::new(CudaDriver::open(ordinal, builtin_programs())?))
}

/// The CPU emulator with the builtin kernel registry and emulator library (built once per
/// process under `$FERROZERO_EMU_DIR`, else under the target directory), 16 GiB of memory.
pub fn emulated() -> Result<Arc<dyn Driver>> {
    Ok(Arc::new(EmuDriver::builtin()?))
}
