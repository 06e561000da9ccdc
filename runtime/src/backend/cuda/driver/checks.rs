//! What the emulated and the size-only driver share: everything a call is checked against
//! before it touches memory (the live-allocation table, the kernel table, events, registered
//! host ranges, the process's stream-order book) and those checks, in one place, so the two
//! drivers refuse the same calls with the same words and differ only in what a call then
//! does: the emulator moves bytes and runs kernels, the size-only driver does nothing.

use std::collections::{HashMap, HashSet};
use std::ffi::{c_void, CString};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

use super::gemm::Gemm;
use super::order;
use super::table::AllocTable;
use super::{
    kernel_table, unknown_kernel, DevPtr, DeviceInfo, Event, Kernel, LaunchConfig, Program,
    StreamKind,
};
use crate::{Error, Result};

/// The page size CUDA pins host memory in.
const HOST_PAGE: usize = 4096;

/// A checked device's state (see the module documentation).
#[derive(Debug)]
pub(super) struct Checks {
    pub(super) info: DeviceInfo,
    /// The memory table; held during every operation that touches device memory, so a free
    /// cannot race with a copy, a GEMM or a kernel.
    memory: Mutex<AllocTable>,
    pub(super) programs: Vec<Program>,
    /// Per kernel: its program index, name and the name as a C string for the library.
    pub(super) kernels: Vec<(usize, String, CString)>,
    events: Mutex<HashSet<u64>>,
    next_event: AtomicU64,
    /// Registered host ranges: start address -> (first page, page after the last, bytes).
    registered: Mutex<HashMap<usize, (usize, usize, usize)>>,
    /// This device's identity in the process's stream-order book (`order.rs`).
    pub(super) id: u64,
    /// Epilogues (cuBLASLt's names) whose products are refused as a real cuBLASLt refuses a
    /// product its heuristic has no algorithm for: to test the backend's separate kernels.
    pub(super) refused: Vec<&'static str>,
}

/// The bytes `p..p + bytes`, for the order check.
fn span(p: DevPtr, bytes: usize) -> order::Span {
    (p.0, p.0 + bytes as u64)
}

impl Checks {
    /// A device described by `info` that knows the kernels of `programs`.
    pub fn new(info: DeviceInfo, programs: Vec<Program>) -> Result<Self> {
        let kernels = kernel_table(&programs)?
            .into_iter()
            .map(|(p, name)| {
                let c = CString::new(name.as_str())
                    .map_err(|_| Error::Invalid(format!("kernel name {name:?} contains NUL")))?;
                Ok((p, name, c))
            })
            .collect::<Result<Vec<_>>>()?;
        static NEXT: AtomicU64 = AtomicU64::new(1);
        Ok(Checks {
            info,
            memory: Mutex::new(AllocTable::default()),
            programs,
            kernels,
            events: Mutex::new(HashSet::new()),
            next_event: AtomicU64::new(1),
            registered: Mutex::new(HashMap::new()),
            id: NEXT.fetch_add(1, Ordering::Relaxed),
            refused: Vec::new(),
        })
    }

    /// The memory table, locked.
    pub fn memory(&self) -> MutexGuard<'_, AllocTable> {
        // A panic while holding the table cannot leave it inconsistent in a way that matters
        // more than the panic itself; keep serving.
        self.memory.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The memory table of a device being dropped.
    pub fn memory_mut(&mut self) -> &mut AllocTable {
        self.memory.get_mut().unwrap_or_else(|e| e.into_inner())
    }

    /// What the device is called in an out-of-memory message.
    fn kind(&self) -> &'static str {
        match self.info.sizes_only {
            true => "size-only",
            false => "emulated",
        }
    }

    /// An out-of-memory refusal of `bytes` saying `why`.
    pub fn out_of_memory(&self, mem: &AllocTable, bytes: usize, why: String) -> Error {
        Error::DeviceMemory {
            requested: bytes as u64,
            live: mem.allocated(),
            peak: mem.peak(),
            limit: self.info.total_memory,
            detail: format!("cuMemAlloc: CUDA_ERROR_OUT_OF_MEMORY: {why}"),
        }
    }

    /// The checks of `cuMemAlloc` for `bytes`: more than zero, within the device's memory. The
    /// table comes back locked for the caller to enter the new allocation.
    pub fn admit(&self, bytes: usize) -> Result<MutexGuard<'_, AllocTable>> {
        if bytes == 0 {
            return Err(Error::Device {
                op: "cuMemAlloc".into(),
                detail: "CUDA_ERROR_INVALID_VALUE: zero bytes requested".into(),
            });
        }
        let mem = self.memory();
        let total = self.info.total_memory;
        if mem.allocated().saturating_add(bytes as u64) > total {
            let why = format!("out of memory ({} device of {total} bytes)", self.kind());
            return Err(self.out_of_memory(&mem, bytes, why));
        }
        Ok(mem)
    }

    /// `cuMemFree`'s check and bookkeeping: `p` leaves the table (its length comes back) and
    /// the host has waited for the device.
    pub fn free(&self, p: DevPtr) -> Result<u64> {
        let len = self.memory().remove(p)?;
        StreamKind::ALL
            .into_iter()
            .for_each(|s| order::synchronized(self.id, s));
        Ok(len)
    }

    /// A memset's checks; the table comes back locked for the write.
    pub fn memset(
        &self,
        p: DevPtr,
        bytes: usize,
        s: StreamKind,
    ) -> Result<MutexGuard<'_, AllocTable>> {
        order::issue(self.id, s, &[span(p, bytes)])?;
        let mem = self.memory();
        mem.check("cuMemsetD8Async", "destination", p, bytes as u64)?;
        Ok(mem)
    }

    /// A device-to-device copy's checks; the table comes back locked for the copy.
    pub fn copy_dtod(
        &self,
        (src, dst): (DevPtr, DevPtr),
        bytes: usize,
        s: StreamKind,
    ) -> Result<MutexGuard<'_, AllocTable>> {
        order::issue(self.id, s, &[span(src, bytes), span(dst, bytes)])?;
        let mem = self.memory();
        mem.check_copy(src, dst, bytes as u64)?;
        Ok(mem)
    }

    /// An upload's or a download's checks of its device range (`op` and what the range is
    /// to it); the table comes back locked for the copy.
    pub fn host_copy(
        &self,
        (op, what): (&str, &str),
        p: DevPtr,
        len: usize,
        s: StreamKind,
    ) -> Result<MutexGuard<'_, AllocTable>> {
        order::host_copy(self.id, s, span(p, len))?;
        let mem = self.memory();
        mem.check(op, what, p, len as u64)?;
        Ok(mem)
    }

    /// A synchronous copy on `s` returned: the host has seen the stream finish.
    pub fn synchronized(&self, s: StreamKind) {
        order::synchronized(self.id, s);
    }

    /// A copy between devices of the process: ordered after its owners' compute streams (the
    /// ranges were checked with their owners by `copy_peer`).
    pub fn copy_unified(
        &self,
        (src, dst): (DevPtr, DevPtr),
        bytes: usize,
        s: StreamKind,
        owners: [u64; 2],
    ) -> Result<()> {
        order::access(self.id, s, (src.0, dst.0, bytes as u64), owners)
    }

    /// The kernel table's index of `name`, or the unknown-kernel error every driver gives.
    pub fn lookup(&self, name: &str) -> Result<usize> {
        self.kernels
            .iter()
            .position(|(_, n, _)| n == name)
            .ok_or_else(|| unknown_kernel(name, &self.programs))
    }

    /// A launch's checks: a handle of this device, a configuration the device accepts, its
    /// pointer arguments ordered on `s`. The kernel's name and C name come back.
    ///
    /// # Safety
    /// `params` holds one pointer per parameter of the kernel, each to a value of its type.
    pub unsafe fn launch(
        &self,
        k: Kernel,
        cfg: &LaunchConfig,
        params: &[*mut c_void],
        s: StreamKind,
    ) -> Result<(&str, &CString)> {
        let (_, name, cname) = k.entry(&self.kernels)?;
        cfg.validate(name, self.info.max_dyn_smem_per_block)?;
        // SAFETY: the caller's contract: `params` matches the kernel's parameters.
        order::issue(self.id, s, &unsafe { self.reach(name, params) })?;
        Ok((name, cname))
    }

    /// What kernel `name`'s declared pointer arguments reach (none for a kernel the registry's
    /// parameter table does not declare: a test's own).
    ///
    /// # Safety
    /// `params` holds one pointer per parameter of `name`, each to a value of its type.
    unsafe fn reach(&self, name: &str, params: &[*mut c_void]) -> Vec<order::Span> {
        use crate::backend::cuda::kernels::params::{params_of, ArgKind};
        let Some((declared, _)) = params_of(name) else {
            return Vec::new();
        };
        let ptrs = declared
            .iter()
            .zip(params)
            .filter(|(d, _)| d.ty.kind() == ArgKind::Ptr)
            // SAFETY: a pointer parameter's value is a device address (8 bytes).
            .map(|(_, &v)| unsafe { *(v as *const u64) });
        order::reach(self.id, ptrs)
    }

    /// A GEMM's checks: the description (the validation both drivers call), then every
    /// operand range live and ordered on `s`. The table comes back locked for the product.
    pub fn gemm(&self, g: &Gemm, s: StreamKind) -> Result<MutexGuard<'_, AllocTable>> {
        g.validate()?;
        if self.refused.contains(&g.epilogue.cublas_name()) {
            return Err(Error::GemmRefused {
                epilogue: g.epilogue.cublas_name(),
                detail: format!(
                    "CUBLAS_STATUS_NOT_SUPPORTED (the emulator refuses it) for {}",
                    g.describe()
                ),
            });
        }
        let ranges = g.ranges()?;
        let spans: Vec<_> = ranges
            .iter()
            .map(|r| (r.start, r.start + r.bytes))
            .collect();
        order::issue(self.id, s, &spans)?;
        let mem = self.memory();
        for r in ranges {
            mem.check("cublasLtMatmul", r.what, DevPtr(r.start), r.bytes)?;
        }
        Ok(mem)
    }
}

/// Events, host registration and the order book's bookkeeping: the same on both drivers, since
/// neither touches memory for them.
impl Checks {
    fn check_event(&self, op: &str, e: Event) -> Result<()> {
        if self
            .events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(&e.0)
        {
            Ok(())
        } else {
            Err(Error::Device {
                op: op.into(),
                detail: format!("CUDA_ERROR_INVALID_HANDLE: event {} is not live", e.0),
            })
        }
    }

    /// `cuEventCreate`.
    pub fn event_create(&self) -> Event {
        let id = self.next_event.fetch_add(1, Ordering::Relaxed);
        self.events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id);
        Event(id)
    }

    /// `cuEventRecord`.
    pub fn event_record(&self, e: Event, s: StreamKind) -> Result<()> {
        self.check_event("cuEventRecord", e)?;
        order::record(self.id, s, e.0);
        Ok(())
    }

    /// `cuStreamWaitEvent` for an event of this device.
    pub fn stream_wait_event(&self, s: StreamKind, e: Event) -> Result<()> {
        self.check_event("cuStreamWaitEvent", e)?;
        order::wait(self.id, s, self.id, e.0);
        Ok(())
    }

    /// Whether `e` is live, for a wait another device issues.
    pub fn check_event_live(&self, op: &str, e: Event) -> Result<()> {
        self.check_event(op, e)
    }

    /// `cuStreamWaitEvent` for an event of device `owner` (checked live by its owner).
    pub fn stream_wait_unified(&self, s: StreamKind, owner: u64, e: Event) {
        order::wait(self.id, s, owner, e.0);
    }

    /// The host waited for `e` (`op`: `cuEventQuery` or `cuEventSynchronize`); events of
    /// these devices complete at issue, so the wait always ends at once.
    pub fn event_synchronize(&self, op: &str, e: Event) -> Result<()> {
        self.check_event(op, e)?;
        order::event_synchronized(self.id, e.0);
        Ok(())
    }

    /// `cuEventDestroy`.
    pub fn event_destroy(&self, e: Event) -> Result<()> {
        if self
            .events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&e.0)
        {
            order::destroyed(self.id, e.0);
            Ok(())
        } else {
            Err(Error::Device {
                op: "cuEventDestroy".into(),
                detail: format!("CUDA_ERROR_INVALID_HANDLE: event {} is not live", e.0),
            })
        }
    }

    /// The allocator tells which buffer a pointer argument reaches into.
    pub fn note_buffer(&self, p: DevPtr, bytes: u64) {
        order::buffer(self.id, p.0, bytes);
    }

    /// Host bytes currently registered with [`Checks::host_register`].
    pub fn registered_host_bytes(&self) -> usize {
        let r = self.registered.lock().unwrap_or_else(|e| e.into_inner());
        r.values().map(|&(_, _, len)| len).sum()
    }

    /// `cuMemHostRegister`'s checks and record: the memory itself is not touched.
    pub fn host_register(&self, ptr: *mut u8, len: usize) -> Result<()> {
        let refuse = |why: &str| Error::Device {
            op: "cuMemHostRegister".into(),
            detail: why.into(),
        };
        if ptr.is_null() || len == 0 {
            return Err(refuse(
                "CUDA_ERROR_INVALID_VALUE: null pointer or zero bytes",
            ));
        }
        let (first, end) = (
            ptr as usize / HOST_PAGE,
            (ptr as usize + len).div_ceil(HOST_PAGE),
        );
        let mut r = self.registered.lock().unwrap_or_else(|e| e.into_inner());
        if r.values().any(|&(f, e, _)| first < e && f < end) {
            return Err(refuse(
                "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED: part of the range is registered",
            ));
        }
        r.insert(ptr as usize, (first, end, len));
        Ok(())
    }

    /// `cuMemHostUnregister`.
    pub fn host_unregister(&self, ptr: *mut u8) -> Result<()> {
        let mut r = self.registered.lock().unwrap_or_else(|e| e.into_inner());
        match r.remove(&(ptr as usize)) {
            Some(_) => Ok(()),
            None => Err(Error::Device {
                op: "cuMemHostUnregister".into(),
                detail: "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED: no registered range starts there"
                    .into(),
            }),
        }
    }
}

impl Drop for Checks {
    fn drop(&mut self) {
        order::closed(self.id);
    }
}
