//! Where the driver finds ferrozero's own kernels: the kernels registry
//! (`backend::cuda::kernels`) and the CPU emulator library (`backend::cuda::emu`).
//!
//! Those two modules come from the kernels branch. These two functions are the only place the
//! driver names them, so wiring them in after the merge means replacing the two bodies with:
//!
//! ```ignore
//! pub fn builtin_programs() -> Vec<Program> {
//!     use super::super::kernels;
//!     kernels::SOURCES
//!         .iter()
//!         .map(|s| Program::new(s.file, kernels::program_text(s), s.kernels))
//!         .collect()
//! }
//!
//! pub fn build_builtin_emulator(dir: &Path) -> Option<Result<PathBuf, String>> {
//!     Some(super::super::emu::build_library(dir))
//! }
//! ```
//!
//! (and the kernels branch's `libloading = "0.8"` dev-dependency becomes `"0.9"`, the version
//! this feature's dependency and cudarc use: with both, the `cuda` feature's tests do not
//! compile). Checked on a scratch merge of both branches: every registry source then compiles
//! with NVRTC and ptxas for sm_80 and sm_90, and `emulated()` runs the registry's kernels.
//!
//! Until then the registry is empty and there is no builtin emulator library: the drivers
//! still allocate, copy and multiply, and `kernel(name)` answers that no such kernel exists.

use std::path::{Path, PathBuf};

use super::Program;

/// Every kernel source of ferrozero, as the driver compiles them (the registry's
/// `kernels::SOURCES`, each with `kernels::program_text` applied).
pub fn builtin_programs() -> Vec<Program> {
    Vec::new()
}

/// Builds the CPU emulator library (the emulator runtime plus every builtin kernel source,
/// compiled as C++) under `dir` and returns its path; `None` when this build has no emulator.
pub fn build_builtin_emulator(dir: &Path) -> Option<Result<PathBuf, String>> {
    let _ = dir;
    None
}
