//! Tensors and their storage: activations flow between units as [`Tensor`]s (a shape over a
//! [`Storage`] in host or device memory); operations borrow [`View`]s; the engine's flat
//! buffers are [`FlatBuf`]s.
//!
//! Activations are f32 on the CPU backend (mixed precision changes how parameters are stored
//! and communicated, while matmuls accumulate in f32); a device backend chooses its own
//! activation dtype (`MemoryOps::act_dtype`).

mod flat;
mod host;
mod host_update;
pub mod in_flight;
pub mod meta;
pub mod quant;
pub mod spare;
pub mod staging;
mod storage;
mod view;

pub(crate) use flat::round_as_accumulated;
pub use flat::FlatBuf;
pub use host::{BufMut, BufRef};
pub(crate) use storage::copy_view;
pub use storage::{IdBuf, Ids, Storage};
pub use view::{View, ViewMut};

use crate::{Error, Result};

/// Storage dtype of a flat buffer (parameters, gradients, communication) or activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum DType {
    /// IEEE single precision.
    F32,
    /// bfloat16 (8-bit exponent, 7-bit mantissa).
    Bf16,
    /// IEEE half precision.
    F16,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::Bf16 | DType::F16 => 2,
        }
    }
}

/// A row-major tensor: the activations passed between modules.
#[derive(Debug, Default)]
pub struct Tensor {
    /// Dimensions, outermost first.
    pub shape: Vec<usize>,
    /// The elements, row-major; `storage.len()` equals the product of `shape`.
    pub storage: Storage,
}

impl Tensor {
    /// A tensor from a shape and its storage; fails when the lengths disagree.
    pub fn new(shape: Vec<usize>, storage: Storage) -> Result<Self> {
        let n: usize = shape.iter().product();
        if n != storage.len() {
            return Err(Error::Shape {
                op: "Tensor::new",
                expected: format!("{n} elements for shape {shape:?}"),
                got: format!("{}", storage.len()),
            });
        }
        Ok(Self { shape, storage })
    }

    /// A host f32 tensor from a shape and its values; fails when the lengths disagree.
    pub fn from_f32(shape: Vec<usize>, data: Vec<f32>) -> Result<Self> {
        Self::new(shape, Storage::from_f32(data))
    }

    /// A zero-filled host f32 tensor.
    pub fn zeros(shape: Vec<usize>) -> Self {
        let n = shape.iter().product();
        Self {
            shape,
            storage: Storage::from_f32(vec![0.0; n]),
        }
    }

    /// A one-element host f32 tensor.
    pub fn scalar(v: f32) -> Self {
        Self {
            shape: vec![1],
            storage: Storage::from_f32(vec![v]),
        }
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.storage.len()
    }

    /// Bytes held by the elements.
    pub fn bytes(&self) -> usize {
        self.storage.bytes() as usize
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.storage.dtype()
    }

    /// The elements, read-only.
    pub fn view(&self) -> View<'_> {
        self.storage.view()
    }

    /// The elements, mutable.
    pub fn view_mut(&mut self) -> ViewMut<'_> {
        self.storage.view_mut()
    }

    /// The elements when they are host f32 (tests, host-side tools); an error otherwise.
    pub fn host_f32(&self) -> Result<&[f32]> {
        match &self.storage {
            Storage::Host(FlatBuf::F32(v)) => Ok(v),
            other => Err(not_host_f32(other)),
        }
    }

    /// The elements as mutable host f32; an error otherwise.
    pub fn host_f32_mut(&mut self) -> Result<&mut [f32]> {
        match &mut self.storage {
            Storage::Host(FlatBuf::F32(v)) => Ok(v),
            other => Err(not_host_f32(other)),
        }
    }

    /// A host f32 copy of the values, whatever the device and dtype (an explicit
    /// device-to-host copy for device tensors; widening for half-precision ones).
    pub fn to_vec_f32(&self) -> Result<Vec<f32>> {
        self.storage.to_vec_f32()
    }

    /// A copy on the same device.
    pub fn try_clone(&self) -> Result<Tensor> {
        Ok(Tensor {
            shape: self.shape.clone(),
            storage: self.storage.try_clone()?,
        })
    }
}

fn not_host_f32(s: &Storage) -> Error {
    let place = match s {
        Storage::Host(_) => "host",
        Storage::Cuda(_) => "CUDA",
        Storage::Meta(_) => "meta",
    };
    let why = format!(
        "expected a host f32 tensor, got {place} {:?} storage (copy it with to_vec_f32)",
        s.dtype()
    );
    match s {
        Storage::Meta(_) => Error::SizeOnly(why),
        _ => Error::Invalid(why),
    }
}
