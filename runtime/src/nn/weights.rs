//! safetensors I/O over `(name, shape, &[f32])` lists, since the engine owns parameter
//! storage. Files hold f32, bf16 or f16; loading always yields f32 (bf16/f16 widen
//! exactly), so a file written here and read back reproduces every value bit for bit.

use std::collections::HashMap;
use std::path::Path;

use half::{bf16, f16};
use safetensors::tensor::{Dtype, SafeTensors, TensorView};

use crate::tensor::DType;
use crate::{Error, Result};

/// A tensor read from a file, widened to f32.
#[derive(Debug, Clone, PartialEq)]
pub struct NamedTensor {
    /// Name as stored (after [`Naming`] normalisation).
    pub name: String,
    /// Shape, row-major.
    pub shape: Vec<usize>,
    /// Values.
    pub data: Vec<f32>,
}

/// How names in a file map to ferrozero's (Hugging Face) parameter names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Naming {
    /// Names are used as stored.
    Exact,
    /// GPT-2 files from older exports lack the `transformer.` prefix (`h.0.attn.c_attn.weight`);
    /// it is added to every name except `lm_head.*`.
    Gpt2,
}

impl Naming {
    /// The canonical name for `stored`.
    pub fn canonical(self, stored: &str) -> String {
        match self {
            Naming::Gpt2
                if !stored.starts_with("transformer.") && !stored.starts_with("lm_head.") =>
            {
                format!("transformer.{stored}")
            }
            _ => stored.to_string(),
        }
    }
}

fn file_err(path: &Path, reason: impl ToString) -> Error {
    Error::File {
        path: path.display().to_string(),
        reason: reason.to_string(),
    }
}

fn encode(data: &[f32], dtype: DType) -> Vec<u8> {
    match dtype {
        DType::F32 => data.iter().flat_map(|v| v.to_le_bytes()).collect(),
        DType::Bf16 => data
            .iter()
            .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
            .collect(),
        DType::F16 => data
            .iter()
            .flat_map(|&v| f16::from_f32(v).to_le_bytes())
            .collect(),
    }
}

fn st_dtype(dtype: DType) -> Dtype {
    match dtype {
        DType::F32 => Dtype::F32,
        DType::Bf16 => Dtype::BF16,
        DType::F16 => Dtype::F16,
    }
}

/// Writes `tensors` to `path` in `dtype` (rounding to nearest for bf16/f16).
pub fn save(path: &Path, tensors: &[(&str, &[usize], &[f32])], dtype: DType) -> Result<()> {
    let mut seen = std::collections::HashSet::new();
    let mut bufs = Vec::with_capacity(tensors.len());
    for &(name, shape, data) in tensors {
        let n: usize = shape.iter().product();
        if n != data.len() {
            return Err(Error::Shape {
                op: "safetensors save",
                expected: format!("{n} elements for `{name}` of shape {shape:?}"),
                got: format!("{}", data.len()),
            });
        }
        if !seen.insert(name) {
            return Err(file_err(path, format!("tensor `{name}` is listed twice")));
        }
        bufs.push((name, shape.to_vec(), encode(data, dtype)));
    }
    let views = bufs
        .iter()
        .map(|(name, shape, bytes)| {
            TensorView::new(st_dtype(dtype), shape.clone(), bytes)
                .map(|v| (name.to_string(), v))
                .map_err(|e| file_err(path, e))
        })
        .collect::<Result<Vec<_>>>()?;
    safetensors::tensor::serialize_to_file(views, None, path).map_err(|e| file_err(path, e))
}

fn decode(path: &Path, name: &str, view: &TensorView<'_>) -> Result<Vec<f32>> {
    let b = view.data();
    Ok(match view.dtype() {
        Dtype::F32 => b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::BF16 => b
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        Dtype::F16 => b
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        other => {
            return Err(file_err(
                path,
                format!("tensor `{name}` has dtype {other:?}; only F32, BF16 and F16 load"),
            ))
        }
    })
}

/// Reads every tensor of `path`, widened to f32, sorted by canonical name.
pub fn load(path: &Path, naming: Naming) -> Result<Vec<NamedTensor>> {
    let bytes = std::fs::read(path).map_err(|e| file_err(path, e))?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| file_err(path, e))?;
    let mut out = st
        .iter()
        .map(|(name, view)| {
            let data = decode(path, name, &view)?;
            Ok(NamedTensor {
                name: naming.canonical(name),
                shape: view.shape().to_vec(),
                data,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// Picks, from `tensors`, one tensor per expected `(name, shape)`, in that order. Fails on a
/// missing name or a shape mismatch (naming all missing ones); extra tensors (e.g. GPT-2's
/// `attn.bias` mask buffers) are ignored.
pub fn select(
    path: &Path,
    tensors: Vec<NamedTensor>,
    expected: &[(&str, &[usize])],
) -> Result<Vec<Vec<f32>>> {
    let mut by_name: HashMap<String, NamedTensor> =
        tensors.into_iter().map(|t| (t.name.clone(), t)).collect();
    let missing: Vec<&str> = expected
        .iter()
        .map(|e| e.0)
        .filter(|n| !by_name.contains_key(*n))
        .collect();
    if !missing.is_empty() {
        return Err(file_err(
            path,
            format!("missing tensors: {}", missing.join(", ")),
        ));
    }
    expected
        .iter()
        .map(|&(name, shape)| {
            let t = by_name.remove(name).expect("presence checked above");
            if t.shape != shape {
                return Err(file_err(
                    path,
                    format!(
                        "tensor `{name}` has shape {:?}, the model needs {shape:?}",
                        t.shape
                    ),
                ));
            }
            Ok(t.data)
        })
        .collect()
}
