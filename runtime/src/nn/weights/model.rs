//! A model's weights as Hugging Face ships them: a directory (`config.json` with
//! `model.safetensors`, or `model.safetensors.index.json` and its shards), a lone index, or a
//! lone `.safetensors` file. Every file is mapped, never read whole; tensors are found by
//! canonical name and decoded range by range.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::mapped::{MappedFile, TensorInfo};
use super::{file_err, Naming, ParamSource};
use crate::Result;

/// The single-file weights name in a model directory.
pub const SINGLE_FILE: &str = "model.safetensors";
/// The index name in a model directory.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// The model's config in a model directory.
pub const CONFIG_FILE: &str = "config.json";

#[derive(Deserialize)]
struct Index {
    weight_map: BTreeMap<String, String>,
}

/// Mapped model weights, by canonical name.
#[derive(Debug)]
pub struct ModelWeights {
    origin: PathBuf,
    config: Option<PathBuf>,
    files: Vec<MappedFile>,
    /// Canonical name to (file, stored name).
    names: BTreeMap<String, (usize, String)>,
}

impl ModelWeights {
    /// Opens a model directory, an index file or a single safetensors file; names are
    /// normalised by `naming`. Every shard is mapped and its header checked here.
    pub fn open(path: &Path, naming: Naming) -> Result<Self> {
        let meta = std::fs::metadata(path).map_err(|e| file_err(path, e))?;
        let (weights, config) = if meta.is_dir() {
            let config = Some(path.join(CONFIG_FILE)).filter(|p| p.is_file());
            let index = path.join(INDEX_FILE);
            let single = path.join(SINGLE_FILE);
            if index.is_file() {
                (index, config)
            } else if single.is_file() {
                (single, config)
            } else {
                return Err(file_err(
                    path,
                    format!(
                        "a model directory needs {SINGLE_FILE} or {INDEX_FILE}; it has neither"
                    ),
                ));
            }
        } else {
            let sibling = path.parent().map(|d| d.join(CONFIG_FILE));
            (path.to_path_buf(), sibling.filter(|p| p.is_file()))
        };
        let mut model = if weights.to_string_lossy().ends_with(".json") {
            open_index(&weights)?
        } else {
            let f = MappedFile::open(&weights)?;
            let names = f.tensors().keys().map(|n| (n.clone(), (0, n.clone())));
            Self {
                origin: weights.clone(),
                config: None,
                names: names.collect(),
                files: vec![f],
            }
        };
        model.config = config;
        model.rename(naming)?;
        Ok(model)
    }

    fn rename(&mut self, naming: Naming) -> Result<()> {
        let mut out = BTreeMap::new();
        for (stored, at) in std::mem::take(&mut self.names) {
            let canonical = naming.canonical(&stored);
            if let Some((_, other)) = out.insert(canonical.clone(), at) {
                return Err(file_err(
                    &self.origin,
                    format!("tensors `{other}` and `{stored}` both name `{canonical}`"),
                ));
            }
        }
        self.names = out;
        Ok(())
    }

    /// The path the weights were opened from (the index or the single file).
    pub fn origin(&self) -> &Path {
        &self.origin
    }

    /// Canonical names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.names.keys().map(String::as_str)
    }

    /// Where tensor `name` lives: its file and its header entry.
    pub fn info(&self, name: &str) -> Option<(&MappedFile, &TensorInfo)> {
        let (fi, stored) = self.names.get(name)?;
        let f = &self.files[*fi];
        Some((f, &f.tensors()[stored]))
    }

    /// Bytes of the largest tensor once widened to f32 (what one tensor in flight costs).
    pub fn largest_f32_bytes(&self) -> usize {
        let each = self.names.keys().filter_map(|n| self.info(n));
        each.map(|(_, t)| t.numel() * 4).max().unwrap_or(0)
    }
}

/// Opens an index and every shard it names, checking that each shard holds what the index
/// maps to it.
fn open_index(index: &Path) -> Result<ModelWeights> {
    let text = std::fs::read_to_string(index).map_err(|e| file_err(index, e))?;
    let parsed: Index = serde_json::from_str(&text)
        .map_err(|e| file_err(index, format!("not a safetensors index: {e}")))?;
    let dir = index.parent().unwrap_or(Path::new("."));
    let mut by_file: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (name, file) in &parsed.weight_map {
        by_file.entry(file).or_default().push(name);
    }
    let mut files = Vec::new();
    let mut names = BTreeMap::new();
    for (file, tensors) in by_file {
        let path = dir.join(file);
        if !path.is_file() {
            return Err(file_err(
                &path,
                format!(
                    "missing shard: {} maps {} tensors to it, e.g. `{}`",
                    index.display(),
                    tensors.len(),
                    tensors[0]
                ),
            ));
        }
        let f = MappedFile::open(&path)?;
        if let Some(t) = tensors.iter().find(|t| !f.tensors().contains_key(**t)) {
            return Err(file_err(
                &path,
                format!(
                    "lacks tensor `{t}`, which {} maps to this shard",
                    index.display()
                ),
            ));
        }
        for t in tensors {
            names.insert(t.to_string(), (files.len(), t.to_string()));
        }
        files.push(f);
    }
    Ok(ModelWeights {
        origin: index.to_path_buf(),
        config: None,
        files,
        names,
    })
}

/// Buffers some exports carry beside the parameters (GPT-2's causal masks, old Llama RoPE
/// tables) and GPT-2's `lm_head.weight`, a copy of the tied embedding.
fn ignorable(name: &str) -> bool {
    [".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq"]
        .iter()
        .any(|s| name.ends_with(s))
        || name == "lm_head.weight"
}

impl ParamSource for ModelWeights {
    fn check(&self, expected: &[(&str, &[usize])]) -> Result<()> {
        let by_config = match &self.config {
            Some(c) => format!("the model {} describes", c.display()),
            None => "the model".to_string(),
        };
        let missing: Vec<&str> = expected
            .iter()
            .map(|e| e.0)
            .filter(|n| !self.names.contains_key(*n))
            .collect();
        if !missing.is_empty() {
            return Err(file_err(
                &self.origin,
                format!(
                    "lacks {} tensors of {by_config}: {}",
                    missing.len(),
                    missing.join(", ")
                ),
            ));
        }
        for &(name, shape) in expected {
            let (f, t) = self.info(name).expect("presence checked above");
            if t.shape != shape {
                return Err(file_err(
                    f.path(),
                    format!(
                        "tensor `{name}` has shape {:?}; {by_config} needs {shape:?}",
                        t.shape
                    ),
                ));
            }
        }
        let wanted: HashMap<&str, ()> = expected.iter().map(|e| (e.0, ())).collect();
        if let Some(extra) = self
            .names()
            .find(|n| !wanted.contains_key(n) && !ignorable(n))
        {
            let (f, _) = self.info(extra).expect("listed name");
            return Err(file_err(
                f.path(),
                format!("tensor `{extra}` is not a parameter of {by_config}"),
            ));
        }
        Ok(())
    }

    fn read(&self, name: &str, range: Range<usize>) -> Result<Vec<f32>> {
        let (fi, stored) = self
            .names
            .get(name)
            .ok_or_else(|| file_err(&self.origin, format!("has no tensor `{name}`")))?;
        self.files[*fi].read(stored, range)
    }
}
