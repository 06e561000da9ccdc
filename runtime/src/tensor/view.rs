//! Views: borrowed runs of elements wherever they live. Backend operations, [`crate::nn::Params`],
//! [`crate::nn::Grads`] and saved activations pass views instead of `&[f32]`, so the same
//! layer code runs on every device; only the backend looks inside.

use std::ops::Range;

use super::meta::MetaBuf;
use super::{BufMut, BufRef, DType};
use crate::backend::{DeviceView, DeviceViewMut};
use crate::{Error, Result};

/// A read-only run of elements in host or device memory.
#[derive(Debug, Clone, Copy)]
pub enum View<'a> {
    /// Host memory.
    Host(BufRef<'a>),
    /// Memory of a CUDA device.
    Cuda(DeviceView<'a>),
    /// Size-only elements ([`super::meta`]).
    Meta(MetaBuf),
}

/// A mutable run of elements in host or device memory.
#[derive(Debug)]
pub enum ViewMut<'a> {
    /// Host memory.
    Host(BufMut<'a>),
    /// Memory of a CUDA device.
    Cuda(DeviceViewMut<'a>),
    /// Size-only elements ([`super::meta`]).
    Meta(MetaBuf),
}

fn out_of_range(op: &'static str, range: &Range<usize>, len: usize) -> Error {
    Error::Shape {
        op,
        expected: format!("a range within {len} elements"),
        got: format!("{range:?}"),
    }
}

fn not_host(dtype: DType, place: &str) -> Error {
    let why = format!(
        "expected host f32 elements, got {place} {dtype:?} ones: a module with host loops runs \
         on the CPU backend only (use backend operations to run anywhere)"
    );
    match place {
        "meta" => Error::SizeOnly(why),
        _ => Error::Invalid(why),
    }
}

fn check_range(op: &'static str, range: &Range<usize>, len: usize) -> Result<()> {
    if range.start <= range.end && range.end <= len {
        Ok(())
    } else {
        Err(out_of_range(op, range, len))
    }
}

impl<'a> View<'a> {
    /// Element count.
    pub fn len(&self) -> usize {
        match self {
            View::Host(b) => b.len(),
            View::Cuda(c) => c.len(),
            View::Meta(m) => m.len,
        }
    }

    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        match self {
            View::Host(b) => b.dtype(),
            View::Cuda(c) => c.dtype(),
            View::Meta(m) => m.dtype,
        }
    }

    /// Elements `range` of this view.
    pub fn range(self, range: Range<usize>) -> Result<View<'a>> {
        check_range("view range", &range, self.len())?;
        Ok(match self {
            View::Host(b) => View::Host(b.range(range)),
            View::Cuda(c) => View::Cuda(c.range(range)?),
            View::Meta(m) => View::Meta(m.with_len(range.len())),
        })
    }

    /// The elements as host f32, if that is what this view is.
    pub fn host_f32(self) -> Option<&'a [f32]> {
        match self {
            View::Host(BufRef::F32(s)) => Some(s),
            _ => None,
        }
    }

    /// The elements as a host f32 slice, or an error saying what they are instead: for modules
    /// that compute with their own host loops (they then run on the CPU backend only).
    pub fn host(self) -> Result<&'a [f32]> {
        let (dtype, place) = (self.dtype(), self.place());
        self.host_f32().ok_or_else(|| not_host(dtype, place))
    }

    fn place(&self) -> &'static str {
        match self {
            View::Host(_) => "host",
            View::Cuda(_) => "CUDA",
            View::Meta(_) => "meta",
        }
    }

    /// Zeros shaped as this view in host memory, to copy it into: a host buffer for real
    /// elements, size-only storage for size-only ones.
    pub fn host_zeros_like(&self) -> Result<super::Storage> {
        Ok(match self {
            View::Meta(m) => super::Storage::Meta(*m),
            v => super::Storage::Host(super::FlatBuf::zeros(v.dtype(), v.len())),
        })
    }

    /// A copy of the values in host memory (device memory is downloaded: an explicit
    /// device-to-host copy that waits for the device).
    pub fn to_host(&self) -> Result<super::FlatBuf> {
        match self {
            View::Host(b) => Ok(super::FlatBuf::from_ref(*b)),
            View::Cuda(c) => c.to_host(),
            View::Meta(m) => m.host_zeros("to_host"),
        }
    }
}

impl<'a> ViewMut<'a> {
    /// Element count.
    pub fn len(&self) -> usize {
        match self {
            ViewMut::Host(b) => b.len(),
            ViewMut::Cuda(c) => c.len(),
            ViewMut::Meta(m) => m.len,
        }
    }

    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        match self {
            ViewMut::Host(b) => b.dtype(),
            ViewMut::Cuda(c) => c.dtype(),
            ViewMut::Meta(m) => m.dtype,
        }
    }

    /// A shorter-lived mutable borrow of the same elements (to pass a view on and keep it).
    pub fn reborrow(&mut self) -> ViewMut<'_> {
        match self {
            ViewMut::Host(b) => ViewMut::Host(b.reborrow()),
            ViewMut::Cuda(c) => ViewMut::Cuda(c.reborrow()),
            ViewMut::Meta(m) => ViewMut::Meta(*m),
        }
    }

    /// A read-only borrow of the same elements.
    pub fn as_view(&self) -> View<'_> {
        match self {
            ViewMut::Host(b) => View::Host(b.as_ref()),
            ViewMut::Cuda(c) => View::Cuda(c.as_view()),
            ViewMut::Meta(m) => View::Meta(*m),
        }
    }

    /// Elements `range` of this view.
    pub fn range(self, range: Range<usize>) -> Result<ViewMut<'a>> {
        check_range("view range", &range, self.len())?;
        Ok(match self {
            ViewMut::Host(b) => ViewMut::Host(b.range(range)),
            ViewMut::Cuda(c) => ViewMut::Cuda(c.range(range)?),
            ViewMut::Meta(m) => ViewMut::Meta(m.with_len(range.len())),
        })
    }

    /// Splits at `mid` into two disjoint views.
    pub fn split_at(self, mid: usize) -> Result<(ViewMut<'a>, ViewMut<'a>)> {
        check_range("view split", &(0..mid), self.len())?;
        Ok(match self {
            ViewMut::Host(b) => {
                let (x, y) = b.split_at(mid);
                (ViewMut::Host(x), ViewMut::Host(y))
            }
            ViewMut::Cuda(c) => {
                let (x, y) = c.split_at(mid);
                (ViewMut::Cuda(x), ViewMut::Cuda(y))
            }
            ViewMut::Meta(m) => (
                ViewMut::Meta(m.with_len(mid)),
                ViewMut::Meta(m.with_len(m.len - mid)),
            ),
        })
    }

    /// The elements as mutable host f32, if that is what this view is.
    pub fn host_f32(self) -> Option<&'a mut [f32]> {
        match self {
            ViewMut::Host(BufMut::F32(s)) => Some(s),
            _ => None,
        }
    }

    /// The elements as a mutable host f32 slice, or an error saying what they are instead (see
    /// [`View::host`]).
    pub fn host(self) -> Result<&'a mut [f32]> {
        let (dtype, place) = (self.dtype(), self.as_view().place());
        self.host_f32().ok_or_else(|| not_host(dtype, place))
    }
}

impl<'a> From<&'a [f32]> for View<'a> {
    fn from(s: &'a [f32]) -> Self {
        View::Host(BufRef::F32(s))
    }
}

impl<'a> From<&'a mut [f32]> for ViewMut<'a> {
    fn from(s: &'a mut [f32]) -> Self {
        ViewMut::Host(BufMut::F32(s))
    }
}

impl<'a> From<BufRef<'a>> for View<'a> {
    fn from(b: BufRef<'a>) -> Self {
        View::Host(b)
    }
}

impl<'a> From<BufMut<'a>> for ViewMut<'a> {
    fn from(b: BufMut<'a>) -> Self {
        ViewMut::Host(b)
    }
}
