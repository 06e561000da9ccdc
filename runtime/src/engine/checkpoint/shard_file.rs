//! One rank's shard file: safetensors written without copying the engine's buffers, and
//! read back range by range (positioned reads), so loading never holds a whole file.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::{Dtype, View};

use super::fsio::io_err;
use crate::{Error, Result};

/// Largest header we accept: a corrupted length must not make us allocate gigabytes.
const MAX_HEADER: u64 = 64 << 20;

/// A tensor's little-endian element bytes: borrowed from memory, or produced when the
/// writer reaches the tensor (state streamed from NVMe).
pub enum Bytes<'a> {
    /// Bytes in memory.
    Borrowed(&'a [u8]),
    /// Bytes copied out of device memory for the save.
    Owned(Vec<u8>),
    /// `len` bytes made on demand, once, in file order.
    Lazy {
        /// Byte count.
        len: usize,
        /// Produces exactly `len` bytes.
        read: Box<dyn Fn() -> Vec<u8> + 'a>,
    },
}

/// A 1-D tensor to write.
pub struct RawTensor<'a> {
    /// Element dtype.
    pub dtype: Dtype,
    /// `[elements]`.
    pub shape: [usize; 1],
    /// Little-endian element bytes.
    pub bytes: Bytes<'a>,
}

impl View for &RawTensor<'_> {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        match &self.bytes {
            Bytes::Borrowed(b) => Cow::Borrowed(b),
            Bytes::Owned(b) => Cow::Borrowed(b),
            Bytes::Lazy { read, .. } => Cow::Owned(read()),
        }
    }
    fn data_len(&self) -> usize {
        match &self.bytes {
            Bytes::Borrowed(b) => b.len(),
            Bytes::Owned(b) => b.len(),
            Bytes::Lazy { len, .. } => *len,
        }
    }
}

/// Writes `tensors` as a safetensors file at `path` and fsyncs it.
pub fn write(
    path: &Path,
    tensors: &[(String, RawTensor<'_>)],
    info: HashMap<String, String>,
) -> Result<()> {
    safetensors::serialize_to_file(
        tensors.iter().map(|(n, t)| (n.as_str(), t)),
        Some(info),
        path,
    )
    .map_err(|e| Error::File {
        path: path.display().to_string(),
        reason: format!("writing safetensors: {e}"),
    })?;
    File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(|e| io_err("fsync", path, e))
}

/// Size and CRC-32C of the file at `path`, and each tensor's CRC-32C, in one pass: the
/// file's checksum is the tensors' combined with the header's (and any gap's).
pub fn checksums(path: &Path) -> Result<(u64, u32, BTreeMap<String, u32>)> {
    let f = ShardFile::open(path)?;
    let len = f
        .file
        .metadata()
        .map_err(|e| io_err("stat", path, e))?
        .len();
    let mut spans: Vec<(u64, u64, &str)> = f
        .tensors
        .iter()
        .map(|(n, t)| {
            let at = |o: usize| f.data_start + o as u64;
            (at(t.data_offsets.0), at(t.data_offsets.1), n.as_str())
        })
        .collect();
    spans.sort();
    let (mut at, mut crc, mut out) = (0u64, 0u32, BTreeMap::new());
    for (start, end, name) in spans.into_iter().chain([(len, len, "")]) {
        if start < at {
            return Err(f.bad(format!("tensor {name} overlaps the bytes before it")));
        }
        crc = crc32c::crc32c_combine(crc, f.crc_of(at..start)?, (start - at) as usize);
        if !name.is_empty() {
            let c = f.crc_of(start..end)?;
            crc = crc32c::crc32c_combine(crc, c, (end - start) as usize);
            out.insert(name.to_string(), c);
        }
        at = end;
    }
    Ok((len, crc, out))
}

/// An open shard file with its parsed header.
pub struct ShardFile {
    path: PathBuf,
    file: File,
    data_start: u64,
    tensors: HashMap<String, TensorInfo>,
}

impl ShardFile {
    /// Opens `path` and checks that every tensor the header lists lies inside the file.
    pub fn open(path: &Path) -> Result<Self> {
        let bad = |reason: String| Error::File {
            path: path.display().to_string(),
            reason,
        };
        let file = File::open(path).map_err(|e| io_err("open shard file", path, e))?;
        let len = file.metadata().map_err(|e| io_err("stat", path, e))?.len();
        let mut n = [0u8; 8];
        file.read_exact_at(&mut n, 0)
            .map_err(|_| bad(format!("truncated: {len} bytes, no safetensors header")))?;
        let n = u64::from_le_bytes(n);
        if n > MAX_HEADER || 8 + n > len {
            return Err(bad(format!(
                "truncated or corrupt: header claims {n} bytes, file has {len}"
            )));
        }
        let mut header = vec![0u8; n as usize];
        file.read_exact_at(&mut header, 8)
            .map_err(|e| io_err("read header of", path, e))?;
        let meta: Metadata = serde_json::from_slice(&header)
            .map_err(|e| bad(format!("corrupt safetensors header: {e}")))?;
        let data_start = 8 + n;
        let tensors: HashMap<String, TensorInfo> = meta
            .tensors()
            .into_iter()
            .map(|(k, v)| (k, v.clone()))
            .collect();
        for (name, t) in &tensors {
            if data_start + t.data_offsets.1 as u64 > len {
                return Err(bad(format!(
                    "truncated: tensor {name} ends at byte {} but the file has {len}",
                    data_start + t.data_offsets.1 as u64
                )));
            }
        }
        Ok(Self {
            path: path.to_path_buf(),
            file,
            data_start,
            tensors,
        })
    }

    /// CRC-32C of the file's bytes `range`, read in bounded chunks.
    fn crc_of(&self, range: Range<u64>) -> Result<u32> {
        let mut buf = vec![0u8; (range.end - range.start).min(1 << 20) as usize];
        let (mut at, mut crc) = (range.start, 0u32);
        while at < range.end {
            let n = (range.end - at).min(buf.len() as u64) as usize;
            self.file
                .read_exact_at(&mut buf[..n], at)
                .map_err(|e| io_err("read", &self.path, e))?;
            crc = crc32c::crc32c_append(crc, &buf[..n]);
            at += n as u64;
        }
        Ok(crc)
    }

    /// The first tensor (by name) whose bytes no longer have the CRC-32C `want` records:
    /// its name, the recorded and the found checksum.
    pub fn changed_tensor(
        &self,
        want: &BTreeMap<String, u32>,
    ) -> Result<Option<(String, u32, u32)>> {
        for (name, &w) in want {
            let Some(t) = self.tensors.get(name) else {
                return Err(self.bad(format!("missing tensor {name}")));
            };
            let at = |o: usize| self.data_start + o as u64;
            let found = self.crc_of(at(t.data_offsets.0)..at(t.data_offsets.1))?;
            if found != w {
                return Ok(Some((name.clone(), w, found)));
            }
        }
        Ok(None)
    }

    fn bad(&self, reason: String) -> Error {
        Error::File {
            path: self.path.display().to_string(),
            reason,
        }
    }

    /// Reads elements `range` of the 1-D tensor `name`, which must have `dtype` and `len`
    /// elements; returns the raw little-endian bytes.
    pub fn read(
        &self,
        name: &str,
        dtype: Dtype,
        len: usize,
        range: Range<usize>,
    ) -> Result<Vec<u8>> {
        let t = self
            .tensors
            .get(name)
            .ok_or_else(|| self.bad(format!("missing tensor {name}")))?;
        if t.dtype != dtype {
            return Err(self.bad(format!(
                "tensor {name} has dtype {:?}, expected {dtype:?}",
                t.dtype
            )));
        }
        if t.shape != [len] {
            return Err(self.bad(format!(
                "tensor {name} has shape {:?}, expected [{len}]",
                t.shape
            )));
        }
        let size = dtype.bitsize() / 8;
        if t.data_offsets.1.checked_sub(t.data_offsets.0) != Some(len * size) {
            return Err(self.bad(format!(
                "tensor {name} spans bytes {:?}, not {} elements of {dtype:?}",
                t.data_offsets, len
            )));
        }
        if range.end > len {
            return Err(self.bad(format!("read of {range:?} past tensor {name} of {len}")));
        }
        let mut out = vec![0u8; range.len() * size];
        let at = self.data_start + (t.data_offsets.0 + range.start * size) as u64;
        self.file
            .read_exact_at(&mut out, at)
            .map_err(|e| io_err("read tensor data from", &self.path, e))?;
        Ok(out)
    }
}
