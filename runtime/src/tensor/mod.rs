//! Tensors: the activations that flow between units (owned, row-major f32) and the storage
//! dtypes of engine-owned flat buffers.
//!
//! Activations are always f32 on the CPU path: mixed precision changes how parameters are
//! stored and communicated (bf16/f16 copies), while matmuls accumulate in f32.

mod flat;
pub mod spare;

pub use flat::FlatBuf;

/// Storage dtype of a flat buffer (parameters, gradients, communication).
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

/// An owned, row-major f32 tensor: the activations passed between modules.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Tensor {
    /// Dimensions, outermost first.
    pub shape: Vec<usize>,
    /// Elements in row-major order; `data.len()` equals the product of `shape`.
    pub data: Vec<f32>,
}

impl Tensor {
    /// A tensor from a shape and its data; fails when the lengths disagree.
    pub fn new(shape: Vec<usize>, data: Vec<f32>) -> crate::Result<Self> {
        let n: usize = shape.iter().product();
        if n != data.len() {
            return Err(crate::Error::Shape {
                op: "Tensor::new",
                expected: format!("{n} elements for shape {shape:?}"),
                got: format!("{}", data.len()),
            });
        }
        Ok(Self { shape, data })
    }

    /// A zero-filled tensor.
    pub fn zeros(shape: Vec<usize>) -> Self {
        let n = shape.iter().product();
        Self {
            shape,
            data: vec![0.0; n],
        }
    }

    /// A one-element tensor.
    pub fn scalar(v: f32) -> Self {
        Self {
            shape: vec![1],
            data: vec![v],
        }
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.data.len()
    }

    /// Bytes held by the data.
    pub fn bytes(&self) -> usize {
        self.data.len() * 4
    }
}
