//! Consolidation: one Hugging Face-named safetensors file of full parameters from a sharded
//! checkpoint, written one parameter at a time so memory stays bounded by the largest one.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use half::bf16;
use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::Dtype;

use super::fsio::{self, io_err};
use super::meta::{CheckpointMeta, SlotMeta};
use super::reader::CheckpointReader;
use super::Tag;
use crate::nn::weights::{write_model_dir, ExportReport};
use crate::tensor::DType;
use crate::{Error, Result};

/// The dtype of consolidated weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputDType {
    /// 32-bit floats (the fp32 master values).
    F32,
    /// bfloat16, rounded to nearest even from fp32.
    Bf16,
}

impl OutputDType {
    fn st(self) -> Dtype {
        match self {
            OutputDType::F32 => Dtype::F32,
            OutputDType::Bf16 => Dtype::BF16,
        }
    }

    fn encode(self, vals: &[f32], out: &mut Vec<u8>) {
        out.clear();
        match self {
            OutputDType::F32 => vals.iter().for_each(|v| out.extend(v.to_le_bytes())),
            OutputDType::Bf16 => vals
                .iter()
                .for_each(|v| out.extend(bf16::from_f32(*v).to_le_bytes())),
        }
    }
}

/// What [`consolidate`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsolidateReport {
    /// Tensors written.
    pub tensors: usize,
    /// Parameter elements written.
    pub elements: usize,
    /// Bytes of the output file.
    pub bytes: u64,
}

/// Writes the full parameters of checkpoint `tag` in `dir` to `out` (verifying every shard
/// file first). The file appears by rename only once complete.
pub fn consolidate(
    dir: impl AsRef<Path>,
    tag: &Tag,
    out: impl AsRef<Path>,
    dtype: OutputDType,
) -> Result<ConsolidateReport> {
    let out = out.as_ref();
    let reader = CheckpointReader::open(dir, tag)?;
    reader.verify_all()?;
    let meta = reader.meta();
    let (header, tensors, data_bytes) = header(meta, dtype)?;
    let tmp = out.with_extension("safetensors.partial");
    if let Err(e) = write_file(&reader, &header, dtype, &tmp) {
        // Best effort: the partial file is useless, and the error says what failed.
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::rename(&tmp, out).map_err(|e| io_err("rename into place", out, e))?;
    fsio::sync_dir(
        out.parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new(".")),
    )?;
    Ok(ConsolidateReport {
        tensors,
        elements: meta.parameter_count(),
        bytes: 8 + header.len() as u64 + data_bytes as u64,
    })
}

impl From<OutputDType> for DType {
    fn from(d: OutputDType) -> Self {
        match d {
            OutputDType::F32 => DType::F32,
            OutputDType::Bf16 => DType::Bf16,
        }
    }
}

/// Writes checkpoint `tag` of `dir` as a model directory `out` (what `save_pretrained`
/// writes): the `config.json` and tokenizer files the run carried, and the full parameters
/// in `dtype`, in one file or in shards of at most `max_shard_bytes` with an index. Every
/// shard file is verified first; one parameter is in memory at a time.
pub fn consolidate_dir(
    dir: impl AsRef<Path>,
    tag: &Tag,
    out: impl AsRef<Path>,
    dtype: OutputDType,
    max_shard_bytes: u64,
) -> Result<ExportReport> {
    let reader = CheckpointReader::open(dir, tag)?;
    reader.verify_all()?;
    let files = reader.model_files()?;
    let slots: Vec<(usize, &SlotMeta)> = reader.meta().slots().collect();
    let tensors: Vec<(String, Vec<usize>)> = (slots.iter())
        .map(|(_, s)| (s.name.clone(), s.shape.clone()))
        .collect();
    let mut read = |i: usize| {
        let (gi, s) = slots[i];
        reader.read_values(gi, s.offset..s.offset + s.numel)
    };
    write_model_dir(
        out.as_ref(),
        &files,
        &tensors,
        dtype.into(),
        max_shard_bytes,
        &mut read,
    )
}

/// The safetensors header (padded) for every parameter in layout order, the tensor count and
/// the data bytes that follow it.
fn header(meta: &CheckpointMeta, dtype: OutputDType) -> Result<(Vec<u8>, usize, usize)> {
    let size = dtype.st().bitsize() / 8;
    let mut infos = Vec::new();
    let mut offset = 0;
    for s in meta.groups.iter().flat_map(|g| &g.slots) {
        infos.push((
            s.name.clone(),
            TensorInfo {
                dtype: dtype.st(),
                shape: s.shape.clone(),
                data_offsets: (offset, offset + s.numel * size),
            },
        ));
        offset += s.numel * size;
    }
    let tensors = infos.len();
    let info = std::collections::HashMap::from([
        ("format".to_string(), "pt".to_string()),
        ("ferrozero_step".to_string(), meta.step.to_string()),
    ]);
    let header = Metadata::new(Some(info), infos).map_err(|e| {
        Error::Invalid(format!(
            "checkpoint layout does not form a safetensors header: {e}"
        ))
    })?;
    let mut header = serde_json::to_vec(&header)
        .map_err(|e| Error::Invalid(format!("header does not serialise: {e}")))?;
    // safetensors aligns the data start to 8 bytes with trailing spaces.
    header.resize(header.len().next_multiple_of(8), b' ');

    Ok((header, tensors, offset))
}

/// Writes header and data to `tmp` and fsyncs it.
fn write_file(
    reader: &CheckpointReader,
    header: &[u8],
    dtype: OutputDType,
    tmp: &Path,
) -> Result<()> {
    let meta = reader.meta();
    let file = File::create(tmp).map_err(|e| io_err("create", tmp, e))?;
    let mut w = BufWriter::with_capacity(1 << 20, file);
    let write =
        |w: &mut BufWriter<File>, b: &[u8]| w.write_all(b).map_err(|e| io_err("write", tmp, e));
    write(&mut w, &(header.len() as u64).to_le_bytes())?;
    write(&mut w, header)?;
    let mut buf = Vec::new();
    for (gi, g) in meta.groups.iter().enumerate() {
        for s in &g.slots {
            let vals = reader.read_values(gi, s.offset..s.offset + s.numel)?;
            dtype.encode(&vals, &mut buf);
            write(&mut w, &buf)?;
        }
    }
    let file = w
        .into_inner()
        .map_err(|e| io_err("write", tmp, e.into_error()))?;
    file.sync_all().map_err(|e| io_err("fsync", tmp, e))?;
    Ok(())
}
