//! A LoRA run's checkpoint out as PEFT and transformers read it: the run carries its
//! adapter's config beside the base model's `config.json` (`TAG/model/`), so the adapters
//! and `modules_to_save` come out as a PEFT adapter directory, or merged into the base
//! weights as a plain model directory.

use std::path::Path;

use super::{CheckpointReader, OutputDType, Tag};
use crate::nn::hf::HfModel;
use crate::nn::peft::{is_adapter_param, LoraConfig, PeftRun, ADAPTER_CONFIG_FILE};
use crate::nn::weights::{write_model_dir, ExportReport, NamedTensor, CONFIG_FILE};
use crate::{Error, Result};

/// The LoRA adapter the run of `reader`'s checkpoint trained, when its files carry one.
pub fn checkpoint_adapter(reader: &CheckpointReader) -> Result<Option<PeftRun>> {
    let files = reader.model_files()?;
    let text = |name: &str| {
        (files.files.iter())
            .find(|(n, _)| n == name)
            .map(|(_, b)| String::from_utf8_lossy(b).into_owned())
    };
    let Some(adapter) = text(ADAPTER_CONFIG_FILE) else {
        return Ok(None);
    };
    let origin = |f: &str| format!("{}/model/{f}", reader.tag_dir().display());
    let base = text(CONFIG_FILE).ok_or_else(|| Error::File {
        path: origin(CONFIG_FILE),
        reason: "missing: the checkpoint carries a LoRA adapter but not its base model's config"
            .into(),
    })?;
    let hf = HfModel::from_json(&base, &origin(CONFIG_FILE))?;
    let lora = LoraConfig::from_json(&adapter, &origin(ADAPTER_CONFIG_FILE))?;
    PeftRun::new(lora, &hf).map(Some)
}

fn adapter_of(reader: &CheckpointReader) -> Result<PeftRun> {
    checkpoint_adapter(reader)?.ok_or_else(|| Error::File {
        path: reader.tag_dir().display().to_string(),
        reason: "not a LoRA run's checkpoint (its files carry no adapter_config.json)".into(),
    })
}

/// Every saved tensor `pick` names, read whole.
fn read_named(reader: &CheckpointReader, pick: &dyn Fn(&str) -> bool) -> Result<Vec<NamedTensor>> {
    (reader.meta().slots())
        .filter(|(_, s)| pick(&s.name))
        .map(|(gi, s)| {
            Ok(NamedTensor {
                name: s.name.clone(),
                shape: s.shape.clone(),
                data: reader.read_values(gi, s.offset..s.offset + s.numel)?,
            })
        })
        .collect()
}

/// Writes the checkpoint's adapter as a PEFT adapter directory `out`
/// (`PeftModel.from_pretrained(base, out)` loads it); returns the tensors written.
pub fn export_adapter(dir: &Path, tag: &Tag, out: &Path, dtype: OutputDType) -> Result<usize> {
    let reader = CheckpointReader::open(dir, tag)?;
    reader.verify_all()?;
    let run = adapter_of(&reader)?;
    let params = read_named(&reader, &|n| is_adapter_param(n) || run.config.saves(n))?;
    run.write(out, &params, dtype.into())?;
    Ok(params.len())
}

/// Writes the checkpoint's model with its adapters merged in (PEFT's `merge_and_unload`) as
/// a model directory: the base weights one tensor at a time, each adapted one with
/// `scaling · B A` added.
pub fn export_merged(
    dir: &Path,
    tag: &Tag,
    out: &Path,
    dtype: OutputDType,
    max_shard_bytes: u64,
) -> Result<ExportReport> {
    let reader = CheckpointReader::open(dir, tag)?;
    reader.verify_all()?;
    let run = adapter_of(&reader)?;
    let factors = read_named(&reader, &|n| is_adapter_param(n) || run.config.saves(n))?;
    let weights = run.weights_of(&factors)?;
    let mut files = reader.model_files()?;
    files.files.retain(|(n, _)| n != ADAPTER_CONFIG_FILE);
    let slots: Vec<(usize, &super::SlotMeta)> = (reader.meta().slots())
        .filter(|(_, s)| !is_adapter_param(&s.name))
        .collect();
    let tensors: Vec<(String, Vec<usize>)> = (slots.iter())
        .map(|(_, s)| (s.name.clone(), s.shape.clone()))
        .collect();
    let mut read = |i: usize| {
        let (gi, s) = slots[i];
        let mut v = reader.read_values(gi, s.offset..s.offset + s.numel)?;
        let module = s.name.strip_suffix(".weight").unwrap_or("");
        if let Some(ad) = run.adapters.iter().find(|a| a.site.name == module) {
            let f = &weights.lora[module];
            crate::nn::peft::merge_into(&mut v, run.conv1d(), ad, f);
        }
        Ok(v)
    };
    write_model_dir(
        out,
        &files,
        &tensors,
        dtype.into(),
        max_shard_bytes,
        &mut read,
    )
}
