//! Reading a saved checkpoint by group, kind and element range, whatever world size wrote it:
//! a range of the unpadded buffer is assembled from the shard files that cover it.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use half::{bf16, f16};
use safetensors::Dtype;

use super::fsio;
use super::meta::{CheckpointMeta, TensorKind, LATEST_FILE};
use super::shard_file::ShardFile;
use super::Tag;
use crate::nn::hf::HfModel;
use crate::nn::weights::{ModelWeights, Naming, ParamSource, CONFIG_FILE};
use crate::tensor::DType;
use crate::{Error, Result};

/// A checkpoint opened for reading; shard files open lazily.
pub struct CheckpointReader {
    dir: PathBuf,
    meta: CheckpointMeta,
    files: Vec<OnceLock<ShardFile>>,
    /// The base model frozen values are read from when the checkpoint names it.
    base: OnceLock<std::result::Result<ModelWeights, String>>,
}

/// Resolves `tag` in `dir` to a tag name (reading `latest` for [`Tag::Latest`]).
pub fn resolve_tag(dir: &Path, tag: &Tag) -> Result<String> {
    match tag {
        Tag::Named(t) => Ok(t.clone()),
        Tag::Latest => {
            let path = dir.join(LATEST_FILE);
            let bytes = fsio::read_file(&path)?;
            let t = String::from_utf8(bytes).map_err(|_| Error::File {
                path: path.display().to_string(),
                reason: "does not hold a UTF-8 tag name".into(),
            })?;
            Ok(t.trim().to_string())
        }
    }
}

/// The element type of a dtype in safetensors terms.
pub fn st_dtype(d: DType) -> Dtype {
    match d {
        DType::F32 => Dtype::F32,
        DType::Bf16 => Dtype::BF16,
        DType::F16 => Dtype::F16,
    }
}

/// Decodes little-endian element bytes of `d` to f32.
pub fn bytes_to_f32(d: DType, bytes: &[u8]) -> Vec<f32> {
    match d {
        DType::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        DType::Bf16 => bytes
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        DType::F16 => bytes
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
    }
}

impl CheckpointReader {
    /// Opens tag `tag` of checkpoint directory `dir` (metadata only).
    pub fn open(dir: impl AsRef<Path>, tag: &Tag) -> Result<Self> {
        let dir = dir.as_ref();
        let name = resolve_tag(dir, tag)?;
        let tag_dir = dir.join(&name);
        if !tag_dir.is_dir() {
            return Err(Error::File {
                path: tag_dir.display().to_string(),
                reason: format!("checkpoint tag {name:?} does not exist"),
            });
        }
        let meta = CheckpointMeta::read(&tag_dir)?;
        let files = (0..meta.world_size).map(|_| OnceLock::new()).collect();
        Ok(Self {
            dir: tag_dir,
            meta,
            files,
            base: OnceLock::new(),
        })
    }

    /// The metadata.
    pub fn meta(&self) -> &CheckpointMeta {
        &self.meta
    }

    /// The model directory's files saved with the checkpoint (none for older checkpoints),
    /// and a LoRA run's `adapter_config.json`.
    pub fn model_files(&self) -> Result<crate::nn::weights::ModelFiles> {
        let dir = self.dir.join(super::meta::MODEL_DIR);
        if !dir.is_dir() {
            return Ok(Default::default());
        }
        let mut files = crate::nn::weights::ModelFiles::from_dir(&dir)?;
        let adapter = dir.join(crate::nn::peft::ADAPTER_CONFIG_FILE);
        if adapter.is_file() {
            let bytes = std::fs::read(&adapter).map_err(|e| Error::File {
                path: adapter.display().to_string(),
                reason: e.to_string(),
            })?;
            files
                .files
                .push((crate::nn::peft::ADAPTER_CONFIG_FILE.into(), bytes));
        }
        Ok(files)
    }

    /// The tag directory.
    pub fn tag_dir(&self) -> &Path {
        &self.dir
    }

    /// The path of rank `q`'s shard file.
    pub fn file_path(&self, q: usize) -> PathBuf {
        self.dir.join(&self.meta.files[q].name)
    }

    /// Checks rank `q`'s file against the size and CRC-32C recorded in the metadata.
    pub fn verify_file(&self, q: usize) -> Result<()> {
        let path = self.file_path(q);
        let want = &self.meta.files[q];
        let (size, crc) = fsio::file_crc(&path)?;
        let reason = if size != want.bytes {
            format!("size {size} bytes, the metadata records {}", want.bytes)
        } else if crc != want.crc32c {
            let tensor = ShardFile::open(&path)
                .and_then(|f| f.changed_tensor(&want.tensors))
                .ok()
                .flatten();
            match tensor {
                Some((name, expected, found)) => format!(
                    "checksum mismatch in tensor {name}: CRC-32C {found:08x}, the metadata \
                     records {expected:08x} (file CRC-32C {crc:08x}, recorded {:08x})",
                    want.crc32c
                ),
                None => format!(
                    "checksum mismatch: CRC-32C {crc:08x}, the metadata records {:08x}",
                    want.crc32c
                ),
            }
        } else {
            return Ok(());
        };
        Err(Error::File {
            path: path.display().to_string(),
            reason,
        })
    }

    /// Verifies every shard file; the first failure is returned.
    pub fn verify_all(&self) -> Result<()> {
        (0..self.meta.world_size).try_for_each(|q| self.verify_file(q))
    }

    fn file(&self, q: usize) -> Result<&ShardFile> {
        if let Some(f) = self.files[q].get() {
            return Ok(f);
        }
        let f = ShardFile::open(&self.file_path(q))?;
        Ok(self.files[q].get_or_init(|| f))
    }

    /// Raw bytes of elements `range` (of the unpadded buffer) of group `g`'s tensor `kind`,
    /// in the dtype it was saved with, gathered from the shard files covering the range.
    pub fn read_raw(&self, g: usize, kind: TensorKind, range: Range<usize>) -> Result<Vec<u8>> {
        let gm = self
            .meta
            .groups
            .get(g)
            .ok_or_else(|| Error::Invalid(format!("checkpoint has no group {g}")))?;
        if range.end > gm.numel {
            return Err(Error::Invalid(format!(
                "range {range:?} past group {g}'s {} elements",
                gm.numel
            )));
        }
        let dtype = self.kind_dtype(kind);
        let name = kind.tensor_name(g);
        let mut out = Vec::with_capacity(range.len() * dtype.size());
        let sl = gm.shard_len;
        let mut pos = range.start;
        while pos < range.end {
            let q = pos / sl;
            let end = range.end.min((q + 1) * sl);
            let bytes =
                self.file(q)?
                    .read(&name, st_dtype(dtype), sl, pos - q * sl..end - q * sl)?;
            out.extend_from_slice(&bytes);
            pos = end;
        }
        Ok(out)
    }

    /// The base model a checkpoint's frozen values come from, opened once (an error naming
    /// it when it is gone).
    fn base_weights(&self) -> Result<&ModelWeights> {
        let Some(fb) = &self.meta.frozen_base else {
            return Err(Error::Invalid("the checkpoint names no base model".into()));
        };
        let opened = self.base.get_or_init(|| {
            let files = self.model_files().map_err(|e| e.to_string())?;
            let config = files.files.iter().find(|(n, _)| n == CONFIG_FILE);
            let naming = match config {
                Some((_, b)) => HfModel::from_json(&String::from_utf8_lossy(b), CONFIG_FILE)
                    .map_err(|e| e.to_string())?
                    .naming(),
                None => Naming::Exact,
            };
            ModelWeights::open(Path::new(&fb.path), naming).map_err(|e| e.to_string())
        });
        opened.as_ref().map_err(|e| Error::File {
            path: fb.path.clone(),
            reason: format!(
                "the base model this checkpoint's frozen parameters are read from: {e}"
            ),
        })
    }

    /// Elements `range` of a frozen group the checkpoint names instead of holding, from the
    /// base model, slot by slot (padding reads zero).
    fn read_from_base(&self, g: usize, range: Range<usize>) -> Result<Vec<f32>> {
        let base = self.base_weights()?;
        let mut out = vec![0.0; range.len()];
        for s in &self.meta.groups[g].slots {
            let r = s.offset.max(range.start)..(s.offset + s.numel).min(range.end);
            if r.is_empty() {
                continue;
            }
            let v = base.read(&s.name, r.start - s.offset..r.end - s.offset)?;
            out[r.start - range.start..r.end - range.start].copy_from_slice(&v);
        }
        Ok(out)
    }

    /// The dtype tensors of `kind` were saved in.
    pub fn kind_dtype(&self, kind: TensorKind) -> DType {
        match kind {
            TensorKind::Params => self.meta.dtype(),
            _ => DType::F32,
        }
    }

    /// f32 values of `kind` over `range`.
    pub fn read_f32(&self, g: usize, kind: TensorKind, range: Range<usize>) -> Result<Vec<f32>> {
        let bytes = self.read_raw(g, kind, range)?;
        Ok(bytes_to_f32(self.kind_dtype(kind), &bytes))
    }

    /// The fp32 parameter values over `range`: the master weights when saved, else the
    /// parameters themselves (f32, or a frozen group's in the run's dtype, widened).
    pub fn read_values(&self, g: usize, range: Range<usize>) -> Result<Vec<f32>> {
        let frozen = self.meta.groups.get(g).is_some_and(|m| m.frozen);
        if frozen && self.meta.frozen_base.is_some() {
            return self.read_from_base(g, range);
        }
        let kind = if self.meta.has_master && !frozen {
            TensorKind::Master
        } else {
            TensorKind::Params
        };
        self.read_f32(g, kind, range)
    }
}
