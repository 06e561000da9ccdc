//! The CUDA backend: device storage, the operation families on device views (cuBLASLt GEMMs and
//! our NVRTC-compiled kernels), and the driver layer underneath (`driver`: a GPU through cudarc,
//! or the CPU emulator that tests run on). Compiled with the `cuda` feature; without it (or
//! without a GPU) opening it is an error that says why.

use std::sync::Arc;

use super::Backend;
use crate::tensor::DType;
#[cfg(not(feature = "cuda"))]
use crate::Error;
use crate::Result;

#[cfg(not(feature = "cuda"))]
mod absent;
#[cfg(feature = "cuda")]
mod attention;
#[cfg(feature = "cuda")]
mod backend;
#[cfg(feature = "cuda")]
mod device;
#[cfg(feature = "cuda")]
mod elementwise;
#[cfg(feature = "cuda")]
mod head;
#[cfg(feature = "cuda")]
mod host_order;
#[cfg(feature = "cuda")]
mod in_flight;
#[cfg(feature = "cuda")]
mod lamb;
#[cfg(feature = "cuda")]
mod launch;
#[cfg(feature = "cuda")]
mod matmul;
#[cfg(feature = "cuda")]
mod norm;
#[cfg(feature = "cuda")]
mod optim;
#[cfg(feature = "cuda")]
pub(crate) mod peer;
#[cfg(feature = "cuda")]
mod pinned;
#[cfg(feature = "cuda")]
mod quant;
#[cfg(feature = "cuda")]
mod rope;
#[cfg(feature = "cuda")]
mod status;
#[cfg(feature = "cuda")]
mod storage;
#[cfg(feature = "cuda")]
mod stream;
#[cfg(feature = "cuda")]
mod token;
#[cfg(feature = "cuda")]
mod upload;

#[cfg(not(feature = "cuda"))]
pub use absent::{CudaBuf, CudaIds, CudaView, CudaViewMut};
#[cfg(feature = "cuda")]
pub use backend::CudaBackend;
#[cfg(feature = "cuda")]
pub use device::CudaDevice;
#[cfg(feature = "cuda")]
pub(crate) use storage::RawView;
#[cfg(feature = "cuda")]
pub use storage::{CudaBuf, CudaIds, CudaView, CudaViewMut};

/// The environment variable that replaces the GPU by the CPU emulator of the device: every
/// kernel, GEMM and copy then runs on the host as a GPU would run it (slowly), so the whole GPU
/// path (`train_gpt --device cuda`) can be exercised on a machine without one.
pub const EMULATOR_ENV: &str = "FERROZERO_CUDA_EMULATOR";

#[cfg(feature = "cuda")]
fn emulator_requested() -> bool {
    std::env::var(EMULATOR_ENV).is_ok_and(|v| !v.is_empty() && v != "0")
}

/// GPUs this build and machine can use (an error saying why when there are none to ask about).
pub fn device_count() -> Result<usize> {
    #[cfg(feature = "cuda")]
    {
        if emulator_requested() {
            return Ok(1);
        }
        driver::device_count()
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(not_built())
    }
}

/// Opens the CUDA backend on GPU `ordinal`, computing activations in `act`.
pub fn open(ordinal: usize, act: DType) -> Result<Arc<dyn Backend>> {
    #[cfg(feature = "cuda")]
    {
        if emulator_requested() {
            tracing::warn!("{EMULATOR_ENV} is set: the CUDA device is the CPU emulator");
            return Ok(emulated(act)?);
        }
        let drv = driver::CudaDriver::open(ordinal, driver::builtin_programs())?;
        let dev = CudaDevice::new(Arc::new(drv), None);
        Ok(Arc::new(CudaBackend::new(dev, act)))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (ordinal, act);
        Err(not_built())
    }
}

/// The CUDA backend on the CPU emulator of the device (tests and CI: every kernel, GEMM and
/// copy runs on the host with CUDA's semantics, and every pointer is checked).
#[cfg(feature = "cuda")]
pub fn emulated(act: DType) -> Result<Arc<CudaBackend>> {
    let drv = driver::EmuDriver::builtin()?;
    let dev = CudaDevice::new(Arc::new(drv), None);
    Ok(Arc::new(CudaBackend::new(dev, act)))
}

/// The CUDA backend on a size-only device described by `info` (`driver::MetaDriver`): every
/// buffer, copy, launch and GEMM is allocated and checked as on that GPU and nothing is
/// computed, so `memory_stats` reads what a run there would hold, without the GPU or memory for
/// the contents. Each call is a device of its own, as each rank of a run has (unified
/// addressing: no two share an address). [`driver::DeviceInfo::h100_sizes_only`] is the GPU an
/// estimate prices by default.
#[cfg(feature = "cuda")]
pub fn meta(act: DType, info: driver::DeviceInfo) -> Result<Arc<CudaBackend>> {
    let drv = driver::MetaDriver::new(info)?;
    let dev = CudaDevice::new(Arc::new(drv), None);
    Ok(Arc::new(CudaBackend::new(dev, act)))
}

#[cfg(not(feature = "cuda"))]
fn not_built() -> Error {
    Error::Unavailable {
        what: "CUDA backend",
        why: "ferrozero was built without the `cuda` feature; rebuild with `--features cuda`"
            .into(),
    }
}

#[cfg(feature = "cuda")]
pub mod driver;
pub mod emu;
pub mod kernels;
