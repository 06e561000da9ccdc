//! The CUDA backend's buffers and views in a build without CUDA memory: types with no values,
//! so every `match` on a storage or view keeps its device arm (the code is the same in every
//! build) while the compiler knows that arm cannot run. A CUDA build has `storage.rs`'s real
//! device buffers under the same names.

use std::convert::Infallible;
use std::marker::PhantomData;
use std::ops::Range;

use crate::backend::{Stream, StreamEvent};
use crate::tensor::in_flight::HostCopy;
use crate::tensor::quant::QuantFormat;
use crate::tensor::{BufMut, BufRef, DType, FlatBuf};
use crate::Result;

/// Device memory of the CUDA backend (none exists in this build).
#[derive(Debug)]
pub struct CudaBuf(Infallible);

/// A borrowed run of device elements (none exists in this build).
#[derive(Debug, Clone, Copy)]
pub struct CudaView<'a>(Infallible, PhantomData<&'a ()>);

/// A mutably borrowed run of device elements (none exists in this build).
#[derive(Debug)]
pub struct CudaViewMut<'a>(Infallible, PhantomData<&'a mut ()>);

/// Integer indices in device memory (none exist in this build).
#[derive(Debug)]
pub struct CudaIds(Infallible);

/// The real types' methods, with signatures only (a type's lifetime is the impl's): no value
/// reaches a body, which matches on the uninhabited field. The receiver's `self` is passed to
/// the body (one written in the macro would not be the method's).
macro_rules! no_value {
    ($(impl $ty:ident$(<$lt:lifetime>)? {
        $($(#[$attr:meta])* $vis:vis fn $name:ident$(<$g:ident>)?($($sig:tt)*) $(-> $ret:ty)?;)*
    })*) => {
        $(impl$(<$lt>)? $ty$(<$lt>)? {
            $($(#[$attr])* $vis fn $name$(<$g>)?($($sig)*) $(-> $ret)? {
                no_value!(@body $($sig)*)
            })*
        })*
    };
    (@body &mut $s:ident $($rest:tt)*) => { match $s.0 {} };
    (@body & $s:ident $($rest:tt)*) => { match $s.0 {} };
    (@body $s:ident $($rest:tt)*) => { match $s.0 {} };
}

no_value! {
    impl CudaBuf {
        /// Elements.
        pub fn len(&self) -> usize;
        /// Whether empty.
        pub fn is_empty(&self) -> bool;
        /// Element type.
        pub fn dtype(&self) -> DType;
        /// The whole buffer, read-only.
        pub fn view(&self) -> CudaView<'_>;
        /// The whole buffer, mutable.
        pub fn view_mut(&mut self) -> CudaViewMut<'_>;
        /// Marks the buffer as used by work on a stream.
        pub fn record_stream(&mut self, _s: Stream);
        /// A copy in host memory.
        pub fn to_host(&self) -> Result<FlatBuf>;
        /// A copy on the same device.
        pub fn try_clone(&self) -> Result<CudaBuf>;
        /// Zeros on the same device.
        pub fn zeros_like(&self, _dtype: DType, _len: usize) -> Result<CudaBuf>;
        /// A new buffer on the same device holding `host`'s values.
        pub fn upload_like(&self, _host: &FlatBuf) -> Result<CudaBuf>;
        /// Writes host elements (of this buffer's dtype) at `offset`.
        pub fn write_host(&mut self, _offset: usize, _src: BufRef<'_>) -> Result<()>;
        /// Writes host f32 values at `offset`, rounding to the dtype.
        pub fn write_f32(&mut self, _offset: usize, _src: &[f32]) -> Result<()>;
        /// A write of `len` values a size-only device never reads.
        pub(crate) fn write_unvalued(&mut self, _offset: usize, _len: usize) -> Result<()>;
        /// Reads values at `offset` into host f32.
        pub fn read_f32(&self, _offset: usize, _dst: &mut [f32]) -> Result<()>;
        /// Converts into `dst`'s dtype.
        pub fn cast_into(&self, _dst: &mut CudaBuf) -> Result<()>;
        /// `self[offset..offset + n] += src[..n]`.
        pub fn accumulate(&mut self, _offset: usize, _src: &CudaBuf, _n: usize) -> Result<()>;
        /// Zeroes every element.
        pub fn fill_zero(&mut self) -> Result<()>;
        /// Whether `range` holds Inf or NaN.
        pub fn has_non_finite(&self, _range: Range<usize>) -> Result<bool>;
        /// Sum of squares of `range` in f64.
        pub fn sum_squares(&self, _range: Range<usize>) -> Result<f64>;
        /// `self[range]` quantized into `out`'s words from `word_offset`.
        pub fn quantize_into(&self, _range: Range<usize>, _fmt: QuantFormat, _out: &mut CudaBuf, _word_offset: usize) -> Result<()>;
        /// Packed words dequantized into `dst`.
        pub fn dequantize_into(&self, _word_offset: usize, _fmt: QuantFormat, _dst: &mut CudaBuf, _offset: usize, _len: usize) -> Result<()>;
    }
    impl CudaView<'a> {
        /// Any value: a view that cannot exist proves everything (for code whose CUDA arm only
        /// a CUDA build can reach).
        pub(crate) fn absurd<T>(&self) -> T;
        /// Elements.
        pub fn len(&self) -> usize;
        /// Whether empty.
        pub fn is_empty(&self) -> bool;
        /// Element type.
        pub fn dtype(&self) -> DType;
        /// Elements `range`.
        pub fn range(self, _range: Range<usize>) -> Result<CudaView<'a>>;
        /// A copy in host memory.
        pub fn to_host(&self) -> Result<FlatBuf>;
        /// Copies into host elements of the same dtype and length.
        pub fn download(&self, _dst: BufMut<'_>) -> Result<()>;
        /// A host copy in the device's staging memory.
        pub fn stage(&self) -> Result<FlatBuf>;
        /// A download into staging memory queued on a copy stream.
        pub fn download_async(&self, _s: Stream) -> Result<HostCopy>;
        /// Staging memory shaped as this view, no copy in flight.
        pub fn staging_copy(&self) -> HostCopy;
        /// Staging memory shaped as this view, contents unspecified.
        pub fn staging(&self) -> FlatBuf;
        /// Takes back a staging buffer.
        pub fn unstage(&self, _b: FlatBuf);
        /// Copies into an equal-length view of the same dtype on the same device.
        pub fn copy_to(self, _dst: CudaViewMut<'_>) -> Result<()>;
        /// Whether this view's device holds no bytes.
        pub fn sizes_only(&self) -> bool;
    }
    impl CudaViewMut<'a> {
        /// Elements.
        pub fn len(&self) -> usize;
        /// Whether empty.
        pub fn is_empty(&self) -> bool;
        /// Element type.
        pub fn dtype(&self) -> DType;
        /// A shorter-lived borrow.
        pub fn reborrow(&mut self) -> CudaViewMut<'_>;
        /// Read-only.
        pub fn as_view(&self) -> CudaView<'_>;
        /// Elements `range`.
        pub fn range(self, _range: Range<usize>) -> Result<CudaViewMut<'a>>;
        /// Two disjoint halves.
        pub fn split_at(self, _mid: usize) -> (CudaViewMut<'a>, CudaViewMut<'a>);
        /// Overwrites the elements with host values of the same dtype and length.
        pub fn upload(self, _src: BufRef<'_>) -> Result<()>;
    }
    impl CudaIds {
        /// Indices held.
        pub fn len(&self) -> usize;
        /// Whether empty.
        pub fn is_empty(&self) -> bool;
    }
}

impl CudaViewMut<'_> {
    /// An upload queued on a copy stream.
    ///
    /// # Safety
    /// `src` must stay unwritten until the returned event has completed.
    pub(crate) unsafe fn upload_async(
        self,
        _src: BufRef<'_>,
        _s: Stream,
    ) -> Result<Option<StreamEvent>> {
        match self.0 {}
    }
}
