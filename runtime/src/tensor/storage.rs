//! Owned elements wherever they live: the one storage type of activations, saved state and
//! (host) flat buffers. The host arm is a [`FlatBuf`]; the CUDA arm a device buffer that
//! knows its device, so copies and frees need no backend handle.

use super::{CudaBuf, CudaIds, DType, FlatBuf, View, ViewMut};
use crate::Result;

/// Owned elements in host or device memory.
#[derive(Debug)]
pub enum Storage {
    /// Host memory.
    Host(FlatBuf),
    /// Memory of a CUDA device.
    Cuda(CudaBuf),
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
        }
    }

    /// The whole storage, mutable.
    pub fn view_mut(&mut self) -> ViewMut<'_> {
        match self {
            Storage::Host(b) => ViewMut::Host(b.as_mut()),
            Storage::Cuda(c) => ViewMut::Cuda(c.view_mut()),
        }
    }

    /// A copy of the values in host memory (an explicit device-to-host copy for device storage;
    /// a clone for host storage).
    pub fn to_host(&self) -> Result<FlatBuf> {
        match self {
            Storage::Host(b) => Ok(b.clone()),
            Storage::Cuda(c) => c.to_host(),
        }
    }

    /// The values as host f32, whatever the device and dtype (an explicit device-to-host copy
    /// for device storage; widening for half precision).
    pub fn to_vec_f32(&self) -> Result<Vec<f32>> {
        let host = match self {
            Storage::Host(FlatBuf::F32(v)) => return Ok(v.clone()),
            Storage::Host(b) => std::borrow::Cow::Borrowed(b),
            Storage::Cuda(c) => std::borrow::Cow::Owned(c.to_host()?),
        };
        let mut out = vec![0.0; host.len()];
        host.load_f32(0, &mut out);
        Ok(out)
    }

    /// A copy on the same device.
    pub fn try_clone(&self) -> Result<Storage> {
        Ok(match self {
            Storage::Host(b) => Storage::Host(b.clone()),
            Storage::Cuda(c) => Storage::Cuda(c.try_clone()?),
        })
    }
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
    Cuda(CudaIds),
}

/// Borrowed integer indices.
#[derive(Debug, Clone, Copy)]
pub enum Ids<'a> {
    /// Host memory.
    Host(&'a [i32]),
    /// Device memory.
    Cuda(&'a CudaIds),
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
