//! Loading the emulator library and launching kernels with cuLaunchKernel-style parameters.

use std::ffi::{c_char, c_int, c_void, CString};
use std::marker::PhantomData;
use std::path::PathBuf;
use std::sync::OnceLock;

use bytemuck::Pod;
use ferrozero_runtime::backend::cuda::emu;
use ferrozero_runtime::backend::cuda::kernels::params::{self, ArgKind};
use ferrozero_runtime::backend::cuda::kernels::KernelSource;

type LaunchFn = unsafe extern "C" fn(
    *const c_char,
    *const u32,
    *const u32,
    u64,
    *mut *mut c_void,
    *mut c_char,
    u64,
) -> c_int;

/// A loaded emulator library.
pub struct Emu {
    _lib: libloading::Library,
    launch: LaunchFn,
}

/// One kernel argument, passed by value like cuLaunchKernel's kernelParams entries.
#[derive(Clone, Copy, Debug)]
pub enum Arg {
    /// A device (here: host) address.
    Ptr(*const c_void),
    /// `int`.
    I32(i32),
    /// `long long`.
    I64(i64),
    /// `unsigned long long`.
    U64(u64),
    /// `float`.
    F32(f32),
    /// `double`.
    F64(f64),
}

impl Arg {
    /// How the argument travels, as the declarations name it (no declared kernel takes a
    /// `double`).
    fn kind(self, kernel: &str) -> ArgKind {
        match self {
            Arg::Ptr(_) => ArgKind::Ptr,
            Arg::I32(_) => ArgKind::Int,
            Arg::I64(_) => ArgKind::LongLong,
            Arg::U64(_) => ArgKind::ULongLong,
            Arg::F32(_) => ArgKind::Float,
            Arg::F64(_) => panic!("{kernel}: no declared kernel takes a double"),
        }
    }

    /// The value's bytes in the low end of a u64 (little-endian: a pointer to it is a pointer
    /// to the value itself).
    fn bits(self) -> u64 {
        match self {
            Arg::Ptr(p) => p as usize as u64,
            Arg::I32(v) => u64::from(v as u32),
            Arg::I64(v) => v as u64,
            Arg::U64(v) => v,
            Arg::F32(v) => u64::from(v.to_bits()),
            Arg::F64(v) => v.to_bits(),
        }
    }
}

/// The directory the test libraries are built in (cached across runs by content hash).
fn build_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cuda-emu")
}

fn load(path: PathBuf) -> Emu {
    // SAFETY: the library is ours; loading runs only its static registrations.
    let lib = unsafe { libloading::Library::new(&path) }
        .unwrap_or_else(|e| panic!("loading {}: {e}", path.display()));
    // SAFETY: fz_emu_launch has exactly this signature (emu/runtime.cpp).
    let launch = unsafe {
        *lib.get::<LaunchFn>(b"fz_emu_launch\0")
            .expect("fz_emu_launch")
    };
    Emu { _lib: lib, launch }
}

fn build(sources: Option<&[KernelSource]>) -> Option<Emu> {
    emu::find_compiler()?;
    let t = std::time::Instant::now();
    let built = match sources {
        None => emu::build_library(&build_dir()),
        Some(s) => emu::build_library_from(&build_dir(), s),
    };
    let path = built.unwrap_or_else(|e| panic!("building the emulator library: {e}"));
    eprintln!(
        "emulator library {} ready in {:.1?}",
        path.display(),
        t.elapsed()
    );
    Some(load(path))
}

/// The emulator with every registered kernel, or `None` (after printing why) without a C++
/// compiler.
pub fn kernels() -> Option<&'static Emu> {
    static LIB: OnceLock<Option<Emu>> = OnceLock::new();
    skip_note(LIB.get_or_init(|| build(None)).as_ref())
}

/// The emulator built from the given sources (the emulator's own self-test kernels).
pub fn custom(sources: &'static [KernelSource]) -> Option<&'static Emu> {
    static LIB: OnceLock<Option<Emu>> = OnceLock::new();
    skip_note(LIB.get_or_init(|| build(Some(sources))).as_ref())
}

/// Says, in every test that cannot run, why it passes anyway.
fn skip_note(lib: Option<&'static Emu>) -> Option<&'static Emu> {
    if lib.is_none() {
        emu::skip_unless_required(
            "no C++ compiler (g++ or c++ on PATH, or $CXX) to build the CUDA emulator",
        );
    }
    lib
}

impl Emu {
    /// Launches `kernel`; the error is the emulator's message.
    pub fn try_launch(
        &self,
        kernel: &str,
        grid: [u32; 3],
        block: [u32; 3],
        dyn_smem: u64,
        args: &[Arg],
    ) -> Result<(), String> {
        let mut values: Vec<u64> = args.iter().map(|a| a.bits()).collect();
        let mut params: Vec<*mut c_void> = values
            .iter_mut()
            .map(|v| v as *mut u64 as *mut c_void)
            .collect();
        let name = CString::new(kernel).expect("kernel name");
        let mut err = vec![0u8; 4096];
        // SAFETY: params point at live values of the kernel's parameter types (the caller
        // passes them in order); buffers outlive the synchronous launch.
        let rc = unsafe {
            (self.launch)(
                name.as_ptr(),
                grid.as_ptr(),
                block.as_ptr(),
                dyn_smem,
                params.as_mut_ptr(),
                err.as_mut_ptr().cast(),
                err.len() as u64,
            )
        };
        if rc == 0 {
            Ok(())
        } else {
            let end = err.iter().position(|&b| b == 0).unwrap_or(err.len());
            Err(format!("rc {rc}: {}", String::from_utf8_lossy(&err[..end])))
        }
    }

    /// Launches a 1-D grid and panics on failure. A registered kernel's arguments are first
    /// checked against its declared parameters (`kernels::params`), as the backend's launches
    /// are, so a test cannot drift from the kernel's signature.
    pub fn run(&self, kernel: &str, grid: u32, block: u32, args: &[Arg]) {
        if params::params_of(kernel).is_some() {
            let kinds: Vec<ArgKind> = args.iter().map(|a| a.kind(kernel)).collect();
            params::check_launch(kernel, &kinds).unwrap_or_else(|e| panic!("{e}"));
        }
        self.try_launch(kernel, [grid, 1, 1], [block, 1, 1], 0, args)
            .unwrap_or_else(|e| panic!("{kernel}: {e}"));
    }
}

/// A 16-byte aligned device buffer (host memory in the emulator), like cudaMalloc's.
pub struct Buf<T: Pod> {
    store: Vec<u128>,
    /// Taken once from the vector, so kernel writes go through a pointer that may write.
    base: *mut u8,
    len: usize,
    _t: PhantomData<T>,
}

impl<T: Pod> Buf<T> {
    /// A copy of `data`.
    pub fn from(data: &[T]) -> Self {
        let bytes = std::mem::size_of_val(data);
        let mut store = vec![0u128; bytes.div_ceil(16).max(1)];
        bytemuck::cast_slice_mut::<u128, u8>(&mut store)[..bytes]
            .copy_from_slice(bytemuck::cast_slice(data));
        let base = store.as_mut_ptr().cast::<u8>();
        Buf {
            store,
            base,
            len: data.len(),
            _t: PhantomData,
        }
    }

    /// `len` zeroed elements.
    pub fn zeros(len: usize) -> Self {
        Self::from(&vec![T::zeroed(); len])
    }

    /// The elements.
    pub fn get(&self) -> Vec<T> {
        let bytes = self.len * std::mem::size_of::<T>();
        debug_assert_eq!(self.base.cast_const(), self.store.as_ptr().cast::<u8>());
        // SAFETY: `bytes` initialised bytes at `base` (no launch runs during the copy).
        let raw = unsafe { std::slice::from_raw_parts(self.base, bytes) };
        let mut out = vec![T::zeroed(); self.len];
        bytemuck::cast_slice_mut::<T, u8>(&mut out).copy_from_slice(raw);
        out
    }

    /// The address of element `i` (i = len is the end).
    pub fn at(&self, i: usize) -> Arg {
        assert!(i <= self.len);
        // SAFETY: within (or one past) the allocation.
        Arg::Ptr(
            unsafe { self.base.add(i * std::mem::size_of::<T>()) }
                .cast_const()
                .cast(),
        )
    }

    /// The address of element 0.
    pub fn ptr(&self) -> Arg {
        self.at(0)
    }
}

/// A null pointer argument.
pub fn null() -> Arg {
    Arg::Ptr(std::ptr::null())
}
