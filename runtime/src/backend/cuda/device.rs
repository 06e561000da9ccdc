//! One opened GPU (or its CPU emulator) as the backend and its buffers share it: the driver,
//! the caching allocator every buffer comes from, and the kernel handles looked up once.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use super::driver::{
    Allocator, DeviceBuffer, DeviceInfo, Driver, Kernel, LaunchConfig, Observed, StreamKind,
};
use super::launch::Args;
use super::pinned::PinnedPool;
use super::upload::UploadRing;
use crate::tensor::{DType, FlatBuf};
use crate::{Error, Result};

/// The stream every operation of the backend runs on: one compute stream keeps the order of
/// kernels, GEMMs and the copies between them without events.
pub(crate) const STREAM: StreamKind = StreamKind::Compute;

/// A RoPE table's identity: sequence length, head width and `Rope::key`.
type RopeKey = (usize, usize, [u32; 6]);

/// Threads per block for grid-stride kernels.
pub(crate) const BLOCK: u32 = 256;

/// A warp per row, `BLOCK / 32` rows per block.
pub(crate) fn warp_rows(rows: usize) -> LaunchConfig {
    let warps = (BLOCK / 32) as usize;
    LaunchConfig::linear(
        rows.div_ceil(warps).clamp(1, i32::MAX as usize) as u32,
        BLOCK,
    )
}

/// An opened device.
#[derive(Debug)]
pub struct CudaDevice {
    /// `observed` as the driver everything here calls.
    driver: Arc<dyn Driver>,
    observed: Arc<Observed>,
    alloc: Arc<Allocator>,
    kernels: Mutex<HashMap<&'static str, Kernel>>,
    /// RoPE cos/sin tables by (seq, head_dim, `Rope::key`), built once (the CPU rebuilds its
    /// own per call; uploading one per call would cost a copy each time).
    rope_tables: Mutex<HashMap<RopeKey, Arc<DeviceBuffer>>>,
    /// Page-locked host buffers for staging views through host memory.
    pinned: PinnedPool,
    /// Small uploads the host does not wait for.
    uploads: UploadRing,
}

impl CudaDevice {
    /// A device over `driver`, its buffers allocated by a caching allocator (with `limit` on
    /// live bytes, if any). Every call to the driver, the allocator's and the page-locked
    /// pool's included, goes through one [`Observed`] layer that counts it.
    pub fn new(driver: Arc<dyn Driver>, limit: Option<u64>) -> Arc<Self> {
        let observed = Observed::new(driver);
        let driver: Arc<dyn Driver> = observed.clone();
        let alloc = Allocator::with_limit(driver.clone(), limit);
        let pinned = PinnedPool::new(driver.clone());
        let uploads = UploadRing::new(driver.clone());
        Arc::new(CudaDevice {
            driver,
            observed,
            alloc,
            pinned,
            uploads,
            kernels: Mutex::new(HashMap::new()),
            rope_tables: Mutex::new(HashMap::new()),
        })
    }

    /// The driver.
    pub fn driver(&self) -> &dyn Driver {
        &*self.driver
    }

    /// The driver's counters and issue trace.
    pub fn observed(&self) -> &Observed {
        &self.observed
    }

    /// The allocator (live and peak bytes for the ledger; the device-memory limit).
    pub fn allocator(&self) -> &Arc<Allocator> {
        &self.alloc
    }

    /// Waits until the work queued on the compute stream has finished (NCCL's fence before a
    /// collective on its own stream).
    pub(crate) fn synchronize(&self) -> Result<()> {
        self.driver.synchronize(STREAM)
    }

    /// A host buffer of `len` elements of `dtype` (unspecified contents) for staging a view,
    /// page-locked when the driver allows; hand it back with [`CudaDevice::give_staging`].
    pub(crate) fn take_staging(&self, dtype: DType, len: usize) -> FlatBuf {
        self.pinned.take(dtype, len)
    }

    /// Host bytes the device page-locked for its own copies: the staging pool's registered
    /// buffers and the small-upload ring.
    pub fn page_locked_bytes(&self) -> u64 {
        self.pinned.registered_bytes() + self.uploads.page_locked_bytes()
    }

    /// Takes back a buffer from [`CudaDevice::take_staging`] for the next step.
    pub(crate) fn give_staging(&self, b: FlatBuf) {
        self.pinned.give(b)
    }

    /// What the device is.
    pub fn info(&self) -> &DeviceInfo {
        self.driver.info()
    }

    /// `bytes` of uninitialised device memory.
    pub(crate) fn alloc(&self, bytes: usize) -> Result<DeviceBuffer> {
        self.alloc.alloc(bytes)
    }

    /// A new device buffer holding `src`, copied on the compute stream without the host
    /// waiting for the device (small descriptors, scalars, ids: `upload.rs`).
    pub(crate) fn upload_async(&self, src: &[u8]) -> Result<DeviceBuffer> {
        let b = self.alloc(src.len())?;
        self.uploads.upload(src, b.ptr(), STREAM)?;
        Ok(b)
    }

    /// A grid for a grid-stride kernel over `n` elements: enough blocks to cover them, at most
    /// eight per multiprocessor (the kernels stride over the rest).
    pub(crate) fn grid_for(&self, n: usize) -> LaunchConfig {
        let sms = self.info().multiprocessors.max(1);
        LaunchConfig::for_elements(n as u64, BLOCK, 8 * sms)
    }

    fn kernel(&self, name: &'static str) -> Result<Kernel> {
        let mut k = self.kernels.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(&h) = k.get(name) {
            return Ok(h);
        }
        let h = self.driver.kernel(name)?;
        k.insert(name, h);
        Ok(h)
    }

    /// Launches kernel `name` on the compute stream with `args`, after checking them against
    /// the kernel's declared parameters: a mismatch is an error naming the kernel and the
    /// parameter, never a kernel reading the wrong bytes.
    pub(crate) fn launch(
        &self,
        name: &'static str,
        cfg: LaunchConfig,
        args: &mut Args,
    ) -> Result<()> {
        self.launch_on(name, cfg, args, STREAM)
    }

    /// As [`CudaDevice::launch`], on stream `s` (the local communicator's reductions).
    pub(crate) fn launch_on(
        &self,
        name: &'static str,
        cfg: LaunchConfig,
        args: &mut Args,
        s: StreamKind,
    ) -> Result<()> {
        super::kernels::params::check_launch(name, args.kinds()).map_err(|detail| {
            Error::Device {
                op: "cuLaunchKernel (arguments)".into(),
                detail,
            }
        })?;
        let k = self.kernel(name)?;
        let mut params: Vec<*mut c_void> = args.pointers();
        // SAFETY: `args` holds one value per parameter, of the parameter's type, and its device
        // pointers come from live buffers whose lengths the callers checked against the shape.
        unsafe { self.driver.launch(k, &cfg, &mut params, s) }
    }

    /// The RoPE table for `(seq, head_dim, rope parameters)`, uploaded on first use.
    pub(crate) fn rope_table(
        &self,
        key: RopeKey,
        build: impl FnOnce() -> Vec<f32>,
    ) -> Result<Arc<DeviceBuffer>> {
        let mut t = self.rope_tables.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(b) = t.get(&key) {
            return Ok(b.clone());
        }
        let host = build();
        let buf = self.alloc(host.len() * 4)?;
        buf.copy_from_host(bytemuck::cast_slice(&host), STREAM)?;
        let buf = Arc::new(buf);
        t.insert(key, buf.clone());
        Ok(buf)
    }
}
