//! The CUDA backend: every operation family on device views, through cuBLASLt GEMMs and our
//! NVRTC kernels, on one compute stream. Activations are in the dtype the config's precision
//! names (bf16, f16 or f32), parameters are read as stored, parameter gradients are f32.

use std::sync::Arc;

use super::device::CudaDevice;
use super::storage::{CudaBuf, CudaIds, CudaView, CudaViewMut};
use crate::backend::{Backend, CpuBackend, MemoryOps, MetaBackend};
use crate::tensor::meta::MetaBuf;
use crate::tensor::{BufRef, DType, FlatBuf, IdBuf, Ids, Storage, View, ViewMut};
use crate::{Error, Result};

/// The CUDA backend over one device.
#[derive(Debug)]
pub struct CudaBackend {
    pub(crate) dev: Arc<CudaDevice>,
    act: DType,
    /// At most this many rows per chunk of the loss head (below the memory model's).
    head_chunk_cap: Option<usize>,
    /// Whether the GELU gradient rides on cuBLASLt's DGELU_BGRAD epilogue rather than
    /// ferrozero's own kernels after a plain product (see [`CudaBackend::with_fused_dgelu`]).
    fused_dgelu: bool,
}

impl CudaBackend {
    /// A backend on `dev` computing activations in `act`.
    pub fn new(dev: Arc<CudaDevice>, act: DType) -> Self {
        CudaBackend {
            dev,
            act,
            head_chunk_cap: None,
            fused_dgelu: std::env::var("FERROZERO_FUSE_DGELU").is_ok_and(|v| v == "1"),
        }
    }

    /// This backend on the same device with the loss head computing at most `rows` rows of
    /// logits at a time (at least one), fewer than the memory model's chunk: so that tests
    /// run several chunks, and a ragged last one, with small vocabularies.
    pub fn with_head_chunk_rows(&self, rows: usize) -> Self {
        CudaBackend {
            head_chunk_cap: Some(rows.max(1)),
            ..self.same()
        }
    }

    /// This backend on the same device with the MLP's GELU gradient and bias gradient in
    /// cuBLASLt's DGELU_BGRAD epilogue (`on`) or in ferrozero's GELU-gradient and column-sum
    /// kernels after a plain product (the default; `FERROZERO_FUSE_DGELU=1` turns the
    /// epilogue on for a process). The default is what measured faster: on an H200 with
    /// cuBLASLt 13.1 the epilogue runs as a pass of its own over an f32 copy of the product
    /// (0.33 ms per GPT-2 layer), and GPT-2 124M trained 4% faster without it.
    pub fn with_fused_dgelu(&self, on: bool) -> Self {
        CudaBackend {
            fused_dgelu: on,
            ..self.same()
        }
    }

    /// A second handle on this backend's device with the same settings.
    fn same(&self) -> Self {
        CudaBackend {
            dev: self.dev.clone(),
            act: self.act,
            head_chunk_cap: self.head_chunk_cap,
            fused_dgelu: self.fused_dgelu,
        }
    }

    /// Whether [`CudaBackend::with_fused_dgelu`] turned cuBLASLt's GELU-gradient epilogue on.
    pub(crate) fn fused_dgelu(&self) -> bool {
        self.fused_dgelu
    }

    /// The cap [`CudaBackend::with_head_chunk_rows`] set.
    pub(crate) fn head_chunk_cap(&self) -> Option<usize> {
        self.head_chunk_cap
    }

    /// The device.
    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.dev
    }

    /// Whether the device holds no bytes (`DeviceInfo::sizes_only`): its host side then holds
    /// none either, and the values it would read back are the size-only backend's.
    pub(crate) fn sizes_only(&self) -> bool {
        self.dev.info().sizes_only
    }
}

impl CudaBackend {
    /// A size-only host buffer uploaded: the device buffer an upload of its length allocates,
    /// no copy (there are no bytes). Only a size-only device's host holds such buffers.
    fn upload_meta(&self, m: MetaBuf) -> Result<Storage> {
        if !self.sizes_only() {
            return Err(crate::tensor::meta::mixed_meta(
                "upload to a device that holds bytes",
            ));
        }
        Ok(Storage::Cuda(CudaBuf::uninit(&self.dev, m.dtype, m.len)?))
    }
}

/// The error for a view this backend cannot use (host memory, or another device's).
pub(crate) fn foreign(op: &'static str, what: &str) -> Error {
    Error::Invalid(format!(
        "{op}: {what} is not memory of this CUDA device; the CUDA backend computes on its own \
         device views (upload host values first)"
    ))
}

impl CudaBackend {
    /// The device elements of an input view (of this device).
    pub(crate) fn dev_in<'a>(
        &self,
        op: &'static str,
        what: &str,
        v: View<'a>,
    ) -> Result<CudaView<'a>> {
        match v {
            View::Cuda(c) if Arc::ptr_eq(c.device(), &self.dev) => Ok(c),
            _ => Err(foreign(op, what)),
        }
    }

    /// The device elements of an output view (of this device).
    pub(crate) fn dev_out<'a>(
        &self,
        op: &'static str,
        what: &str,
        v: ViewMut<'a>,
    ) -> Result<CudaViewMut<'a>> {
        match v {
            ViewMut::Cuda(c) if Arc::ptr_eq(c.device(), &self.dev) => Ok(c),
            _ => Err(foreign(op, what)),
        }
    }

    /// The device ids of an index view.
    pub(crate) fn dev_ids<'a>(&self, op: &'static str, ids: Ids<'a>) -> Result<&'a CudaIds> {
        match ids {
            Ids::Cuda(c) if Arc::ptr_eq(c.device(), &self.dev) => Ok(c),
            _ => Err(foreign(op, "the indices")),
        }
    }
}

pub(crate) use crate::backend::check::expect_len;

/// Fails unless every view has the dtype `want`.
pub(crate) fn expect_dtype(op: &'static str, want: DType, got: &[(&str, DType)]) -> Result<()> {
    match got.iter().find(|(_, d)| *d != want) {
        None => Ok(()),
        Some((what, d)) => Err(Error::Invalid(format!(
            "{op}: {what} is {d:?}, expected {want:?}"
        ))),
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> String {
        let info = self.dev.info();
        if info.emulated {
            "cuda:emulated".into()
        } else if info.sizes_only {
            format!("cuda:size-only ({})", info.name)
        } else {
            format!("cuda:{} ({})", info.ordinal, info.name)
        }
    }
}

impl MemoryOps for CudaBackend {
    fn act_dtype(&self) -> DType {
        self.act
    }

    fn zeros(&self, dtype: DType, len: usize) -> Result<Storage> {
        Ok(Storage::Cuda(CudaBuf::zeros(&self.dev, dtype, len)?))
    }

    fn upload(&self, src: BufRef<'_>) -> Result<Storage> {
        Ok(Storage::Cuda(CudaBuf::upload(&self.dev, src)?))
    }

    fn upload_ids(&self, ids: &[i32]) -> Result<IdBuf> {
        Ok(IdBuf::Cuda(CudaIds::upload(&self.dev, ids)?))
    }

    fn copy(&self, src: View<'_>) -> Result<Storage> {
        let src = self.dev_in("copy", "source", src)?;
        let mut out = CudaBuf::uninit(&self.dev, src.dtype(), src.len())?;
        src.copy_to(out.view_mut())?;
        Ok(Storage::Cuda(out))
    }

    fn param_dtype(&self, storage: DType) -> DType {
        self.memory_model().param_dtype(storage)
    }

    fn memory_model(&self) -> crate::backend::MemoryModel {
        crate::backend::MemoryModel::cuda(self.act_dtype())
    }

    fn buffer(&self, dtype: DType, len: usize) -> Result<Storage> {
        self.zeros(dtype, len)
    }

    fn buffer_uninit(&self, dtype: DType, len: usize) -> Result<Storage> {
        Ok(Storage::Cuda(CudaBuf::uninit(&self.dev, dtype, len)?))
    }

    fn recycle(&self, buf: Storage) {
        // Dropping returns the block to the caching allocator.
        drop(buf);
    }

    fn adopt(&self, host: FlatBuf) -> Result<Storage> {
        self.upload(host.as_ref())
    }

    fn adopt_storage(&self, s: Storage) -> Result<Storage> {
        match s {
            Storage::Host(host) => self.adopt(host),
            // A size-only host buffer is uploaded as a host one would be, its bytes aside.
            Storage::Meta(m) => self.upload_meta(m),
            device => Ok(device),
        }
    }

    // The host beside the device is the host backend's: size-only beside a size-only device.
    fn host_zeros(&self, dtype: DType, len: usize) -> Result<Storage> {
        self.host_backend().host_zeros(dtype, len)
    }

    fn host_backend(&self) -> &dyn Backend {
        match self.sizes_only() {
            true => &MetaBackend,
            false => &CpuBackend,
        }
    }

    fn nvme_store(
        &self,
        dir: &std::path::Path,
        settings: &ferrozero_offload::store::AioSettings,
    ) -> Result<ferrozero_offload::store::NvmeStore> {
        self.host_backend().nvme_store(dir, settings)
    }

    fn host_pool(
        &self,
        count: usize,
        size: usize,
        pinning: ferrozero_offload::pool::Pinning,
    ) -> Result<ferrozero_offload::pool::BufferPool> {
        self.host_backend().host_pool(count, size, pinning)
    }

    fn pin_host(&self, b: &mut FlatBuf) -> Option<crate::tensor::in_flight::HostPin> {
        super::pinned::pin(&self.dev, b)
    }

    fn pin_meta_host(&self, b: &MetaBuf) -> Option<crate::tensor::in_flight::HostPin> {
        super::pinned::pin_meta(&self.dev, b)
    }

    fn set_memory_limit(&self, limit: Option<u64>) -> Result<()> {
        self.dev.allocator().set_limit(limit);
        Ok(())
    }

    fn activity(&self) -> Option<crate::backend::DeviceActivity> {
        Some(self.dev.observed().activity())
    }

    fn page_locked_bytes(&self) -> u64 {
        self.dev.page_locked_bytes()
    }

    fn memory_stats(&self) -> Option<crate::backend::DeviceMemory> {
        let a = self.dev.allocator();
        let s = a.stats();
        Some(crate::backend::DeviceMemory {
            live: s.live,
            peak: s.peak_live,
            reserved: s.reserved,
            limit: a.limit(),
        })
    }
}
