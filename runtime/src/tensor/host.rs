//! Borrowed host memory in one of the storage dtypes: the host arm of a view, and the buffers
//! the communicators exchange.

use half::{bf16, f16};

use super::DType;

/// A mutable run of host elements of one of the storage dtypes.
#[derive(Debug)]
pub enum BufMut<'a> {
    /// f32 elements.
    F32(&'a mut [f32]),
    /// bf16 elements.
    Bf16(&'a mut [bf16]),
    /// f16 elements.
    F16(&'a mut [f16]),
}

/// A read-only run of host elements of one of the storage dtypes.
#[derive(Debug, Clone, Copy)]
pub enum BufRef<'a> {
    /// f32 elements.
    F32(&'a [f32]),
    /// bf16 elements.
    Bf16(&'a [bf16]),
    /// f16 elements.
    F16(&'a [f16]),
}

/// Applies `$e` to the slice inside any variant of a `BufRef`/`BufMut` (the same code for
/// every dtype), producing the same variant around the result when `$wrap` is given.
macro_rules! each {
    ($t:ident, $v:expr, $s:ident => $e:expr) => {
        match $v {
            $t::F32($s) => $e,
            $t::Bf16($s) => $e,
            $t::F16($s) => $e,
        }
    };
}

impl<'a> BufRef<'a> {
    /// Element count.
    pub fn len(&self) -> usize {
        each!(BufRef, self, s => s.len())
    }
    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The dtype.
    pub fn dtype(&self) -> DType {
        match self {
            BufRef::F32(_) => DType::F32,
            BufRef::Bf16(_) => DType::Bf16,
            BufRef::F16(_) => DType::F16,
        }
    }
    /// Elements `range` (panics outside the buffer, like slice indexing).
    pub fn range(self, range: std::ops::Range<usize>) -> BufRef<'a> {
        match self {
            BufRef::F32(s) => BufRef::F32(&s[range]),
            BufRef::Bf16(s) => BufRef::Bf16(&s[range]),
            BufRef::F16(s) => BufRef::F16(&s[range]),
        }
    }
    /// The raw bytes.
    pub fn bytes(self) -> &'a [u8] {
        each!(BufRef, self, s => bytemuck::cast_slice(s))
    }
}

impl<'a> BufMut<'a> {
    /// Element count.
    pub fn len(&self) -> usize {
        each!(BufMut, self, s => s.len())
    }
    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The dtype.
    pub fn dtype(&self) -> DType {
        match self {
            BufMut::F32(_) => DType::F32,
            BufMut::Bf16(_) => DType::Bf16,
            BufMut::F16(_) => DType::F16,
        }
    }
    /// A shorter-lived mutable borrow of the same elements.
    pub fn reborrow(&mut self) -> BufMut<'_> {
        match self {
            BufMut::F32(s) => BufMut::F32(s),
            BufMut::Bf16(s) => BufMut::Bf16(s),
            BufMut::F16(s) => BufMut::F16(s),
        }
    }
    /// A read-only borrow of the same elements.
    pub fn as_ref(&self) -> BufRef<'_> {
        match self {
            BufMut::F32(s) => BufRef::F32(s),
            BufMut::Bf16(s) => BufRef::Bf16(s),
            BufMut::F16(s) => BufRef::F16(s),
        }
    }
    /// Elements `range` (panics outside the buffer, like slice indexing).
    pub fn range(self, range: std::ops::Range<usize>) -> BufMut<'a> {
        match self {
            BufMut::F32(s) => BufMut::F32(&mut s[range]),
            BufMut::Bf16(s) => BufMut::Bf16(&mut s[range]),
            BufMut::F16(s) => BufMut::F16(&mut s[range]),
        }
    }
    /// Splits at `mid` into two disjoint halves.
    pub fn split_at(self, mid: usize) -> (BufMut<'a>, BufMut<'a>) {
        match self {
            BufMut::F32(s) => {
                let (a, b) = s.split_at_mut(mid);
                (BufMut::F32(a), BufMut::F32(b))
            }
            BufMut::Bf16(s) => {
                let (a, b) = s.split_at_mut(mid);
                (BufMut::Bf16(a), BufMut::Bf16(b))
            }
            BufMut::F16(s) => {
                let (a, b) = s.split_at_mut(mid);
                (BufMut::F16(a), BufMut::F16(b))
            }
        }
    }
    /// The raw bytes.
    pub fn bytes_mut(self) -> &'a mut [u8] {
        each!(BufMut, self, s => bytemuck::cast_slice_mut(s))
    }
}

/// Buffers convert from slices of their element types, so generic code can stay generic.
macro_rules! buf_from {
    ($t:ty, $v:ident) => {
        impl<'a> From<&'a mut [$t]> for BufMut<'a> {
            fn from(b: &'a mut [$t]) -> Self {
                BufMut::$v(b)
            }
        }
        impl<'a> From<&'a [$t]> for BufRef<'a> {
            fn from(b: &'a [$t]) -> Self {
                BufRef::$v(b)
            }
        }
    };
}
buf_from!(f32, F32);
buf_from!(bf16, Bf16);
buf_from!(f16, F16);
