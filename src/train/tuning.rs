//! What of a model trains: all of it, what `--freeze` rules leave, or LoRA adapters from a
//! PEFT config or adapter directory (`--peft`); how the weights load under each, and what
//! `--output` writes (a model directory, a PEFT adapter directory, or with `--merge` the
//! model with its adapters merged in).

use std::path::Path;

use crate::engine::{Engine, NamedTensor};
use ferrozero_runtime::nn::freeze::Freeze;
use ferrozero_runtime::nn::hf::HfModel;
use ferrozero_runtime::nn::peft::{is_adapter_param, PeftRun};
use ferrozero_runtime::nn::weights::{ModelFiles, ParamSource};
use ferrozero_runtime::nn::Model;
use ferrozero_runtime::tensor::DType;
use ferrozero_runtime::{Error, Result};

/// What trains.
#[derive(Debug, Clone)]
pub enum Tuning {
    /// Every parameter.
    Full,
    /// Every parameter the rules leave unfrozen.
    Frozen(Freeze),
    /// LoRA adapters (and `modules_to_save`); the base is frozen.
    Lora(Box<PeftRun>),
}

impl Tuning {
    /// From `--peft PATH` and `--freeze PATTERN`s, checked against `base`; the two do not
    /// combine (PEFT decides what trains beside its adapters: `modules_to_save`).
    pub fn from_args(peft: Option<&Path>, freeze: &[String], base: &HfModel) -> Result<Self> {
        match (peft, freeze.is_empty()) {
            (Some(_), false) => Err(Error::Config(
                "--peft and --freeze do not combine: a PEFT adapter freezes every base \
                 parameter; train more of the model with its `modules_to_save`"
                    .into(),
            )),
            (Some(path), true) => Ok(Self::Lora(Box::new(PeftRun::open(path, base)?))),
            (None, false) => {
                let f = Freeze::new(freeze)?;
                base.build()?.freeze(f.clone())?;
                Ok(Self::Frozen(f))
            }
            (None, true) => Ok(Self::Full),
        }
    }

    /// The model to train.
    pub fn build(&self, base: &HfModel) -> Result<Model> {
        match self {
            Self::Full => base.build(),
            Self::Frozen(f) => base.build()?.freeze(f.clone()),
            Self::Lora(run) => run.build(),
        }
    }

    /// Loads the base model's weights from `src` into `engine`, then an adapter directory's
    /// weights over them; new adapters keep PEFT's initialisation.
    pub fn load(&self, engine: &mut Engine, src: &dyn ParamSource) -> Result<()> {
        match self {
            Self::Lora(_) => engine.load_parameters_where(src, &|n| !is_adapter_param(n))?,
            _ => engine.load_parameters(src)?,
        }
        self.start(engine)
    }

    /// Sets an adapter directory's weights (a run without base weights to load calls this
    /// alone); nothing for new adapters or the other kinds.
    pub fn start(&self, engine: &mut Engine) -> Result<()> {
        let start = match self {
            Self::Lora(run) => run.start_values(),
            _ => Vec::new(),
        };
        match start.is_empty() {
            true => Ok(()),
            false => engine.set_parameters(&start),
        }
    }

    /// The files checkpoints carry: the model directory's, and a LoRA run's adapter config
    /// (so `ferrozero checkpoint consolidate` writes the adapter PEFT loads). With frozen
    /// parameters, `dir` (the model directory they were loaded from) is named as their base:
    /// checkpoints keep their fingerprint instead of copying them.
    pub fn model_files(&self, files: &ModelFiles, dir: &Path) -> ModelFiles {
        let mut out = files.clone();
        if let Self::Lora(run) = self {
            let name = ferrozero_runtime::nn::peft::ADAPTER_CONFIG_FILE.to_string();
            out.files.push((name, run.config_json().into_bytes()));
        }
        if !matches!(self, Self::Full) {
            out.base = Some(std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf()));
        }
        out
    }

    /// Writes `--output` (collective: every rank calls it; rank 0 writes): a model directory
    /// with `files`, or for LoRA a PEFT adapter directory, or with `merge` the merged model.
    pub fn write_output(
        &self,
        engine: &Engine,
        out: &Path,
        files: &ModelFiles,
        merge: bool,
    ) -> Result<()> {
        let params = match (self, merge) {
            (Self::Lora(_), false) => engine.trainable_parameters()?,
            (Self::Lora(run), true) => run.merged(engine.parameters()?)?,
            (_, true) => {
                return Err(Error::Config(
                    "--merge merges LoRA adapters into the model: it needs --peft".into(),
                ))
            }
            (_, false) => engine.parameters()?,
        };
        if engine.rank() != 0 {
            return Ok(());
        }
        match (self, merge) {
            (Self::Lora(run), false) => run.write(out, &params, DType::F32),
            _ => super::write_output(out, files, &in_model_order(engine.model(), params)),
        }
    }
}

/// Parameters in the model's declaration order (the engine keeps frozen ones in groups of
/// their own), so an output does not depend on what was frozen.
fn in_model_order(model: &Model, mut params: Vec<NamedTensor>) -> Vec<NamedTensor> {
    let order: std::collections::HashMap<String, usize> = (model.param_names().into_iter())
        .enumerate()
        .map(|(i, n)| (n, i))
        .collect();
    params.sort_by_key(|t| order.get(&t.name).copied().unwrap_or(usize::MAX));
    params
}
