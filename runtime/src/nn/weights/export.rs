//! Writing a model directory as `save_pretrained` does: `config.json`, the weights in one
//! `model.safetensors` or in shards of at most a size with `model.safetensors.index.json`
//! (`metadata.total_size`, `weight_map`), and the tokenizer files. Tensors are asked for one
//! at a time, so memory stays bounded by the largest one whatever the model's size.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use safetensors::tensor::{Metadata, TensorInfo as StInfo};

use super::model::{CONFIG_FILE, INDEX_FILE, SINGLE_FILE};
use super::{codec, file_err, st_dtype};
use crate::tensor::DType;
use crate::Result;

/// Hugging Face's default shard limit (`max_shard_size="5GB"`).
pub const DEFAULT_MAX_SHARD_BYTES: u64 = 5_000_000_000;

/// The tokenizer files a model directory carries when it has them.
pub const TOKENIZER_FILES: [&str; 3] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
];

/// The generation defaults `generate` reads (`GenerationConfig.from_pretrained`): carried
/// from the model directory into checkpoints and exports as `save_pretrained` writes it.
pub const GENERATION_CONFIG_FILE: &str = "generation_config.json";

/// The files of a model directory besides its weights (`config.json`, the generation config,
/// tokenizer files), by
/// file name, as bytes: what a run started from a model directory carries into its
/// checkpoints and exports.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ModelFiles {
    /// `(file name, contents)`, `config.json` first when present.
    pub files: Vec<(String, Vec<u8>)>,
    /// The model directory the frozen parameters' values were loaded from, when a run says
    /// so: its checkpoints then name it and keep a fingerprint of those values instead of
    /// copying them (a LoRA run's base model).
    pub base: Option<std::path::PathBuf>,
}

impl ModelFiles {
    /// Reads `config.json`, `generation_config.json` and the tokenizer files that exist in
    /// `dir`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let mut files = Vec::new();
        let names = [CONFIG_FILE, GENERATION_CONFIG_FILE]
            .into_iter()
            .chain(TOKENIZER_FILES);
        for name in names {
            let p = dir.join(name);
            if p.is_file() {
                files.push((
                    name.to_string(),
                    std::fs::read(&p).map_err(|e| file_err(&p, e))?,
                ));
            }
        }
        Ok(Self { files, base: None })
    }
}

/// What [`write_model_dir`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportReport {
    /// Weight files, in order (one means no index).
    pub weight_files: Vec<String>,
    /// Tensor data bytes over all weight files (the index's `metadata.total_size`).
    pub total_size: u64,
    /// Other files written (`config.json`, tokenizer files).
    pub other_files: Vec<String>,
}

/// Writes a model directory at `out` (created if needed): `files`, and the `tensors`
/// (`(name, shape)`, in file order) in `dtype`, whose f32 values `read(i)` gives for tensor
/// `i`. Weights go to one file, or to shards of at most `max_shard_bytes` (a tensor larger
/// than that alone in its shard) with an index. Each file appears by rename once complete.
pub fn write_model_dir(
    out: &Path,
    files: &ModelFiles,
    tensors: &[(String, Vec<usize>)],
    dtype: DType,
    max_shard_bytes: u64,
    read: &mut dyn FnMut(usize) -> Result<Vec<f32>>,
) -> Result<ExportReport> {
    std::fs::create_dir_all(out).map_err(|e| file_err(out, e))?;
    let shards = plan(tensors, dtype, max_shard_bytes);
    let n = shards.len();
    let name = |i: usize| match n {
        1 => SINGLE_FILE.to_string(),
        _ => format!("model-{:05}-of-{n:05}.safetensors", i + 1),
    };
    let mut weight_map = BTreeMap::new();
    let mut total_size = 0u64;
    for (i, range) in shards.iter().enumerate() {
        let file = name(i);
        total_size += write_shard(&out.join(&file), tensors, range.clone(), dtype, read)?;
        for (t, _) in &tensors[range.clone()] {
            weight_map.insert(t.clone(), file.clone());
        }
    }
    // A previous export in the other form would shadow this one for `from_pretrained`.
    let stale = if n == 1 { INDEX_FILE } else { SINGLE_FILE };
    remove_if_present(&out.join(stale))?;
    if n > 1 {
        let index = serde_json::json!({
            "metadata": {"total_size": total_size},
            "weight_map": weight_map,
        });
        let text = serde_json::to_vec_pretty(&index).expect("JSON values serialise");
        write_atomic(&out.join(INDEX_FILE), &text)?;
    }
    for (f, bytes) in &files.files {
        write_atomic(&out.join(f), bytes)?;
    }
    Ok(ExportReport {
        weight_files: (0..n).map(name).collect(),
        total_size,
        other_files: files.files.iter().map(|(f, _)| f.clone()).collect(),
    })
}

/// Tensor ranges per shard: in order, a new shard when the next tensor would pass the limit.
fn plan(tensors: &[(String, Vec<usize>)], dtype: DType, limit: u64) -> Vec<std::ops::Range<usize>> {
    let mut shards = Vec::new();
    let (mut first, mut bytes) = (0, 0u64);
    for (i, (_, shape)) in tensors.iter().enumerate() {
        let b = (shape.iter().product::<usize>() * dtype.size()) as u64;
        if i > first && bytes + b > limit {
            shards.push(first..i);
            (first, bytes) = (i, 0);
        }
        bytes += b;
    }
    shards.push(first..tensors.len());
    shards
}

/// Writes one safetensors file of `tensors[range]`; returns its data bytes.
fn write_shard(
    path: &Path,
    tensors: &[(String, Vec<usize>)],
    range: std::ops::Range<usize>,
    dtype: DType,
    read: &mut dyn FnMut(usize) -> Result<Vec<f32>>,
) -> Result<u64> {
    let mut infos = Vec::new();
    let mut offset = 0;
    for (name, shape) in &tensors[range.clone()] {
        let len = shape.iter().product::<usize>() * dtype.size();
        let info = StInfo {
            dtype: st_dtype(dtype),
            shape: shape.clone(),
            data_offsets: (offset, offset + len),
        };
        infos.push((name.clone(), info));
        offset += len;
    }
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    let header = Metadata::new(Some(meta), infos)
        .map_err(|e| file_err(path, format!("tensors do not form a header: {e}")))?;
    let mut header = serde_json::to_vec(&header).expect("headers serialise");
    // safetensors aligns the data start to 8 bytes with trailing spaces.
    header.resize(header.len().next_multiple_of(8), b' ');
    let tmp = partial(path);
    let written = (|| {
        let file = File::create(&tmp).map_err(|e| file_err(&tmp, e))?;
        let mut w = BufWriter::with_capacity(1 << 20, file);
        let mut put = |b: &[u8]| w.write_all(b).map_err(|e| file_err(&tmp, e));
        put(&(header.len() as u64).to_le_bytes())?;
        put(&header)?;
        let mut buf = Vec::new();
        for i in range {
            let vals = read(i)?;
            let want: usize = tensors[i].1.iter().product();
            if vals.len() != want {
                return Err(file_err(
                    path,
                    format!(
                        "tensor `{}`: {} values given for shape {:?}",
                        tensors[i].0,
                        vals.len(),
                        tensors[i].1
                    ),
                ));
            }
            buf.clear();
            codec::encode_into(&vals, dtype, &mut buf);
            put(&buf)?;
        }
        let file = w.into_inner().map_err(|e| file_err(&tmp, e.into_error()))?;
        file.sync_all().map_err(|e| file_err(&tmp, e))
    })();
    finish(&tmp, path, written)?;
    Ok(offset as u64)
}

fn partial(path: &Path) -> std::path::PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(".partial");
    s.into()
}

/// Renames `tmp` over `path` when `written` succeeded; removes it otherwise.
fn finish(tmp: &Path, path: &Path, written: Result<()>) -> Result<()> {
    if let Err(e) = written {
        // Best effort: the partial file is useless, and the error says what failed.
        let _ = std::fs::remove_file(tmp);
        return Err(e);
    }
    std::fs::rename(tmp, path).map_err(|e| file_err(path, e))
}

fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = partial(path);
    let written = std::fs::write(&tmp, bytes).map_err(|e| file_err(&tmp, e));
    finish(&tmp, path, written)
}

fn remove_if_present(path: &Path) -> Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(file_err(path, e)),
        _ => Ok(()),
    }
}
