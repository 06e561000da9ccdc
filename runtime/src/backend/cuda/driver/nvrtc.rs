//! Kernel compilation with NVRTC, and the disk cache of compiled images.
//!
//! Options (the same for the runtime and for CI's check, which calls [`compile_cached`]):
//! `--gpu-architecture=sm_XY` (CUBIN: nothing is JIT-compiled when the module loads) or
//! `compute_XY` (PTX, for CI's ptxas check and for devices newer than NVRTC), `--std=c++17`,
//! `--fmad=false` and `-lineinfo`. No fast-math. `--fmad=false` because the CPU emulator
//! compiles the same text with `-ffp-contract=off`: with it, `a * b + c` rounds twice on both,
//! so the emulator's results are the GPU's (kernels that want a fused multiply-add say so with
//! `fmaf`/`__fmaf_rn`). `-lineinfo` only adds source lines for profilers and sanitizers.
//!
//! Cache: `$FERROZERO_KERNEL_CACHE`, else `$XDG_CACHE_HOME/ferrozero/kernels`, else
//! `~/.cache/ferrozero/kernels`; one file per image, `{file}-sm{XY}-{hash}.cubin` (or `.ptx`),
//! the hash over the program text, the options and NVRTC's version. Files are written to a
//! temporary name and renamed, and end with a 16-byte trailer (`FZK1`, CRC-32C, length), so a
//! torn or corrupt entry is detected and recompiled, never loaded; an unwritable cache is a
//! warning.

use std::collections::HashMap;
use std::ffi::{c_char, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::nvrtc::{result, sys};

use super::{freeze, thaw, Frozen, Program};
use crate::{Error, Result};

/// What NVRTC produces.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ImageKind {
    /// Machine code for exactly one architecture (`sm_XY`).
    Cubin,
    /// PTX for a virtual architecture (`compute_XY`), assembled by ptxas or the driver's JIT.
    Ptx,
}

/// An architecture and the kind of image to produce for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Target {
    /// Compute capability (major, minor), e.g. (9, 0).
    pub arch: (u32, u32),
    /// CUBIN or PTX.
    pub kind: ImageKind,
}

impl Target {
    /// CUBIN for `sm_{major}{minor}`.
    pub fn cubin(major: u32, minor: u32) -> Self {
        Target {
            arch: (major, minor),
            kind: ImageKind::Cubin,
        }
    }

    /// PTX for `compute_{major}{minor}`.
    pub fn ptx(major: u32, minor: u32) -> Self {
        Target {
            arch: (major, minor),
            kind: ImageKind::Ptx,
        }
    }

    /// The architecture as NVRTC numbers it: 90 for (9, 0).
    pub fn sm(&self) -> u32 {
        self.arch.0 * 10 + self.arch.1
    }

    /// NVRTC's architecture option.
    pub fn arch_option(&self) -> String {
        match self.kind {
            ImageKind::Cubin => format!("--gpu-architecture=sm_{}", self.sm()),
            ImageKind::Ptx => format!("--gpu-architecture=compute_{}", self.sm()),
        }
    }

    fn extension(&self) -> &'static str {
        match self.kind {
            ImageKind::Cubin => "cubin",
            ImageKind::Ptx => "ptx",
        }
    }
}

/// Every option the runtime passes to NVRTC for `target`.
pub fn options(target: Target) -> Vec<String> {
    vec![
        target.arch_option(),
        "--std=c++17".into(),
        "--fmad=false".into(),
        "-lineinfo".into(),
    ]
}

/// Whether the NVRTC library can be loaded (cudarc's candidate names, e.g. `libnvrtc.so.13`,
/// `libnvrtc.so.12`, on the dynamic loader's path).
pub fn is_available() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only tries to open the library and drops it again.
    *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() })
}

fn unavailable() -> Error {
    Error::Unavailable {
        what: "NVRTC",
        why: "libnvrtc.so could not be loaded (looked for libnvrtc.so, libnvrtc.so.13, \
              libnvrtc.so.12, ...); put the directory holding it on LD_LIBRARY_PATH, e.g. the \
              nvidia-cuda-nvrtc-cu12 wheel's nvidia/cuda_nvrtc/lib"
            .into(),
    }
}

fn check() -> Result<()> {
    if is_available() {
        Ok(())
    } else {
        Err(unavailable())
    }
}

/// NVRTC's own name for a result code, e.g. `NVRTC_ERROR_COMPILATION`.
fn error_name(code: sys::nvrtcResult) -> String {
    // SAFETY: nvrtcGetErrorString returns a static NUL-terminated string for every code.
    let p = unsafe { sys::nvrtcGetErrorString(code) };
    if p.is_null() {
        format!("{code:?}")
    } else {
        // SAFETY: non-null, NUL-terminated, static.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

fn nvrtc_error(op: &str, e: result::NvrtcError, context: &str) -> Error {
    Error::Device {
        op: op.into(),
        detail: format!("{}{context}", error_name(e.0)),
    }
}

/// NVRTC's version (major, minor).
pub fn version() -> Result<(u32, u32)> {
    check()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two valid out-pointers.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| nvrtc_error("nvrtcVersion", e, ""))?;
    Ok((major as u32, minor as u32))
}

/// The real architectures NVRTC can produce CUBIN for, ascending (e.g. 75, 80, ..., 120).
pub fn supported_archs() -> Result<Vec<u32>> {
    check()?;
    let mut n = 0;
    // SAFETY: a valid out-pointer.
    unsafe { sys::nvrtcGetNumSupportedArchs(&mut n) }
        .result()
        .map_err(|e| nvrtc_error("nvrtcGetNumSupportedArchs", e, ""))?;
    let mut archs = vec![0i32; n.max(0) as usize];
    // SAFETY: the buffer holds exactly the number of entries NVRTC said it would write.
    unsafe { sys::nvrtcGetSupportedArchs(archs.as_mut_ptr()) }
        .result()
        .map_err(|e| nvrtc_error("nvrtcGetSupportedArchs", e, ""))?;
    let mut archs: Vec<u32> = archs.into_iter().map(|a| a as u32).collect();
    archs.sort_unstable();
    Ok(archs)
}

/// What the runtime compiles for a device of compute capability `cc`: CUBIN for it when NVRTC
/// knows the architecture, else PTX for the newest architecture NVRTC knows below it, which the
/// driver JIT-compiles at load (an NVRTC older than the device).
pub fn target_for(cc: (u32, u32)) -> Result<Target> {
    let sm = cc.0 * 10 + cc.1;
    let archs = supported_archs()?;
    if archs.contains(&sm) {
        return Ok(Target::cubin(cc.0, cc.1));
    }
    match archs.iter().rev().find(|&&a| a <= sm) {
        Some(&a) => Ok(Target::ptx(a / 10, a % 10)),
        None => Err(Error::Unavailable {
            what: "NVRTC",
            why: format!(
                "NVRTC {:?} supports architectures {archs:?}, none at or below the device's sm_{sm}",
                version().ok()
            ),
        }),
    }
}

/// Compiles `program` for `target` with NVRTC, without the cache. A compile error is an
/// [`Error::Device`] carrying NVRTC's log.
pub fn compile_uncached(program: &Program, target: Target) -> Result<Vec<u8>> {
    check()?;
    let for_what = format!(" ({} for {})", program.file, target.arch_option());
    let src = CString::new(program.text.as_str())
        .map_err(|_| Error::Invalid(format!("{}: the program text contains NUL", program.file)))?;
    let name = CString::new(program.file.as_str())
        .map_err(|_| Error::Invalid(format!("{:?}: file name contains NUL", program.file)))?;
    let prog = result::create_program(&src, Some(&name))
        .map_err(|e| nvrtc_error("nvrtcCreateProgram", e, &for_what))?;
    /// Destroys the program however compilation ends.
    struct Guard(sys::nvrtcProgram);
    impl Drop for Guard {
        fn drop(&mut self) {
            // SAFETY: created above and destroyed exactly once, here.
            let _ = unsafe { result::destroy_program(self.0) };
        }
    }
    let guard = Guard(prog);
    let opts = options(target);
    // SAFETY: `prog` is live (the guard destroys it only on return).
    let compiled = unsafe { result::compile_program(guard.0, &opts) };
    // SAFETY: as above.
    let log = unsafe { result::get_program_log(guard.0) }
        .map(|l| {
            let bytes: Vec<u8> = l
                .into_iter()
                .map(|c| c as u8)
                .take_while(|&c| c != 0)
                .collect();
            String::from_utf8_lossy(&bytes).trim().to_string()
        })
        .unwrap_or_default();
    if let Err(e) = compiled {
        return Err(nvrtc_error(
            "nvrtcCompileProgram",
            e,
            &format!("{for_what} with {}:\n{log}", opts.join(" ")),
        ));
    }
    if !log.is_empty() {
        tracing::debug!("NVRTC{for_what}: {log}");
    }
    match target.kind {
        ImageKind::Cubin => {
            let mut size = 0usize;
            // SAFETY: `prog` is live and compiled; a valid out-pointer.
            unsafe { sys::nvrtcGetCUBINSize(guard.0, &mut size) }
                .result()
                .map_err(|e| nvrtc_error("nvrtcGetCUBINSize", e, &for_what))?;
            let mut image = vec![0u8; size];
            // SAFETY: the buffer holds the size NVRTC reported.
            unsafe { sys::nvrtcGetCUBIN(guard.0, image.as_mut_ptr() as *mut c_char) }
                .result()
                .map_err(|e| nvrtc_error("nvrtcGetCUBIN", e, &for_what))?;
            Ok(image)
        }
        ImageKind::Ptx => {
            // SAFETY: `prog` is live and compiled.
            let ptx = unsafe { result::get_ptx(guard.0) }
                .map_err(|e| nvrtc_error("nvrtcGetPTX", e, &for_what))?;
            Ok(ptx
                .into_iter()
                .map(|c| c as u8)
                .take_while(|&c| c != 0)
                .collect())
        }
    }
}

/// The kernel cache directory from the environment (see the module documentation); `None` when
/// none of the variables (nor `HOME`) is set.
pub fn cache_dir() -> Option<PathBuf> {
    let var = |name: &str| {
        std::env::var_os(name)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    if let Some(d) = var("FERROZERO_KERNEL_CACHE") {
        return Some(d);
    }
    if let Some(d) = var("XDG_CACHE_HOME").filter(|d| d.is_absolute()) {
        return Some(d.join("ferrozero").join("kernels"));
    }
    var("HOME").map(|h| h.join(".cache").join("ferrozero").join("kernels"))
}

/// 64-bit FNV-1a: a stable hash (unlike `std`'s), plenty for naming cache entries.
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for &b in *part {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        // Separate the parts so ("ab", "c") and ("a", "bc") differ.
        h ^= 0xff;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The cache file name of `program` compiled for `target` by NVRTC `nvrtc_version`.
pub fn cache_file_name(program: &Program, target: Target, nvrtc_version: (u32, u32)) -> String {
    let opts = options(target);
    let version = format!("nvrtc {}.{}", nvrtc_version.0, nvrtc_version.1);
    let mut parts: Vec<&[u8]> = vec![program.text.as_bytes(), version.as_bytes()];
    parts.extend(opts.iter().map(|o| o.as_bytes()));
    let stem = program.file.strip_suffix(".cu").unwrap_or(&program.file);
    format!(
        "{stem}-sm{}-{:016x}.{}",
        target.sm(),
        fnv1a(&parts),
        target.extension()
    )
}

const TRAILER_MAGIC: &[u8; 4] = b"FZK1";
const TRAILER_LEN: usize = 16;

/// The image in a cache file's bytes, if the trailer vouches for it.
fn unwrap_entry(bytes: &[u8]) -> Option<&[u8]> {
    if bytes.len() < TRAILER_LEN {
        return None;
    }
    let (image, trailer) = bytes.split_at(bytes.len() - TRAILER_LEN);
    let crc = u32::from_le_bytes(trailer[4..8].try_into().ok()?);
    let len = u64::from_le_bytes(trailer[8..16].try_into().ok()?);
    (&trailer[..4] == TRAILER_MAGIC
        && len == image.len() as u64
        && crc == crc32c::crc32c(image)
        && !image.is_empty())
    .then_some(image)
}

/// Writes `image` as cache entry `path`, atomically (temporary file, then rename).
fn write_entry(path: &Path, image: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let tmp = dir.join(format!(
        ".{}.{}.{nanos}.tmp",
        path.file_name()
            .map_or_else(Default::default, |n| n.to_string_lossy()),
        std::process::id()
    ));
    let mut bytes = Vec::with_capacity(image.len() + TRAILER_LEN);
    bytes.extend_from_slice(image);
    bytes.extend_from_slice(TRAILER_MAGIC);
    bytes.extend_from_slice(&crc32c::crc32c(image).to_le_bytes());
    bytes.extend_from_slice(&(image.len() as u64).to_le_bytes());
    let written = std::fs::write(&tmp, &bytes).and_then(|()| std::fs::rename(&tmp, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// A compiled image and where it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Compiled {
    /// The CUBIN, or the PTX text (without a trailing NUL).
    pub image: Vec<u8>,
    /// Whether it was read from the cache rather than compiled.
    pub from_cache: bool,
    /// The cache entry's path, when a cache directory was given.
    pub path: Option<PathBuf>,
}

/// Compiles `program` for `target` through the cache in `dir` (no cache with `None`): a valid
/// entry is read; a missing, unreadable or corrupt one is compiled and (re)written; a failure
/// to write is a warning.
pub fn compile_cached(program: &Program, target: Target, dir: Option<&Path>) -> Result<Compiled> {
    let Some(dir) = dir else {
        return Ok(Compiled {
            image: compile_uncached(program, target)?,
            from_cache: false,
            path: None,
        });
    };
    let path = dir.join(cache_file_name(program, target, version()?));
    match std::fs::read(&path) {
        Ok(bytes) => match unwrap_entry(&bytes) {
            Some(image) => {
                return Ok(Compiled {
                    image: image.to_vec(),
                    from_cache: true,
                    path: Some(path),
                })
            }
            None => tracing::warn!(
                "kernel cache entry {} is corrupt ({} bytes); recompiling",
                path.display(),
                bytes.len()
            ),
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => tracing::warn!(
            "kernel cache entry {} is unreadable ({e}); recompiling",
            path.display()
        ),
    }
    let image = compile_uncached(program, target)?;
    if let Err(e) = write_entry(&path, &image) {
        tracing::warn!(
            "kernel cache {} is not writable ({e}); {} will be compiled again next time",
            dir.display(),
            program.file
        );
    }
    Ok(Compiled {
        image,
        from_cache: false,
        path: Some(path),
    })
}

/// Compiles `program` for `target` through the cache in [`cache_dir`].
pub fn compile(program: &Program, target: Target) -> Result<Vec<u8>> {
    compile_cached(program, target, cache_dir().as_deref()).map(|c| c.image)
}

/// Compiles `program` for `target` through the cache in [`cache_dir`] at most once per process
/// (per program text, options, NVRTC version and target): every driver of the process, one per
/// GPU, shares the result. A failure is remembered too.
pub fn compile_once(program: &Program, target: Target) -> Result<Arc<Compiled>> {
    type Cell = Arc<OnceLock<Frozen<Arc<Compiled>>>>;
    static MEMO: OnceLock<Mutex<HashMap<String, Cell>>> = OnceLock::new();
    let key = cache_file_name(program, target, version()?);
    let cell = MEMO
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .entry(key)
        .or_default()
        .clone();
    // Compiled outside the table's lock: other sources compile meanwhile.
    thaw(cell.get_or_init(|| {
        compile_cached(program, target, cache_dir().as_deref())
            .map(Arc::new)
            .map_err(freeze)
    }))
}
