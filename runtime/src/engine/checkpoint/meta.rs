//! The checkpoint's metadata file and the names of everything in a checkpoint directory.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::fsio;
use crate::engine::loss_scale::LossScaler;
use crate::engine::partition::GroupLayout;
use crate::tensor::DType;
use crate::{Error, Result};

/// Format identifier written into every metadata file.
pub const FORMAT: &str = "ferrozero-checkpoint";
/// Format version this build writes and reads.
pub const VERSION: u32 = 1;
/// The metadata file inside a tag directory.
pub const META_FILE: &str = "meta.json";
/// The file naming the newest complete tag.
pub const LATEST_FILE: &str = "latest";
/// The folder in a tag holding the model directory's `config.json` and tokenizer files, when
/// the run had them (absent in older checkpoints and runs from presets).
pub const MODEL_DIR: &str = "model";

/// The metadata of one checkpoint.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CheckpointMeta {
    /// Always [`FORMAT`].
    pub format: String,
    /// Format version.
    pub version: u32,
    /// The tag.
    pub tag: String,
    /// Optimizer steps taken (skipped ones included).
    pub step: u64,
    /// The caller's data position.
    pub data_position: u64,
    /// Ranks that saved it.
    pub world_size: usize,
    /// ZeRO stage number it was saved at.
    pub stage: u8,
    /// Storage dtype of the parameters: `f32`, `bf16` or `f16`.
    pub param_dtype: String,
    /// Whether fp32 master weights were saved (mixed precision).
    pub has_master: bool,
    /// Optimizer moments per element (0 to 2).
    pub moments: usize,
    /// The seed from which every dropout mask derives (the engine's RNG state).
    pub seed: u64,
    /// Loss-scaler state.
    pub scaler: LossScaler,
    /// Learning rate of the next step, for humans (the schedule is a function of `step`).
    pub next_lr: f64,
    /// The resolved config it was trained with.
    pub config: serde_json::Value,
    /// Per group, the flat-buffer layout.
    pub groups: Vec<GroupMeta>,
    /// Where the frozen groups' values come from when the checkpoint does not hold them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frozen_base: Option<FrozenBase>,
    /// Per rank, its shard file.
    pub files: Vec<FileMeta>,
}

/// The model directory a run's frozen parameters were loaded from, named instead of copied,
/// and a fingerprint of their values that a resume checks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FrozenBase {
    /// The directory, as the run named it.
    pub path: String,
    /// The sum of every frozen value, in f64.
    pub sum: f64,
    /// The sum of their squares, in f64.
    pub sum_squares: f64,
}

impl FrozenBase {
    /// Whether `(sum, sum_squares)` is this fingerprint up to summation order (world sizes
    /// add the shards' partial sums differently).
    pub fn matches(&self, (sum, sum_squares): (f64, f64)) -> bool {
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0);
        close(self.sum, sum) && close(self.sum_squares, sum_squares)
    }
}

/// One group's flat-buffer layout.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupMeta {
    /// Parameters in buffer order.
    pub slots: Vec<SlotMeta>,
    /// Real elements.
    pub numel: usize,
    /// Elements per rank's shard (padding included).
    pub shard_len: usize,
    /// Frozen parameters: saved as parameters only (no master weights or moments).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub frozen: bool,
}

/// Where one parameter sits in its group's buffer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotMeta {
    /// Hugging Face-style name.
    pub name: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// First element in the flat buffer.
    pub offset: usize,
    /// Element count.
    pub numel: usize,
}

/// One rank's shard file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileMeta {
    /// File name inside the tag directory.
    pub name: String,
    /// Size in bytes.
    pub bytes: u64,
    /// CRC-32C of the whole file.
    pub crc32c: u32,
    /// CRC-32C of each tensor's bytes, so a corrupt file names the tensor that changed
    /// (absent in checkpoints written before it was recorded).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub tensors: BTreeMap<String, u32>,
}

/// The kinds of tensor a shard file holds per group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorKind {
    /// Parameters in the storage dtype.
    Params,
    /// fp32 master weights.
    Master,
    /// First optimizer moment.
    M,
    /// Second optimizer moment.
    V,
}

impl TensorKind {
    /// The tensor's name in a shard file.
    pub fn tensor_name(self, group: usize) -> String {
        let kind = match self {
            TensorKind::Params => "params",
            TensorKind::Master => "master",
            TensorKind::M => "exp_avg",
            TensorKind::V => "exp_avg_sq",
        };
        format!("group.{group}.{kind}")
    }
}

impl GroupMeta {
    /// Slots packed in order, each as large as its shape, filling the group, and shards that
    /// cover it. The arithmetic is checked: a file's sizes are not to be trusted, and a
    /// product that wrapped would pass the comparison and size a later allocation or slice.
    fn check(&self, world_size: usize) -> std::result::Result<(), String> {
        let mut end = 0usize;
        for s in &self.slots {
            let elems = s.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
            if elems != Some(s.numel) {
                return Err(format!(
                    "`{}` has shape {:?} but {} elements",
                    s.name, s.shape, s.numel
                ));
            }
            if s.offset != end {
                return Err(format!("`{}` starts at {}, not at {end}", s.name, s.offset));
            }
            end = end
                .checked_add(s.numel)
                .ok_or_else(|| format!("`{}` ends past the address space", s.name))?;
        }
        if end != self.numel {
            return Err(format!(
                "slots hold {end} elements, the group {}",
                self.numel
            ));
        }
        match self.shard_len.checked_mul(world_size) {
            Some(covered) if covered >= self.numel => Ok(()),
            _ => Err(format!(
                "{world_size} shards of {} elements do not cover {}",
                self.shard_len, self.numel
            )),
        }
    }

    /// The metadata of an engine group's layout.
    pub fn from_layout(l: &GroupLayout) -> Self {
        Self {
            slots: l
                .slots
                .iter()
                .map(|s| SlotMeta {
                    name: s.name.clone(),
                    shape: s.shape.clone(),
                    offset: s.offset,
                    numel: s.numel,
                })
                .collect(),
            numel: l.numel,
            shard_len: l.shard_len,
            frozen: false,
        }
    }
}

/// The shard file name of `rank`.
pub fn rank_file_name(rank: usize) -> String {
    format!("rank-{rank:05}.safetensors")
}

/// The name a dtype has in the metadata.
pub fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::F32 => "f32",
        DType::Bf16 => "bf16",
        DType::F16 => "f16",
    }
}

/// The dtype a metadata name denotes.
pub fn parse_dtype(s: &str) -> Option<DType> {
    match s {
        "f32" => Some(DType::F32),
        "bf16" => Some(DType::Bf16),
        "f16" => Some(DType::F16),
        _ => None,
    }
}

impl CheckpointMeta {
    /// Reads and checks a tag directory's metadata file.
    pub fn read(tag_dir: &Path) -> Result<Self> {
        let path = tag_dir.join(META_FILE);
        let bytes = fsio::read_file(&path)?;
        let meta: Self = serde_json::from_slice(&bytes).map_err(|e| Error::File {
            path: path.display().to_string(),
            reason: format!("not a valid checkpoint metadata file: {e}"),
        })?;
        meta.check().map_err(|reason| Error::File {
            path: path.display().to_string(),
            reason,
        })?;
        Ok(meta)
    }

    fn check(&self) -> std::result::Result<(), String> {
        if self.format != FORMAT || self.version != VERSION {
            return Err(format!(
                "format {} version {} is not {FORMAT} version {VERSION}",
                self.format, self.version
            ));
        }
        if self.files.len() != self.world_size || self.world_size == 0 {
            return Err(format!(
                "lists {} shard files for world size {}",
                self.files.len(),
                self.world_size
            ));
        }
        if parse_dtype(&self.param_dtype).is_none() {
            return Err(format!("unknown parameter dtype {:?}", self.param_dtype));
        }
        for (i, g) in self.groups.iter().enumerate() {
            g.check(self.world_size)
                .map_err(|why| format!("group {i}: inconsistent layout ({why})"))?;
        }
        Ok(())
    }

    /// The storage dtype of the saved parameters.
    pub fn dtype(&self) -> DType {
        parse_dtype(&self.param_dtype).unwrap_or(DType::F32)
    }

    /// Total real parameter count.
    pub fn parameter_count(&self) -> usize {
        self.groups.iter().map(|g| g.numel).sum()
    }

    /// Every saved parameter with its group's index, groups in order.
    pub fn slots(&self) -> impl Iterator<Item = (usize, &SlotMeta)> {
        (self.groups.iter().enumerate()).flat_map(|(gi, g)| g.slots.iter().map(move |s| (gi, s)))
    }
}
