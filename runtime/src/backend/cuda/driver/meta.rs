//! The size-only driver (the "meta" device, as PyTorch calls a device with sizes and no data):
//! a GPU described by a [`DeviceInfo`], whose allocations are addresses with no memory behind
//! them and whose copies, memsets, launches and GEMMs are checked exactly as the emulator
//! checks them (`checks.rs`: live ranges, launch configurations, GEMM descriptions, the order
//! between streams) and then do nothing.
//!
//! The caching allocator sits on it unchanged, so the CUDA backend over it allocates and frees
//! what it would on that GPU: its counters are the figure a real run shows, with no GPU, no
//! emulator library and no compiler. Nothing is computed, so whatever the host reads back
//! (losses, norms, flags) is what its buffer held before the copy: a download leaves it
//! untouched, since in a size-only run a host buffer may be lazily zero pages that a write
//! would make resident.

use std::sync::atomic::{AtomicU64, Ordering};

use super::checked::{Checked, Work};
use super::checks::Checks;
use super::{builtin_programs, DevPtr, DeviceInfo};
use crate::{Error, Result};

/// An H100 80GB's memory as an estimate prices it by default (80 GiB).
pub const H100_MEMORY: u64 = 80 << 30;

/// The alignment of every allocation (cudaMalloc guarantees at least 256 bytes).
const ALIGN: u64 = 256;

/// Where the addresses of every size-only device of the process start: far above anything
/// Linux maps unasked (user space below 2^47), so a stray dereference faults instead of
/// reading host memory, and leaving 2^52 bytes before the top of a 57-bit space.
const BASE: u64 = 0x00F0_0000_0000_0000;

/// The next address handed out, for every size-only device of the process: with unified
/// addressing no two devices share an address, and `copy_peer`'s overlap check relies on it.
static NEXT: AtomicU64 = AtomicU64::new(BASE);

impl DeviceInfo {
    /// The GPU an estimate prices by default, size-only: an H100 80GB HBM3 (compute capability
    /// 9.0, 132 SMs, 227 KiB of opt-in dynamic shared memory per block) with `total_memory`
    /// bytes ([`H100_MEMORY`] unless a config's `device_memory_limit` or a user's card says
    /// otherwise).
    pub fn h100_sizes_only(total_memory: Option<u64>) -> DeviceInfo {
        DeviceInfo {
            name: "NVIDIA H100 80GB HBM3".into(),
            ordinal: 0,
            compute_capability: (9, 0),
            total_memory: total_memory.unwrap_or(H100_MEMORY),
            multiprocessors: 132,
            max_dyn_smem_per_block: 227 * 1024,
            driver_version: None,
            nvrtc_version: None,
            cublaslt_version: None,
            emulated: false,
            sizes_only: true,
        }
    }
}

/// The size-only driver (see the module documentation): the checked device that does no work.
pub type MetaDriver = Checked<SizeOnly>;

/// What the size-only device does with a call its checks admitted: nothing, beyond handing
/// out addresses.
#[derive(Debug)]
pub struct SizeOnly;

impl Checked<SizeOnly> {
    /// A size-only device described by `info` (marked [`DeviceInfo::sizes_only`], not
    /// emulated), knowing the builtin kernel registry's kernels by name; nothing is compiled.
    pub fn new(mut info: DeviceInfo) -> Result<Self> {
        info.sizes_only = true;
        info.emulated = false;
        Ok(Checked {
            checks: Checks::new(info, builtin_programs())?,
            work: SizeOnly,
        })
    }
}

/// Nothing but addresses: every other call does nothing (`Work`'s defaults).
impl Work for SizeOnly {
    /// `bytes` of fresh address space, 256-byte aligned; never 0 and never given again.
    fn alloc(&self, bytes: usize) -> Result<Option<DevPtr>> {
        let len = (bytes as u64).div_ceil(ALIGN) * ALIGN;
        let start = NEXT.fetch_add(len, Ordering::Relaxed);
        if start.checked_add(len).is_none_or(|end| end > u64::MAX / 2) {
            return Err(Error::Device {
                op: "cuMemAlloc".into(),
                detail: format!(
                    "CUDA_ERROR_OUT_OF_MEMORY: the size-only devices' address space is spent \
                     ({bytes} bytes requested at {start:#x})"
                ),
            });
        }
        Ok(Some(DevPtr(start)))
    }
}
