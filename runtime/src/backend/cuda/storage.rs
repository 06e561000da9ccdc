//! Device memory as the tensor types see it: [`CudaBuf`] (owned elements of one dtype, freed
//! back to the caching allocator on drop), the views that borrow it, and [`CudaIds`] (token
//! ids with the host copy the backend plans deterministic scatters from). The engine's
//! buffer operations on device storage (casts, accumulation, overflow checks, norms) run here
//! as kernels on the compute stream.

use std::marker::PhantomData;
use std::ops::Range;
use std::sync::Arc;

use half::{bf16, f16};

use super::device::{CudaDevice, STREAM};
use super::driver::{DevPtr, DeviceBuffer};
use super::launch::Args;
use crate::tensor::{BufMut, BufRef, DType, FlatBuf};
use crate::{Error, Result};

/// A kernel's name for an element type: `base` with `_f32`, `_bf16` or `_f16`.
macro_rules! by_dtype {
    ($base:literal, $d:expr) => {
        match $d {
            $crate::tensor::DType::F32 => concat!($base, "_f32"),
            $crate::tensor::DType::Bf16 => concat!($base, "_bf16"),
            $crate::tensor::DType::F16 => concat!($base, "_f16"),
        }
    };
}
pub(crate) use by_dtype;

/// The names of a kernel's variants: `base` followed by each suffix.
macro_rules! variant_names {
    ($base:literal: $($suffix:literal),+) => {
        [$(concat!($base, $suffix)),+]
    };
}
pub(crate) use variant_names;

/// Owned device elements of one dtype.
#[derive(Debug)]
pub struct CudaBuf {
    buf: DeviceBuffer,
    len: usize,
    dtype: DType,
    dev: Arc<CudaDevice>,
}

/// Borrowed device elements.
#[derive(Debug, Clone, Copy)]
pub struct CudaView<'a> {
    ptr: DevPtr,
    len: usize,
    dtype: DType,
    dev: &'a Arc<CudaDevice>,
}

/// Mutably borrowed device elements.
#[derive(Debug)]
pub struct CudaViewMut<'a> {
    ptr: DevPtr,
    len: usize,
    dtype: DType,
    dev: &'a Arc<CudaDevice>,
    _exclusive: PhantomData<&'a mut ()>,
}

/// Token ids or targets in device memory (`int`), with their host values.
#[derive(Debug)]
pub struct CudaIds {
    buf: DeviceBuffer,
    host: Vec<i32>,
    dev: Arc<CudaDevice>,
}

/// Checks that a copy's two sides have the same length and dtype.
fn same_shape(op: &'static str, want: (usize, DType), got: (usize, DType)) -> Result<()> {
    if want == got {
        return Ok(());
    }
    Err(Error::Shape {
        op,
        expected: format!("{} {:?} elements", want.0, want.1),
        got: format!("{} {:?}", got.0, got.1),
    })
}

fn out_of_range(op: &'static str, r: &Range<usize>, len: usize) -> Error {
    Error::Shape {
        op,
        expected: format!("a range within {len} elements"),
        got: format!("{r:?}"),
    }
}

/// What the buffer and its views share: their shape; and the views, their address, their
/// device and their sub-ranges.
macro_rules! shape {
    ($($t:ty),*) => {$(
        impl $t {
            /// Elements.
            pub fn len(&self) -> usize {
                self.len
            }

            /// Whether empty.
            pub fn is_empty(&self) -> bool {
                self.len == 0
            }

            /// Element type.
            pub fn dtype(&self) -> DType {
                self.dtype
            }
        }
    )*};
    (views $($v:ident),*) => {$(
        impl<'a> $v<'a> {
            /// The device address of the first element.
            pub(crate) fn ptr(&self) -> DevPtr {
                self.ptr
            }

            /// The device.
            pub(crate) fn device(&self) -> &'a Arc<CudaDevice> {
                self.dev
            }

            /// Elements `range`.
            pub fn range(self, range: Range<usize>) -> Result<$v<'a>> {
                if range.start > range.end || range.end > self.len {
                    return Err(out_of_range("device view range", &range, self.len));
                }
                Ok($v {
                    ptr: self.ptr.offset((range.start * self.dtype.size()) as u64),
                    len: range.len(),
                    ..self
                })
            }
        }
    )*};
}
shape!(CudaBuf, CudaView<'_>, CudaViewMut<'_>);
shape!(views CudaView, CudaViewMut);

impl CudaBuf {
    /// `len` uninitialised elements of `dtype` on `dev`.
    pub(crate) fn uninit(dev: &Arc<CudaDevice>, dtype: DType, len: usize) -> Result<Self> {
        Ok(CudaBuf {
            buf: dev.alloc(len * dtype.size())?,
            len,
            dtype,
            dev: dev.clone(),
        })
    }

    /// `len` zeros of `dtype` on `dev`.
    pub(crate) fn zeros(dev: &Arc<CudaDevice>, dtype: DType, len: usize) -> Result<Self> {
        let mut b = Self::uninit(dev, dtype, len)?;
        b.fill_zero()?;
        Ok(b)
    }

    /// A copy of host elements on `dev` (an explicit upload).
    pub(crate) fn upload(dev: &Arc<CudaDevice>, src: BufRef<'_>) -> Result<Self> {
        let b = Self::uninit(dev, src.dtype(), src.len())?;
        if !src.is_empty() {
            b.buf.copy_from_host(src.bytes(), STREAM)?;
        }
        Ok(b)
    }

    /// The device it lives on.
    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.dev
    }

    /// The whole buffer, read-only.
    pub fn view(&self) -> CudaView<'_> {
        CudaView {
            ptr: self.buf.ptr(),
            len: self.len,
            dtype: self.dtype,
            dev: &self.dev,
        }
    }

    /// Marks the buffer as used by work queued on stream `s`: its block is reused, once the
    /// buffer is dropped, only after that work has finished.
    pub fn record_stream(&mut self, s: crate::backend::Stream) {
        self.buf.record_stream(super::stream::kind(s));
    }

    /// The whole buffer, mutable.
    pub fn view_mut(&mut self) -> CudaViewMut<'_> {
        CudaViewMut {
            ptr: self.buf.ptr(),
            len: self.len,
            dtype: self.dtype,
            dev: &self.dev,
            _exclusive: PhantomData,
        }
    }

    /// A copy in host memory (an explicit download; waits for the device).
    pub fn to_host(&self) -> Result<FlatBuf> {
        self.view().to_host()
    }

    /// A copy on the same device.
    pub fn try_clone(&self) -> Result<CudaBuf> {
        let mut c = Self::uninit(&self.dev, self.dtype, self.len)?;
        self.view().copy_to(c.view_mut())?;
        Ok(c)
    }

    /// `len` zeros of `dtype` on the same device.
    pub fn zeros_like(&self, dtype: DType, len: usize) -> Result<CudaBuf> {
        Self::zeros(&self.dev, dtype, len)
    }

    /// A new buffer on the same device holding `host`'s values (an explicit upload).
    pub fn upload_like(&self, host: &FlatBuf) -> Result<CudaBuf> {
        Self::upload(&self.dev, host.as_ref())
    }

    /// Writes host elements of this buffer's dtype at `offset` (an explicit upload).
    pub fn write_host(&mut self, offset: usize, src: BufRef<'_>) -> Result<()> {
        let v = self.view_mut().range(offset..offset + src.len())?;
        v.upload(src)
    }

    /// Writes host f32 values at `offset`, rounded to the dtype on the host (the same
    /// round-to-nearest-even as the device's casts) and uploaded.
    pub fn write_f32(&mut self, offset: usize, src: &[f32]) -> Result<()> {
        match self.dtype {
            DType::F32 => self.write_host(offset, BufRef::F32(src)),
            DType::Bf16 => {
                let h: Vec<bf16> = src.iter().map(|&x| bf16::from_f32(x)).collect();
                self.write_host(offset, BufRef::Bf16(&h))
            }
            DType::F16 => {
                let h: Vec<f16> = src.iter().map(|&x| f16::from_f32(x)).collect();
                self.write_host(offset, BufRef::F16(&h))
            }
        }
    }

    /// [`CudaBuf::write_f32`] of `len` values a size-only device never reads: the same copy,
    /// issued from zero pages the allocator maps without writing (no value generated,
    /// rounded or touched: a size-only run's initial values cost nothing).
    pub(crate) fn write_unvalued(&mut self, offset: usize, len: usize) -> Result<()> {
        let zeros = vec![0u8; len * self.dtype.size()];
        self.view_mut()
            .range(offset..offset + len)?
            .upload_bytes(&zeros)
    }

    /// Reads values at `offset` into host f32 (an explicit download).
    pub fn read_f32(&self, offset: usize, dst: &mut [f32]) -> Result<()> {
        let host = self.view().range(offset..offset + dst.len())?.to_host()?;
        host.load_f32(0, dst);
        Ok(())
    }

    /// `dst = self` converted to `dst`'s dtype (round to nearest even when narrowing).
    pub fn cast_into(&self, dst: &mut CudaBuf) -> Result<()> {
        if self.dtype == dst.dtype {
            return self.view().copy_to(dst.view_mut());
        }
        let name = match (self.dtype, dst.dtype) {
            (DType::F32, DType::Bf16) => "cast_f32_to_bf16",
            (DType::F32, DType::F16) => "cast_f32_to_f16",
            (DType::Bf16, DType::F32) => "cast_bf16_to_f32",
            (DType::F16, DType::F32) => "cast_f16_to_f32",
            (DType::Bf16, DType::F16) => "cast_bf16_to_f16",
            (DType::F16, DType::Bf16) => "cast_f16_to_bf16",
            _ => unreachable!("equal dtypes return above"),
        };
        let mut args = Args::new()
            .ptr(self.buf.ptr())
            .ptr(dst.buf.ptr())
            .len(self.len);
        self.dev
            .launch(name, self.dev.grid_for(self.len), &mut args)
    }

    /// `self[offset..offset + n] += src[..n]`, added in f32 and rounded once (the elementwise
    /// `add_assign` kernel).
    pub fn accumulate(&mut self, offset: usize, src: &CudaBuf, n: usize) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let dst = self.view_mut().range(offset..offset + n)?;
        let mut args = Args::new().ptr(dst.ptr).ptr(src.buf.ptr()).len(n);
        let name = by_dtype!("add_assign", self.dtype);
        self.dev.launch(name, self.dev.grid_for(n), &mut args)
    }

    /// Zeroes every element.
    pub fn fill_zero(&mut self) -> Result<()> {
        if self.len == 0 {
            return Ok(());
        }
        let bytes = self.len * self.dtype.size();
        self.dev.driver().memset_zero(self.buf.ptr(), bytes, STREAM)
    }

    /// Whether `range` holds Inf or NaN (the flag is read back: a synchronisation).
    pub fn has_non_finite(&self, range: Range<usize>) -> Result<bool> {
        let v = self.view().range(range)?;
        if v.len == 0 {
            return Ok(false);
        }
        let flag = self.dev.alloc(4)?;
        self.dev.driver().memset_zero(flag.ptr(), 4, STREAM)?;
        // unscale with s = 1 only checks: it writes nothing.
        let mut args = Args::new().ptr(v.ptr).len(v.len).f32(1.0).ptr(flag.ptr());
        let name = by_dtype!("unscale", self.dtype);
        self.dev.launch(name, self.dev.grid_for(v.len), &mut args)?;
        let mut bits = [0u8; 4];
        flag.copy_to_host(&mut bits, STREAM)?;
        Ok(i32::from_le_bytes(bits) != 0)
    }

    /// Sum of squares of `range` in f64 (partial sums per block in a fixed order set by the
    /// length alone, then summed in block order; read back).
    pub fn sum_squares(&self, range: Range<usize>) -> Result<f64> {
        let v = self.view().range(range)?;
        if v.len == 0 {
            return Ok(0.0);
        }
        let out = self.dev.alloc(8)?;
        super::status::sum_squares_into(&self.dev, v, out.ptr())?;
        let mut bytes = [0u8; 8];
        out.copy_to_host(&mut bytes, STREAM)?;
        Ok(f64::from_le_bytes(bytes))
    }
}

/// A device view as plain integers, so that a rank of the local communicator can announce it
/// in its descriptor and its peers can rebuild it during the collective's data phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RawView {
    /// Device address of the first element.
    pub ptr: u64,
    /// Elements.
    pub len: usize,
    /// Element type.
    pub dtype: DType,
    /// Address of the `Arc<CudaDevice>` the view borrows (never 0).
    pub dev: usize,
}

impl<'a> CudaView<'a> {
    /// Whether this view's device holds no bytes (`DeviceInfo::sizes_only`).
    pub fn sizes_only(&self) -> bool {
        self.device().info().sizes_only
    }

    /// This view as plain integers (see [`RawView`]).
    pub(crate) fn raw(&self) -> RawView {
        RawView {
            ptr: self.ptr.0,
            len: self.len,
            dtype: self.dtype,
            dev: self.dev as *const Arc<CudaDevice> as usize,
        }
    }

    /// The view `raw` describes.
    ///
    /// # Safety
    /// `raw` must come from [`CudaView::raw`] or [`CudaViewMut::raw`] of a view that lives
    /// for `'a`, and nothing may write its elements meanwhile (the communicator's barriers
    /// guarantee both for the length of a collective).
    pub(crate) unsafe fn from_raw(raw: RawView) -> CudaView<'a> {
        CudaView {
            ptr: DevPtr(raw.ptr),
            len: raw.len,
            dtype: raw.dtype,
            // SAFETY: the caller guarantees the borrowed `Arc` outlives `'a`.
            dev: unsafe { &*(raw.dev as *const Arc<CudaDevice>) },
        }
    }

    /// A copy in host memory (an explicit download; waits for the device).
    pub fn to_host(&self) -> Result<FlatBuf> {
        let mut host = match self.dtype {
            DType::F32 => FlatBuf::F32(vec![0.0; self.len]),
            DType::Bf16 => FlatBuf::Bf16(vec![bf16::ZERO; self.len]),
            DType::F16 => FlatBuf::F16(vec![f16::ZERO; self.len]),
        };
        self.download(host.as_mut())?;
        Ok(host)
    }

    /// A host copy in the device's staging memory (page-locked where the driver allows);
    /// hand it back with [`CudaView::unstage`].
    pub fn stage(&self) -> Result<FlatBuf> {
        let mut b = self.dev.take_staging(self.dtype, self.len);
        match self.download(b.as_mut()) {
            Ok(()) => Ok(b),
            Err(e) => {
                self.dev.give_staging(b);
                Err(e)
            }
        }
    }

    /// Staging memory shaped as this view, contents unspecified (for a host routine that
    /// overwrites every element before it is uploaded); hand it back with
    /// [`CudaView::unstage`].
    pub fn staging(&self) -> FlatBuf {
        self.dev.take_staging(self.dtype, self.len)
    }

    /// Takes back a buffer from [`CudaView::stage`] or [`CudaView::staging`].
    pub fn unstage(&self, b: FlatBuf) {
        self.dev.give_staging(b)
    }

    /// Copies into host elements of the same dtype and length (an explicit download into
    /// memory the caller reuses; waits for the device).
    pub fn download(&self, dst: BufMut<'_>) -> Result<()> {
        same_shape(
            "device download",
            (self.len, self.dtype),
            (dst.len(), dst.dtype()),
        )?;
        if self.len == 0 {
            return Ok(());
        }
        self.dev
            .driver()
            .copy_dtoh(self.ptr, dst.bytes_mut(), STREAM)
    }

    /// These elements as a mutable view: only for a caller holding the exclusive right to
    /// write them (a mutable view it splits or reborrows, a rank given a disjoint range).
    fn exclusive(self) -> CudaViewMut<'a> {
        CudaViewMut {
            ptr: self.ptr,
            len: self.len,
            dtype: self.dtype,
            dev: self.dev,
            _exclusive: PhantomData,
        }
    }

    /// Copies into an equal-length view of the same dtype on the same device.
    pub fn copy_to(self, dst: CudaViewMut<'_>) -> Result<()> {
        same_shape("device copy", (self.len, self.dtype), (dst.len, dst.dtype))?;
        if !Arc::ptr_eq(self.dev, dst.dev) {
            return Err(Error::Invalid(
                "device copy between two devices: copy through the host explicitly".into(),
            ));
        }
        if self.len == 0 {
            return Ok(());
        }
        let bytes = self.len * self.dtype.size();
        self.dev
            .driver()
            .copy_dtod(self.ptr, dst.ptr, bytes, STREAM)
    }
}

impl<'a> CudaViewMut<'a> {
    /// The mutable view `raw` describes.
    ///
    /// # Safety
    /// As [`CudaView::from_raw`], and the caller must be the only one writing the elements it
    /// touches through the result (the local communicator gives each rank disjoint ranges).
    pub(crate) unsafe fn from_raw(raw: RawView) -> CudaViewMut<'a> {
        // SAFETY: the caller's contract, which includes the exclusive right to write.
        unsafe { CudaView::from_raw(raw) }.exclusive()
    }

    /// The same elements, read-only, for as long as this view's borrow.
    fn shared(&self) -> CudaView<'a> {
        CudaView {
            ptr: self.ptr,
            len: self.len,
            dtype: self.dtype,
            dev: self.dev,
        }
    }

    /// A shorter-lived borrow.
    pub fn reborrow(&mut self) -> CudaViewMut<'_> {
        self.shared().exclusive()
    }

    /// Read-only.
    pub fn as_view(&self) -> CudaView<'_> {
        self.shared()
    }

    /// Two disjoint halves (the caller checked `mid <= len`).
    pub fn split_at(self, mid: usize) -> (CudaViewMut<'a>, CudaViewMut<'a>) {
        let mid = mid.min(self.len);
        let tail = self.ptr.offset((mid * self.dtype.size()) as u64);
        (
            CudaViewMut {
                len: mid,
                ..self.shared().exclusive()
            },
            CudaViewMut {
                ptr: tail,
                len: self.len - mid,
                ..self
            },
        )
    }

    /// Overwrites the elements with host values of the same dtype and length (an explicit
    /// upload).
    pub fn upload(self, src: BufRef<'_>) -> Result<()> {
        same_shape(
            "device upload",
            (self.len, self.dtype),
            (src.len(), src.dtype()),
        )?;
        self.upload_bytes(src.bytes())
    }

    /// Copies `bytes`, as many as the view holds, into it.
    fn upload_bytes(self, bytes: &[u8]) -> Result<()> {
        if self.len == 0 {
            return Ok(());
        }
        self.dev.driver().copy_htod(bytes, self.ptr, STREAM)
    }
}

impl CudaIds {
    /// `host` copied to `dev`.
    pub(crate) fn upload(dev: &Arc<CudaDevice>, host: &[i32]) -> Result<Self> {
        let buf = match host.is_empty() {
            true => dev.alloc(0)?,
            false => dev.upload_async(bytemuck::cast_slice(host))?,
        };
        Ok(CudaIds {
            buf,
            host: host.to_vec(),
            dev: dev.clone(),
        })
    }

    /// The device address of the first id.
    pub(crate) fn ptr(&self) -> DevPtr {
        self.buf.ptr()
    }

    /// The device.
    pub(crate) fn device(&self) -> &Arc<CudaDevice> {
        &self.dev
    }

    /// The host values (for validation and planning without a device round trip).
    pub(crate) fn host(&self) -> &[i32] {
        &self.host
    }

    /// Indices held.
    pub fn len(&self) -> usize {
        self.host.len()
    }

    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.host.is_empty()
    }
}
