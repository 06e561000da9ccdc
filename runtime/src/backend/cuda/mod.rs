//! CUDA backend stand-in: the operation families are shaped for cuBLAS plus NVRTC-compiled
//! kernels (see DESIGN-NOTES), but no device code exists yet, so opening it reports clearly
//! why instead of failing later inside a kernel.

use std::sync::Arc;

use super::Backend;
use crate::tensor::DType;
use crate::{Error, Result};

fn unavailable() -> Error {
    let why = if cfg!(feature = "cuda") {
        "this build has the `cuda` feature but ferrozero's CUDA kernels are not implemented yet; \
         use the CPU backend"
    } else {
        "ferrozero was built without the `cuda` feature; rebuild with `--features cuda` \
         (kernels are not implemented yet) or use the CPU backend"
    };
    Error::Unavailable {
        what: "CUDA backend",
        why: why.to_string(),
    }
}

/// GPUs this build can use; today always [`Error::Unavailable`].
pub fn device_count() -> Result<usize> {
    Err(unavailable())
}

/// Opens the CUDA backend on GPU `ordinal` computing activations in `act`; today always
/// [`Error::Unavailable`], with a reason that says whether the build lacks the `cuda` feature
/// or the kernels themselves are missing.
pub fn open(_ordinal: usize, _act: DType) -> Result<Arc<dyn Backend>> {
    Err(unavailable())
}

#[cfg(feature = "cuda")]
pub mod driver;
