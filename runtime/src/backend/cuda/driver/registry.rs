//! Where the driver finds ferrozero's own kernels: the kernels registry
//! (`backend::cuda::kernels`) and the CPU emulator library (`backend::cuda::emu`).
//!
//! These two functions are the only place the driver names them.

use std::path::{Path, PathBuf};

use super::Program;

/// Every kernel source of ferrozero, as the driver compiles them (the registry's
/// `kernels::SOURCES`, each with `kernels::program_text` applied).
pub fn builtin_programs() -> Vec<Program> {
    use super::super::kernels;
    kernels::SOURCES
        .iter()
        .map(|s| Program::new(s.file, kernels::program_text(s), s.kernels))
        .collect()
}

/// Builds the CPU emulator library (the emulator runtime plus every builtin kernel source,
/// compiled as C++) under `dir` and returns its path; `None` when this build has no emulator.
pub fn build_builtin_emulator(dir: &Path) -> Option<Result<PathBuf, String>> {
    Some(super::super::emu::build_library(dir))
}
