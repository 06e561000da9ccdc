//! The CUDA arm of storage and views in a build without CUDA memory: types with no values, so
//! every `match` on a storage or view keeps its CUDA arm (the code is the same in every build)
//! while the compiler knows that arm cannot run. The CUDA backend replaces them with real
//! device buffers.

use std::convert::Infallible;
use std::marker::PhantomData;
use std::ops::Range;

use super::{DType, FlatBuf};
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
    /// A copy in host memory.
    pub fn to_host(&self) -> Result<FlatBuf> {
        match self.0 {}
    }
    /// A copy on the same device.
    pub fn try_clone(&self) -> Result<CudaBuf> {
        match self.0 {}
    }
}

impl<'a> CudaView<'a> {
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
