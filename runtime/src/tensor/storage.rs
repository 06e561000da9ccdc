//! Owned elements wherever they live: the one storage type of activations, saved state and
//! (host) flat buffers. The host arm is a [`FlatBuf`]; the CUDA arm a device buffer that
//! knows its device, so copies and frees need no backend handle.

use std::ops::Range;

use super::meta::{mixed_meta, MetaBuf};
use super::{DType, FlatBuf, View, ViewMut};
use crate::backend::{DeviceBuf, DeviceIds};
use crate::{Error, Result};

/// Owned elements in host or device memory.
#[derive(Debug)]
pub enum Storage {
    /// Host memory.
    Host(FlatBuf),
    /// Memory of a CUDA device.
    Cuda(DeviceBuf),
    /// Size-only elements: a dtype and a length, no bytes ([`super::meta`]).
    Meta(MetaBuf),
}

impl Storage {
    /// Host f32 storage holding `v`.
    pub fn from_f32(v: Vec<f32>) -> Self {
        Storage::Host(FlatBuf::F32(v))
    }

    /// Element count.
    pub fn len(&self) -> usize {
        match self {
            Storage::Host(b) => b.len(),
            Storage::Cuda(c) => c.len(),
            Storage::Meta(m) => m.len,
        }
    }

    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        match self {
            Storage::Host(b) => b.dtype(),
            Storage::Cuda(c) => c.dtype(),
            Storage::Meta(m) => m.dtype,
        }
    }

    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        (self.len() * self.dtype().size()) as u64
    }

    /// The whole storage, read-only.
    pub fn view(&self) -> View<'_> {
        match self {
            Storage::Host(b) => View::Host(b.as_ref()),
            Storage::Cuda(c) => View::Cuda(c.view()),
            Storage::Meta(m) => View::Meta(*m),
        }
    }

    /// Marks device memory as read or written by work queued on stream `s` (a copy stream):
    /// when the storage is dropped, its memory is reused only after that work has finished
    /// (PyTorch's `record_stream`). Host memory needs nothing: its copies are complete when
    /// they return, or own their buffers ([`super::in_flight::HostCopy`]).
    pub fn record_stream(&mut self, s: crate::backend::Stream) {
        match self {
            Storage::Host(_) | Storage::Meta(_) => {}
            Storage::Cuda(c) => c.record_stream(s),
        }
    }

    /// The whole storage, mutable.
    pub fn view_mut(&mut self) -> ViewMut<'_> {
        match self {
            Storage::Host(b) => ViewMut::Host(b.as_mut()),
            Storage::Cuda(c) => ViewMut::Cuda(c.view_mut()),
            Storage::Meta(m) => ViewMut::Meta(*m),
        }
    }

    /// A copy of the values in host memory (an explicit device-to-host copy for device storage;
    /// a clone for host storage).
    pub fn to_host(&self) -> Result<FlatBuf> {
        match self {
            Storage::Host(b) => Ok(b.clone()),
            Storage::Cuda(c) => c.to_host(),
            Storage::Meta(m) => m.host_zeros("to_host"),
        }
    }

    /// The values as host f32, whatever the device and dtype (an explicit device-to-host copy
    /// for device storage; widening for half precision).
    pub fn to_vec_f32(&self) -> Result<Vec<f32>> {
        let host = match self {
            Storage::Host(FlatBuf::F32(v)) => return Ok(v.clone()),
            Storage::Host(b) => std::borrow::Cow::Borrowed(b),
            Storage::Cuda(c) => std::borrow::Cow::Owned(c.to_host()?),
            Storage::Meta(m) => std::borrow::Cow::Owned(m.host_zeros("to_vec_f32")?),
        };
        let mut out = vec![0.0; host.len()];
        host.load_f32(0, &mut out);
        Ok(out)
    }

    /// The values in host memory, by value (an explicit download for device storage).
    pub fn into_host(self) -> Result<FlatBuf> {
        match self {
            Storage::Host(b) => Ok(b),
            Storage::Cuda(c) => c.to_host(),
            Storage::Meta(m) => m.host_zeros("into_host"),
        }
    }

    /// `len` zeros of `dtype` where `self` lives (host memory, or the same device): scratch
    /// for the collectives on a buffer, allocated beside it.
    pub fn zeros_like(&self, dtype: DType, len: usize) -> Result<Storage> {
        Ok(match self {
            Storage::Host(_) => Storage::Host(FlatBuf::zeros(dtype, len)),
            Storage::Cuda(c) => Storage::Cuda(c.zeros_like(dtype, len)?),
            Storage::Meta(_) => Storage::Meta(MetaBuf::new(dtype, len)),
        })
    }

    /// `len` elements of `dtype` with unspecified contents where `self` lives, for an output
    /// the caller overwrites whole: host buffers come from this thread's [`spare`] cache
    /// (no fresh pages, no zero-fill), device buffers are zeroed as by [`Storage::zeros_like`].
    ///
    /// [`spare`]: crate::tensor::spare
    pub fn uninit_like(&self, dtype: DType, len: usize) -> Result<Storage> {
        Ok(match self {
            Storage::Host(_) => Storage::Host(crate::tensor::spare::take(dtype, len)),
            Storage::Cuda(c) => Storage::Cuda(c.zeros_like(dtype, len)?),
            Storage::Meta(_) => Storage::Meta(MetaBuf::new(dtype, len)),
        })
    }

    /// A copy on the same device.
    pub fn try_clone(&self) -> Result<Storage> {
        Ok(match self {
            Storage::Host(b) => Storage::Host(b.clone()),
            Storage::Cuda(c) => Storage::Cuda(c.try_clone()?),
            Storage::Meta(m) => Storage::Meta(*m),
        })
    }
}

/// The engine's buffer operations: what ZeRO does to flat buffers besides computing with them
/// (accumulating reduced gradients, checking and measuring them, moving ranges between
/// buffers, converting dtypes). Both operands of a two-buffer operation must live on the same
/// device; copies between devices are the explicit `read_f32`/`write_f32`/`with_host_mut` calls.
impl Storage {
    /// The host buffer, when the elements are in host memory.
    pub fn host(&self) -> Option<&FlatBuf> {
        match self {
            Storage::Host(b) => Some(b),
            Storage::Cuda(_) | Storage::Meta(_) => None,
        }
    }

    /// The mutable host buffer, when the elements are in host memory.
    pub fn host_mut(&mut self) -> Option<&mut FlatBuf> {
        match self {
            Storage::Host(b) => Some(b),
            Storage::Cuda(_) | Storage::Meta(_) => None,
        }
    }

    /// Elements `range`, read-only.
    pub fn range(&self, range: Range<usize>) -> Result<View<'_>> {
        self.view().range(range)
    }

    /// Elements `range`, mutable.
    pub fn range_mut(&mut self, range: Range<usize>) -> Result<ViewMut<'_>> {
        self.view_mut().range(range)
    }

    /// Runs `f` on the values in host memory and keeps what it wrote: directly for host
    /// storage; for device storage through an explicit download and upload.
    pub fn with_host_mut<R>(&mut self, f: impl FnOnce(&mut FlatBuf) -> Result<R>) -> Result<R> {
        match self {
            Storage::Host(b) => f(b),
            Storage::Cuda(c) => {
                let mut host = c.to_host()?;
                let r = f(&mut host)?;
                c.write_host(0, host.as_ref())?;
                Ok(r)
            }
            // What `f` writes has nowhere to go: the elements have no values.
            Storage::Meta(m) => f(&mut m.host_zeros("with_host_mut")?),
        }
    }

    /// Writes host f32 values into `self[offset..]`, rounding to the storage dtype (an explicit
    /// upload for device storage).
    pub fn write_f32(&mut self, offset: usize, src: &[f32]) -> Result<()> {
        check_span("write_f32", offset, src.len(), self.len())?;
        match self {
            Storage::Host(b) => {
                b.store_f32(offset, src);
                Ok(())
            }
            Storage::Cuda(c) => c.write_f32(offset, src),
            Storage::Meta(_) => Ok(()),
        }
    }

    /// Writes the host f32 values `values()` makes, `len` of them, into `self[offset..]` as
    /// [`Storage::write_f32`] does; size-only storage, and a size-only device's, never calls
    /// `values` (generating a
    /// model's initial values is what a size-only run must not spend its time on).
    pub fn write_f32_with(
        &mut self,
        offset: usize,
        len: usize,
        values: impl FnOnce() -> Vec<f32>,
    ) -> Result<()> {
        check_span("write_f32", offset, len, self.len())?;
        match self {
            Storage::Meta(_) => return Ok(()),
            // A size-only device issues the upload and reads no value.
            Storage::Cuda(c) if c.view().sizes_only() => return c.write_unvalued(offset, len),
            _ => {}
        }
        let v = values();
        check_span("write_f32 values", 0, v.len(), len)?;
        self.write_f32(offset, &v)
    }

    /// Whether the host's backend ([`crate::backend::MemoryOps::host_backend`]) computes on these
    /// elements: host memory, and size-only elements (a size-only device is its own host).
    pub fn is_host_side(&self) -> bool {
        matches!(self, Storage::Host(_) | Storage::Meta(_))
    }

    /// Reads `self[offset..offset + dst.len()]` into host f32 (an explicit download for
    /// device storage).
    pub fn read_f32(&self, offset: usize, dst: &mut [f32]) -> Result<()> {
        check_span("read_f32", offset, dst.len(), self.len())?;
        match self {
            Storage::Host(b) => {
                b.load_f32(offset, dst);
                Ok(())
            }
            Storage::Cuda(c) => c.read_f32(offset, dst),
            Storage::Meta(m) => {
                m.with_len(dst.len()).check_read("read_f32")?;
                dst.fill(0.0);
                Ok(())
            }
        }
    }

    /// `dst = self` converted to `dst`'s dtype (same length, same device; round to nearest
    /// even when narrowing).
    pub fn cast_into(&self, dst: &mut Storage) -> Result<()> {
        if self.len() != dst.len() {
            return Err(Error::Shape {
                op: "cast",
                expected: format!("{} elements", self.len()),
                got: format!("{}", dst.len()),
            });
        }
        match (self, dst) {
            (Storage::Host(s), Storage::Host(FlatBuf::F32(d))) => s.load_f32(0, d),
            (Storage::Host(FlatBuf::F32(s)), Storage::Host(d)) => d.store_f32(0, s),
            (Storage::Host(s), Storage::Host(d)) => {
                let mut tmp = vec![0.0; s.len()];
                s.load_f32(0, &mut tmp);
                d.store_f32(0, &tmp);
            }
            (Storage::Cuda(s), Storage::Cuda(d)) => s.cast_into(d)?,
            (Storage::Meta(_), Storage::Meta(_)) => {}
            (Storage::Meta(_), _) | (_, Storage::Meta(_)) => return Err(mixed_meta("cast")),
            _ => return Err(mixed("cast")),
        }
        Ok(())
    }

    /// Adds the first `n` elements of `src` (same dtype, same device) into
    /// `self[offset..offset + n]`, in f32 and rounded once per element.
    pub fn accumulate(
        &mut self,
        offset: usize,
        src: &Storage,
        n: usize,
        scratch: &mut Vec<f32>,
    ) -> Result<()> {
        check_span("accumulate", offset, n, self.len())?;
        check_span("accumulate source", 0, n, src.len())?;
        if self.dtype() != src.dtype() {
            return Err(Error::Invalid(format!(
                "accumulate: {:?} into {:?}",
                src.dtype(),
                self.dtype()
            )));
        }
        // Nothing to add is no work on any device: a group with no gradient of its own (a
        // Llama's embedding unit whose table the tied head owns) keeps the host's empty
        // stand-in while its empty reduction comes from the device.
        if n == 0 {
            return Ok(());
        }
        match (self, src) {
            (Storage::Host(d), Storage::Host(s)) => {
                d.accumulate(offset, s, n, scratch);
                Ok(())
            }
            (Storage::Cuda(d), Storage::Cuda(s)) => d.accumulate(offset, s, n),
            (Storage::Meta(_), Storage::Meta(_)) => Ok(()),
            (Storage::Meta(_), _) | (_, Storage::Meta(_)) => Err(mixed_meta("accumulate")),
            _ => Err(mixed("accumulate")),
        }
    }

    /// Adds the host view `src` (same dtype) into `self[offset..offset + src.len()]` as
    /// [`Storage::accumulate`] does (f32 sum rounded once per element): how a host
    /// accumulator takes a gradient that came down from the device. A device accumulator
    /// takes device buffers through [`Storage::accumulate`].
    pub fn accumulate_view(
        &mut self,
        offset: usize,
        src: View<'_>,
        scratch: &mut Vec<f32>,
    ) -> Result<()> {
        check_span("accumulate", offset, src.len(), self.len())?;
        if self.dtype() != src.dtype() {
            return Err(Error::Invalid(format!(
                "accumulate: {:?} into {:?}",
                src.dtype(),
                self.dtype()
            )));
        }
        match (self, src) {
            (Storage::Host(d), View::Host(s)) => {
                d.accumulate_ref(offset, s, scratch);
                Ok(())
            }
            // A size-only host accumulator takes what came down from a size-only device (its
            // staging memory, never written): nothing to add.
            (Storage::Meta(_), View::Meta(_) | View::Host(_)) => Ok(()),
            (Storage::Meta(_), _) | (_, View::Meta(_)) => Err(mixed_meta("accumulate")),
            _ => Err(mixed("accumulate")),
        }
    }

    /// Sets every element to zero.
    pub fn fill_zero(&mut self) -> Result<()> {
        match self {
            Storage::Host(b) => {
                b.fill_zero();
                Ok(())
            }
            Storage::Cuda(c) => c.fill_zero(),
            Storage::Meta(_) => Ok(()),
        }
    }

    /// Whether any element of `range` is infinite or NaN (device storage: the answer is read
    /// back, a synchronisation).
    pub fn has_non_finite(&self, range: Range<usize>) -> Result<bool> {
        check_span("has_non_finite", range.start, range.len(), self.len())?;
        match self {
            Storage::Host(b) => Ok(b.has_non_finite(range)),
            Storage::Cuda(c) => c.has_non_finite(range),
            Storage::Meta(_) => Ok(false),
        }
    }

    /// Sum of squares of `range`, accumulated in f64 (device storage: read back).
    pub fn sum_squares(&self, range: Range<usize>) -> Result<f64> {
        check_span("sum_squares", range.start, range.len(), self.len())?;
        match self {
            Storage::Host(b) => Ok(b.sum_squares(range)),
            Storage::Cuda(c) => c.sum_squares(range),
            Storage::Meta(_) => Ok(0.0),
        }
    }

    /// Quantizes `self[range]` in `fmt` ([`super::quant`]) into the
    /// [`Packed::words`](super::quant::Packed::words) words of `out` from `word_offset` (a
    /// buffer of [`WIRE_DTYPE`](super::quant::WIRE_DTYPE) on the same device); the rest of
    /// `out` is left.
    pub fn quantize_into(
        &self,
        range: Range<usize>,
        fmt: super::quant::QuantFormat,
        out: &mut Storage,
        word_offset: usize,
    ) -> Result<()> {
        fmt.check()?;
        check_span("quantize", range.start, range.len(), self.len())?;
        let len = range.len();
        let words = super::quant::Packed { fmt, len }.words();
        check_span("quantize output", word_offset, words, out.len())?;
        if out.dtype() != super::quant::WIRE_DTYPE {
            return Err(super::quant::wire_dtype_error(out.dtype()));
        }
        let at = word_offset..word_offset + words;
        match (self, out) {
            (Storage::Host(s), Storage::Host(o)) => {
                super::quant::quantize_host(s.as_ref_range(range), fmt, o.as_mut_range(at))
            }
            (Storage::Cuda(s), Storage::Cuda(o)) => s.quantize_into(range, fmt, o, at.start),
            (Storage::Meta(_), Storage::Meta(_)) => Ok(()),
            (Storage::Meta(_), _) | (_, Storage::Meta(_)) => Err(mixed_meta("quantize")),
            _ => Err(mixed("quantize")),
        }
    }

    /// Dequantizes `len` elements in `fmt` from the packed words of `self` starting at word
    /// `word_offset` into `dst[offset..offset + len]` (same device), rounded once to `dst`'s
    /// dtype.
    pub fn dequantize_into(
        &self,
        word_offset: usize,
        fmt: super::quant::QuantFormat,
        dst: &mut Storage,
        offset: usize,
        len: usize,
    ) -> Result<()> {
        fmt.check()?;
        let words = super::quant::Packed { fmt, len }.words();
        check_span("dequantize input", word_offset, words, self.len())?;
        check_span("dequantize", offset, len, dst.len())?;
        if self.dtype() != super::quant::WIRE_DTYPE {
            return Err(super::quant::wire_dtype_error(self.dtype()));
        }
        match (self, dst) {
            (Storage::Host(s), Storage::Host(d)) => {
                let src = s.as_ref_range(word_offset..word_offset + words);
                super::quant::dequantize_host(src, fmt, d, offset, len)
            }
            (Storage::Cuda(s), Storage::Cuda(d)) => {
                s.dequantize_into(word_offset, fmt, d, offset, len)
            }
            (Storage::Meta(_), Storage::Meta(_)) => Ok(()),
            (Storage::Meta(_), _) | (_, Storage::Meta(_)) => Err(mixed_meta("dequantize")),
            _ => Err(mixed("dequantize")),
        }
    }

    /// Page-locks host storage with `be`'s driver (see [`crate::backend::MemoryOps::pin_host`]);
    /// `None` for device storage or when the driver refuses. Drop the guard before `self`.
    pub fn pin_host(
        &mut self,
        be: &dyn crate::backend::MemoryOps,
    ) -> Option<super::in_flight::HostPin> {
        match self {
            Storage::Host(b) => be.pin_host(b),
            Storage::Meta(m) => be.pin_meta_host(m),
            Storage::Cuda(_) => None,
        }
    }

    /// Copies `n` elements from `self[src_off..]` to `dst[dst_off..]` (same dtype and device).
    pub fn copy_to(
        &self,
        src_off: usize,
        dst: &mut Storage,
        dst_off: usize,
        n: usize,
    ) -> Result<()> {
        check_span("copy source", src_off, n, self.len())?;
        check_span("copy destination", dst_off, n, dst.len())?;
        let src = self.view().range(src_off..src_off + n)?;
        let dst = dst.view_mut().range(dst_off..dst_off + n)?;
        copy_view(src, dst)
    }
}

/// Copies equal-length views of one dtype on one device.
pub(crate) fn copy_view(src: View<'_>, dst: ViewMut<'_>) -> Result<()> {
    use super::{BufMut, BufRef};
    match (src, dst) {
        (View::Host(BufRef::F32(a)), ViewMut::Host(BufMut::F32(b))) => b.copy_from_slice(a),
        (View::Host(BufRef::Bf16(a)), ViewMut::Host(BufMut::Bf16(b))) => b.copy_from_slice(a),
        (View::Host(BufRef::F16(a)), ViewMut::Host(BufMut::F16(b))) => b.copy_from_slice(a),
        (View::Cuda(a), ViewMut::Cuda(b)) => return a.copy_to(b),
        (View::Meta(a), ViewMut::Meta(b)) if a == b => {}
        // A size-only device's host side and its device (or its staging memory) meet: the
        // copy moves nothing, as that device's own copies move nothing.
        (View::Meta(a), d) if meets_size_only(&d.as_view()) => same_shape(&a, d.dtype(), d.len())?,
        (v, ViewMut::Meta(a)) if meets_size_only(&v) => same_shape(&a, v.dtype(), v.len())?,
        (View::Meta(_), _) | (_, ViewMut::Meta(_)) => return Err(mixed_meta("copy")),
        (s, d) => {
            return Err(Error::Invalid(format!(
                "copy between a {:?} and a {:?} view on different devices or of different dtypes",
                s.dtype(),
                d.dtype()
            )))
        }
    }
    Ok(())
}

/// Whether `v` is what a size-only host buffer may be copied to or from without a value
/// moving: memory of a size-only device, or host memory (the staging such a device copies
/// through, which it never writes).
fn meets_size_only(v: &View<'_>) -> bool {
    match v {
        View::Cuda(c) => c.sizes_only(),
        View::Host(_) => true,
        View::Meta(_) => false,
    }
}

/// Fails unless a copy between `m` and `dtype` x `len` elements is between equal shapes.
fn same_shape(m: &super::meta::MetaBuf, dtype: super::DType, len: usize) -> Result<()> {
    if (m.dtype, m.len) == (dtype, len) {
        return Ok(());
    }
    Err(Error::Shape {
        op: "copy",
        expected: format!("{} {:?} elements", m.len, m.dtype),
        got: format!("{len} {dtype:?}"),
    })
}

pub(super) fn check_span(op: &'static str, offset: usize, n: usize, len: usize) -> Result<()> {
    if offset.checked_add(n).is_some_and(|end| end <= len) {
        return Ok(());
    }
    Err(Error::Shape {
        op,
        expected: format!("a span within {len} elements"),
        got: format!("{n} elements at offset {offset}"),
    })
}

fn mixed(op: &str) -> Error {
    Error::Invalid(format!(
        "{op}: the buffers live on different devices (copy one explicitly first)"
    ))
}

impl Default for Storage {
    fn default() -> Self {
        Storage::from_f32(Vec::new())
    }
}

/// Owned integer indices (token ids, targets) where a backend reads them.
#[derive(Debug)]
pub enum IdBuf {
    /// Host memory.
    Host(Vec<i32>),
    /// Device memory (with the host copy the backend keeps for host-side planning).
    Cuda(DeviceIds),
}

/// Borrowed integer indices.
#[derive(Debug, Clone, Copy)]
pub enum Ids<'a> {
    /// Host memory.
    Host(&'a [i32]),
    /// Device memory.
    Cuda(&'a DeviceIds),
}

impl IdBuf {
    /// The indices, borrowed.
    pub fn ids(&self) -> Ids<'_> {
        match self {
            IdBuf::Host(v) => Ids::Host(v),
            IdBuf::Cuda(c) => Ids::Cuda(c),
        }
    }
}

impl Ids<'_> {
    /// Index count.
    pub fn len(&self) -> usize {
        match self {
            Ids::Host(v) => v.len(),
            Ids::Cuda(c) => c.len(),
        }
    }

    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
