//! One safetensors file, memory-mapped: the header is parsed and checked against the file's
//! length when it is opened, and a tensor's elements are decoded range by range, so a reader
//! touches only the pages of what it asks for. The pages read are dropped from the mapping
//! again after decoding: they are the file's (the page cache keeps them), and leaving them
//! mapped would count a whole checkpoint in the process's resident set.

use std::collections::BTreeMap;
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};

use memmap2::{Mmap, UncheckedAdvice};
use serde::Deserialize;

use super::{codec, file_err};
use crate::tensor::DType;
use crate::Result;

/// Where one tensor's bytes are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// Element dtype.
    pub dtype: DType,
    /// Shape, row-major.
    pub shape: Vec<usize>,
    /// Byte range in the file (absolute).
    pub bytes: Range<usize>,
}

impl TensorInfo {
    /// Elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

#[derive(Deserialize)]
struct RawEntry {
    dtype: String,
    shape: Vec<usize>,
    data_offsets: (usize, usize),
}

/// A mapped safetensors file.
#[derive(Debug)]
pub struct MappedFile {
    path: PathBuf,
    map: Mmap,
    tensors: BTreeMap<String, TensorInfo>,
}

/// Bytes decoded between releases of the mapped pages (a multiple of every element size).
const DECODE_SLICE: usize = 8 << 20;

/// Headers over this are refused before they are parsed (safetensors' own limit).
const MAX_HEADER: usize = 100 << 20;

impl MappedFile {
    /// Maps `path` and reads its header: every tensor's dtype, shape and byte range checked.
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|e| file_err(path, e))?;
        // SAFETY: the mapping is read-only; a file changed under a running load is outside
        // what any reader of model files can defend against (safetensors maps them too).
        let map = unsafe { Mmap::map(&file) }.map_err(|e| file_err(path, e))?;
        let tensors = parse_header(path, &map)?;
        Ok(Self {
            path: path.to_path_buf(),
            map,
            tensors,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Every tensor, by stored name.
    pub fn tensors(&self) -> &BTreeMap<String, TensorInfo> {
        &self.tensors
    }

    /// Elements `range` of tensor `name` widened to f32. The pages read are released from the
    /// mapping afterwards.
    pub fn read(&self, name: &str, range: Range<usize>) -> Result<Vec<f32>> {
        let t = self
            .tensors
            .get(name)
            .ok_or_else(|| file_err(&self.path, format!("has no tensor `{name}`")))?;
        if range.end > t.numel() || range.start > range.end {
            return Err(file_err(
                &self.path,
                format!(
                    "elements {range:?} of tensor `{name}` asked for; it has {}",
                    t.numel()
                ),
            ));
        }
        let size = t.dtype.size();
        let bytes = t.bytes.start + range.start * size..t.bytes.start + range.end * size;
        // Decoded in slices, each slice's pages released before the next is touched: the
        // tensor's file bytes are never all mapped in beside its f32 copy.
        let mut out = Vec::with_capacity(range.len());
        let mut at = bytes.start;
        while at < bytes.end {
            let end = (at + DECODE_SLICE).min(bytes.end);
            codec::decode_into(&self.map[at..end], t.dtype, &mut out);
            // SAFETY: a shared read-only file mapping: dropping its pages loses nothing, a
            // later access reads them from the file again.
            // Best effort: failing to release only costs resident memory, never a value.
            let _ = unsafe {
                self.map
                    .unchecked_advise_range(UncheckedAdvice::DontNeed, at, end - at)
            };
            at = end;
        }
        Ok(out)
    }
}

fn parse_header(path: &Path, map: &[u8]) -> Result<BTreeMap<String, TensorInfo>> {
    let truncated = |what: String| file_err(path, format!("truncated or not safetensors: {what}"));
    if map.len() < 8 {
        return Err(truncated(format!("{} bytes", map.len())));
    }
    let n = u64::from_le_bytes(map[..8].try_into().expect("8 bytes")) as usize;
    if n > MAX_HEADER {
        return Err(truncated(format!("header length {n} is over {MAX_HEADER}")));
    }
    if 8 + n > map.len() {
        return Err(truncated(format!(
            "header of {n} bytes, the file has {}",
            map.len()
        )));
    }
    let raw: BTreeMap<String, serde_json::Value> = serde_json::from_slice(&map[8..8 + n])
        .map_err(|e| file_err(path, format!("header is not valid JSON: {e}")))?;
    let start = 8 + n;
    let mut out = BTreeMap::new();
    for (name, v) in raw {
        if name == "__metadata__" {
            continue;
        }
        let e: RawEntry = serde_json::from_value(v)
            .map_err(|e| file_err(path, format!("tensor `{name}`: bad header entry: {e}")))?;
        let dtype = codec::parse(&e.dtype).ok_or_else(|| {
            file_err(
                path,
                format!(
                    "tensor `{name}` has dtype {}; only F32, BF16 and F16 load",
                    e.dtype
                ),
            )
        })?;
        let (a, b) = e.data_offsets;
        let numel: usize = e.shape.iter().product();
        if b < a || b - a != numel * dtype.size() {
            return Err(file_err(
                path,
                format!(
                    "tensor `{name}`: data offsets {a}..{b} do not hold shape {:?} of {}",
                    e.shape, e.dtype
                ),
            ));
        }
        if start + b > map.len() {
            return Err(truncated(format!(
                "tensor `{name}` ends at byte {}, the file has {}",
                start + b,
                map.len()
            )));
        }
        let info = TensorInfo {
            dtype,
            shape: e.shape,
            bytes: start + a..start + b,
        };
        out.insert(name, info);
    }
    Ok(out)
}
