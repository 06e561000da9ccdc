//! CUDA backend stand-in: the operation families are shaped for cuBLAS plus NVRTC-compiled
//! kernels (see DESIGN-NOTES), but no device code exists yet, so opening it reports clearly
//! why instead of failing later inside a kernel.

pub mod emu;
pub mod kernels;

use std::sync::Arc;

use super::Backend;
use crate::{Error, Result};

/// Opens the CUDA backend; today always [`Error::Unavailable`], with a reason that says
/// whether the build lacks the `cuda` feature or the kernels themselves are missing.
pub fn open() -> Result<Arc<dyn Backend>> {
    let why = if cfg!(feature = "cuda") {
        "this build has the `cuda` feature but ferrozero's CUDA kernels are not implemented yet; \
         use the CPU backend"
    } else {
        "ferrozero was built without the `cuda` feature; rebuild with `--features cuda` \
         (kernels are not implemented yet) or use the CPU backend"
    };
    Err(Error::Unavailable {
        what: "CUDA backend",
        why: why.to_string(),
    })
}
