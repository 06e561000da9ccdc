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
use std::ffi::{c_char, c_void, CStr};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use super::checked::{Checked, Work};
use super::checks::Checks;
use super::gemm::Gemm;
use super::{build_builtin_emulator, builtin_programs, DevPtr, DeviceInfo, LaunchConfig, Program};
use crate::{Error, Result};

/// The emulated device's memory unless [`EmuOptions::total_memory`] says otherwise.
pub const EMU_DEFAULT_TOTAL_MEMORY: u64 = 16 << 30;

/// The alignment of every emulated allocation (cudaMalloc guarantees at least 256 bytes).
const ALIGN: usize = 256;

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

/// The emulated driver (see the module documentation): the checked device whose work is
/// done in host memory and the emulator library.
pub type EmuDriver = Checked<Emulated>;

/// What the emulator does with a call its checks admitted.
#[derive(Debug)]
pub struct Emulated {
    lib: Option<Arc<EmuLib>>,
}

/// H100's shape as the emulator describes itself: what launch grids and shared memory are
/// checked against.
fn emu_info(total_memory: u64) -> DeviceInfo {
    DeviceInfo {
        name: "ferrozero CUDA emulator (CPU)".into(),
        emulated: true,
        sizes_only: false,
        ..DeviceInfo::h100_sizes_only(Some(total_memory))
    }
}

impl Checked<Emulated> {
    /// An emulated device as `options` describe it (loads the library, if any, once per
    /// process).
    pub fn new(options: EmuOptions) -> Result<Self> {
        let checks = Checks::new(emu_info(options.total_memory), options.programs)?;
        let lib = options.library.as_deref().map(load_library).transpose()?;
        Ok(Checked {
            checks,
            work: Emulated { lib },
        })
    }

    /// This driver, refusing every product with one of `epilogues` (cuBLASLt's names, e.g.
    /// `CUBLASLT_EPILOGUE_BGRADA`) with [`Error::GemmRefused`], as a real cuBLASLt does when its
    /// heuristic returns no algorithm.
    pub fn refusing(mut self, epilogues: &[&'static str]) -> Self {
        self.checks.refused = epilogues.to_vec();
        self
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

impl Work for Emulated {
    fn alloc(&self, bytes: usize) -> Result<Option<DevPtr>> {
        let layout = Layout::from_size_align(bytes, ALIGN).map_err(|e| Error::Device {
            op: "cuMemAlloc".into(),
            detail: format!("CUDA_ERROR_INVALID_VALUE: {bytes} bytes: {e}"),
        })?;
        // SAFETY: the layout has a non-zero size (the checks refuse zero bytes).
        let p = unsafe { std::alloc::alloc(layout) };
        if p.is_null() {
            return Ok(None);
        }
        // SAFETY: `p` is a fresh allocation of `bytes` bytes.
        unsafe { std::ptr::write_bytes(p, 0xFF, bytes) };
        Ok(Some(DevPtr(p as u64)))
    }

    unsafe fn release(&self, p: DevPtr, len: u64) {
        // SAFETY: allocated in `alloc` with exactly this layout (the caller's contract).
        unsafe {
            std::alloc::dealloc(
                p.0 as *mut u8,
                Layout::from_size_align_unchecked(len as usize, ALIGN),
            )
        };
    }

    unsafe fn zero(&self, p: DevPtr, len: usize) {
        // SAFETY: the caller's contract: inside a live allocation.
        unsafe { std::ptr::write_bytes(p.0 as *mut u8, 0, len) };
    }

    unsafe fn copy(&self, src: *const u8, dst: *mut u8, len: usize) {
        // SAFETY: the caller's contract; emulated device memory is host memory.
        unsafe { std::ptr::copy(src, dst, len) };
    }

    fn loadable(&self, name: &str, file: &str) -> Result<()> {
        match self.lib {
            Some(_) => Ok(()),
            None => Err(Error::Device {
                op: "cuModuleLoadData".into(),
                detail: format!(
                    "kernel {name} ({file}) cannot run: this emulated device has no emulator library"
                ),
            }),
        }
    }

    unsafe fn launch(&self, k: &CStr, cfg: &LaunchConfig, args: &mut [*mut c_void]) -> Result<()> {
        let name = k.to_string_lossy();
        let Some(lib) = &self.lib else {
            return Err(Error::Device {
                op: "cuLaunchKernel".into(),
                detail: format!("kernel {name}: this emulated device has no emulator library"),
            });
        };
        let mut err = vec![0u8; 1024];
        // SAFETY: the caller guarantees `args` matches the kernel's parameters and points to
        // live memory; the grid, block and error buffers outlive the call.
        let rc = unsafe {
            (lib.launch)(
                k.as_ptr(),
                cfg.grid.as_ptr(),
                cfg.block.as_ptr(),
                u64::from(cfg.dyn_smem),
                args.as_mut_ptr(),
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

    unsafe fn gemm(&self, g: &Gemm) {
        // SAFETY: the caller's contract: validated, every operand range live.
        unsafe { g.reference() };
    }
}
