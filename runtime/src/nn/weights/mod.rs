//! Model weights in safetensors files, as Hugging Face ships and loads them.
//!
//! Reading: [`ModelWeights`] maps a model directory, an index with its shards, or a single file
//! (`mapped.rs` per file, `model.rs` for the layouts) and implements [`ParamSource`], through
//! which the engine loads each rank's part of each tensor; [`load`] and [`select`] give whole
//! f32 lists for small models and tests. Writing: [`save`] (one file from f32 lists) and
//! [`write_model_dir`] (`export.rs`: what `save_pretrained` writes, sharded with an index).
//! Files hold f32, bf16 or f16; loading widens to f32 exactly, so a file written here and read
//! back reproduces every value bit for bit.

mod codec;
mod export;
mod mapped;
mod model;

use std::collections::HashMap;
use std::ops::Range;
use std::path::Path;

use safetensors::tensor::{Dtype, TensorView};

pub use export::{
    write_model_dir, ExportReport, ModelFiles, DEFAULT_MAX_SHARD_BYTES, TOKENIZER_FILES,
};
pub use mapped::{MappedFile, TensorInfo};
pub use model::{ModelWeights, CONFIG_FILE, INDEX_FILE, SINGLE_FILE};

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

pub(crate) fn file_err(path: &Path, reason: impl ToString) -> Error {
    Error::File {
        path: path.display().to_string(),
        reason: reason.to_string(),
    }
}

fn st_dtype(dtype: DType) -> Dtype {
    match dtype {
        DType::F32 => Dtype::F32,
        DType::Bf16 => Dtype::BF16,
        DType::F16 => Dtype::F16,
    }
}

/// Where parameter values come from when the engine loads them tensor by tensor
/// ([`crate::engine::Engine::load_parameters`]).
pub trait ParamSource {
    /// Checks that the source holds exactly the `(name, shape)` parameters the model has
    /// (buffers a source may ignore aside), naming the file and tensor of the first problem.
    fn check(&self, expected: &[(&str, &[usize])]) -> Result<()>;
    /// Elements `range` of the row-major tensor `name`, widened to f32.
    fn read(&self, name: &str, range: Range<usize>) -> Result<Vec<f32>>;
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
        let mut bytes = Vec::new();
        codec::encode_into(data, dtype, &mut bytes);
        bufs.push((name, shape.to_vec(), bytes));
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

/// Reads every tensor of a model (a directory, an index or a single file), widened to f32,
/// sorted by canonical name. This holds the whole model in f32: the engine loads through
/// [`ModelWeights`] and [`ParamSource`] instead, tensor by tensor.
pub fn load(path: &Path, naming: Naming) -> Result<Vec<NamedTensor>> {
    let model = ModelWeights::open(path, naming)?;
    let names: Vec<String> = model.names().map(str::to_string).collect();
    names
        .into_iter()
        .map(|name| {
            let (_, info) = model.info(&name).expect("listed name");
            let shape = info.shape.clone();
            let data = model.read(&name, 0..info.numel())?;
            Ok(NamedTensor { name, shape, data })
        })
        .collect()
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
