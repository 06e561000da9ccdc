//! The CUDA arm of storage and views in a build without CUDA memory: types with no values, so
//! every `match` on a storage or view keeps its CUDA arm (the code is the same in every build)
//! while the compiler knows that arm cannot run. The CUDA backend replaces them with real
//! device buffers.

use std::convert::Infallible;
use std::marker::PhantomData;
use std::ops::Range;

use super::in_flight::HostCopy;
use super::{BufMut, BufRef, DType, FlatBuf};
use crate::backend::{Stream, StreamEvent};
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

impl CudaBuf {
    /// Elements.
    pub fn len(&self) -> usize {
        match self.0 {}
    }
    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        match self.0 {}
    }
    /// Element type.
    pub fn dtype(&self) -> DType {
        match self.0 {}
    }
    /// The whole buffer, read-only.
    pub fn view(&self) -> CudaView<'_> {
        match self.0 {}
    }
    /// The whole buffer, mutable.
    pub fn view_mut(&mut self) -> CudaViewMut<'_> {
        match self.0 {}
    }
    /// Marks the buffer as used by work on a stream.
    pub fn record_stream(&mut self, _s: crate::backend::Stream) {
        match self.0 {}
    }
    /// A copy in host memory.
    pub fn to_host(&self) -> Result<FlatBuf> {
        match self.0 {}
    }
    /// A copy on the same device.
    pub fn try_clone(&self) -> Result<CudaBuf> {
        match self.0 {}
    }
    /// Zeros on the same device.
    pub fn zeros_like(&self, _dtype: DType, _len: usize) -> Result<CudaBuf> {
        match self.0 {}
    }
    /// A new buffer on the same device holding `host`'s values.
    pub fn upload_like(&self, _host: &FlatBuf) -> Result<CudaBuf> {
        match self.0 {}
    }
    /// Writes host elements (of this buffer's dtype) at `offset`.
    pub fn write_host(&mut self, _offset: usize, _src: BufRef<'_>) -> Result<()> {
        match self.0 {}
    }
    /// Writes host f32 values at `offset`, rounding to the dtype.
    pub fn write_f32(&mut self, _offset: usize, _src: &[f32]) -> Result<()> {
        match self.0 {}
    }
    /// Reads values at `offset` into host f32.
    pub fn read_f32(&self, _offset: usize, _dst: &mut [f32]) -> Result<()> {
        match self.0 {}
    }
    /// Converts into `dst`'s dtype.
    pub fn cast_into(&self, _dst: &mut CudaBuf) -> Result<()> {
        match self.0 {}
    }
    /// `self[offset..offset + n] += src[..n]`.
    pub fn accumulate(&mut self, _offset: usize, _src: &CudaBuf, _n: usize) -> Result<()> {
        match self.0 {}
    }
    /// Zeroes every element.
    pub fn fill_zero(&mut self) -> Result<()> {
        match self.0 {}
    }
    /// Whether `range` holds Inf or NaN.
    pub fn has_non_finite(&self, _range: Range<usize>) -> Result<bool> {
        match self.0 {}
    }
    /// Sum of squares of `range` in f64.
    pub fn sum_squares(&self, _range: Range<usize>) -> Result<f64> {
        match self.0 {}
    }
}

impl<'a> CudaView<'a> {
    /// Any value: a view that cannot exist proves everything (for code whose CUDA arm only a
    /// CUDA build can reach).
    pub(crate) fn absurd<T>(&self) -> T {
        match self.0 {}
    }
    /// Elements.
    pub fn len(&self) -> usize {
        match self.0 {}
    }
    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        match self.0 {}
    }
    /// Element type.
    pub fn dtype(&self) -> DType {
        match self.0 {}
    }
    /// Elements `range`.
    pub fn range(self, _range: Range<usize>) -> Result<CudaView<'a>> {
        match self.0 {}
    }
    /// A copy in host memory.
    pub fn to_host(&self) -> Result<FlatBuf> {
        match self.0 {}
    }
    /// Copies into host elements of the same dtype and length.
    pub fn download(&self, _dst: BufMut<'_>) -> Result<()> {
        match self.0 {}
    }
    /// A host copy in the device's staging memory.
    pub fn stage(&self) -> Result<FlatBuf> {
        match self.0 {}
    }
    /// A download into staging memory queued on a copy stream.
    pub fn download_async(&self, _s: Stream) -> Result<HostCopy> {
        match self.0 {}
    }
    /// Staging memory shaped as this view, no copy in flight.
    pub fn staging_copy(&self) -> HostCopy {
        match self.0 {}
    }
    /// Staging memory shaped as this view, contents unspecified.
    pub fn staging(&self) -> FlatBuf {
        match self.0 {}
    }
    /// Takes back a staging buffer.
    pub fn unstage(&self, _b: FlatBuf) {
        match self.0 {}
    }
    /// Copies into an equal-length view of the same dtype on the same device.
    pub fn copy_to(self, _dst: CudaViewMut<'_>) -> Result<()> {
        match self.0 {}
    }
}

impl<'a> CudaViewMut<'a> {
    /// Elements.
    pub fn len(&self) -> usize {
        match self.0 {}
    }
    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        match self.0 {}
    }
    /// Element type.
    pub fn dtype(&self) -> DType {
        match self.0 {}
    }
    /// A shorter-lived borrow.
    pub fn reborrow(&mut self) -> CudaViewMut<'_> {
        match self.0 {}
    }
    /// Read-only.
    pub fn as_view(&self) -> CudaView<'_> {
        match self.0 {}
    }
    /// Elements `range`.
    pub fn range(self, _range: Range<usize>) -> Result<CudaViewMut<'a>> {
        match self.0 {}
    }
    /// Two disjoint halves.
    pub fn split_at(self, _mid: usize) -> (CudaViewMut<'a>, CudaViewMut<'a>) {
        match self.0 {}
    }
    /// Overwrites the elements with host values of the same dtype and length.
    pub fn upload(self, _src: BufRef<'_>) -> Result<()> {
        match self.0 {}
    }
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

impl CudaIds {
    /// Indices held.
    pub fn len(&self) -> usize {
        match self.0 {}
    }
    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        match self.0 {}
    }
}
