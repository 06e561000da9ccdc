//! The engine's state in and out: named parameters, gradient shards, parameters from a
//! [`ParamSource`], checkpoints. Each entry orders the copy streams first (the optimizer's
//! uploads land before parameters are read or written wholesale) and drops uploads started
//! ahead before shards are rewritten; the work itself is `params.rs`', `load_params.rs`' and
//! `checkpoint/`'s.

use std::path::{Path, PathBuf};

use super::checkpoint::{self, LoadedCheckpoint, Tag};
use super::core::Engine;
use super::params::{GradShard, NamedTensor};
use crate::nn::weights::{ModelFiles, ParamSource};
use crate::{Error, Result};

impl Engine {
    /// Every parameter's fp32 value (collective: every rank must call it).
    pub fn parameters(&self) -> Result<Vec<NamedTensor>> {
        self.await_landings()?;
        let stores = (self.opt.nvme.get(), self.params.swap.store());
        super::params::gather_parameters(&self.groups, self.comm.shards(), stores, false)
    }

    /// The fp32 value of every parameter that trains (collective): what a parameter-efficient
    /// run exports (LoRA adapters and `modules_to_save`), without gathering the frozen base.
    pub fn trainable_parameters(&self) -> Result<Vec<NamedTensor>> {
        self.await_landings()?;
        let stores = (self.opt.nvme.get(), self.params.swap.store());
        super::params::gather_parameters(&self.groups, self.comm.shards(), stores, true)
    }

    /// Sets parameters by name from full fp32 values (every rank passes the same values).
    /// Names not in the model are an error; parameters not named keep their values.
    pub fn set_parameters(&mut self, values: &[NamedTensor]) -> Result<()> {
        self.before_writes()?;
        let plan = super::params::plan_values(&self.groups, values)?;
        let rank = self.shard_rank();
        (self.params.swap).settle(&mut self.groups, &mut self.ledger)?;
        let swap = self.params.swap.store_mut();
        super::params::write_plan(&mut self.groups, swap, rank, &plan)
    }

    /// This rank's shard of every group's accumulated gradient, groups in unit order then the
    /// shared group. Read it between `backward` and `step`.
    pub fn gradient_shards(&self) -> Result<Vec<GradShard>> {
        super::params::gradient_shards(&self.groups, self.shard_rank())
    }

    /// The model directory's files (`config.json`, tokenizer files) that every checkpoint
    /// saved from now on carries, so an export is a directory `from_pretrained` loads.
    pub fn set_model_files(&mut self, files: ModelFiles) {
        self.model_files = files;
    }

    /// The files [`Engine::set_model_files`] gave.
    pub fn model_files(&self) -> &ModelFiles {
        &self.model_files
    }

    /// Sets every parameter from `src`, which must hold exactly the model's parameters (its
    /// [`ParamSource::check`] runs first, so a bad source changes nothing). Collective only in
    /// that every rank reads the same source; no communication happens.
    pub fn load_parameters(&mut self, src: &dyn ParamSource) -> Result<()> {
        self.load_parameters_where(src, &|_| true)
    }

    /// [`Engine::load_parameters`] for the parameters `pick` names only (the source must hold
    /// exactly those); the others keep their values: a base model's weights under LoRA
    /// adapters, which keep their initialisation or come from an adapter directory.
    pub fn load_parameters_where(
        &mut self,
        src: &dyn ParamSource,
        pick: &dyn Fn(&str) -> bool,
    ) -> Result<()> {
        self.before_writes()?;
        super::load_params::check_source(&self.groups, src, pick)?;
        let rank = self.shard_rank();
        (self.params.swap).settle(&mut self.groups, &mut self.ledger)?;
        let swap = self.params.swap.store_mut();
        super::load_params::load_groups(&mut self.groups, swap, rank, (src, pick))
    }

    /// Saves a checkpoint as `dir/tag` and points `dir/latest` at it (collective: every rank
    /// calls it). `data_position` is handed back by [`Engine::load_checkpoint`]. An existing
    /// tag is replaced atomically. Call it at an accumulation boundary.
    pub fn save_checkpoint(
        &self,
        dir: impl AsRef<Path>,
        tag: &str,
        data_position: u64,
    ) -> Result<PathBuf> {
        self.await_landings()?;
        checkpoint::check_tag(tag)?;
        if self.acts.micro != 0 {
            return Err(Error::Invalid(
                "save_checkpoint in the middle of gradient accumulation; save after step()".into(),
            ));
        }
        let saving = checkpoint::Saving {
            cfg: &self.cfg,
            comm: &self.comm,
            groups: &self.groups,
            opt: &self.opt,
            swap: self.params.swap.store(),
            model_files: &self.model_files,
        };
        saving.save(dir.as_ref(), tag, data_position)
    }

    /// Loads checkpoint `tag` of `dir` into this engine (collective: every rank calls it).
    /// Parameters, master weights, optimizer moments, the step counter, the loss scaler and
    /// the seed are restored, so training continues as if it had never stopped; the saved
    /// world size and stage may differ from this engine's. Shard files are verified against
    /// their checksums first (each rank verifies a share of them).
    pub fn load_checkpoint(
        &mut self,
        dir: impl AsRef<Path>,
        tag: &Tag,
    ) -> Result<LoadedCheckpoint> {
        self.before_writes()?;
        if self.acts.micro != 0 {
            return Err(Error::Invalid(
                "load_checkpoint in the middle of gradient accumulation".into(),
            ));
        }
        let world = self.comm.world.as_ref();
        let moments = self.opt.optimizer.moments();
        let at = (dir.as_ref(), tag);
        let reader = checkpoint::open_checked(world, at, &self.groups, moments)?;
        let restored = self.restore(&reader);
        checkpoint::agree(self.comm.world.as_ref(), restored)?;
        let m = reader.meta();
        if let Some(base) = &m.frozen_base {
            self.check_frozen_base(base, &reader)?;
        }
        Ok(LoadedCheckpoint {
            tag: m.tag.clone(),
            step: m.step,
            data_position: m.data_position,
            saved_world_size: m.world_size,
        })
    }

    /// A checkpoint that names its frozen values' base model instead of holding them resumes
    /// only over those values: the engine's must match the fingerprint saved (collective).
    fn check_frozen_base(
        &self,
        base: &checkpoint::FrozenBase,
        reader: &checkpoint::CheckpointReader,
    ) -> Result<()> {
        let stores = (self.opt.nvme.get(), self.params.swap.store());
        let shards = self.comm.shards();
        let got = super::params::frozen_fingerprint(&self.groups, shards, stores)?;
        match base.matches(got) {
            true => Ok(()),
            false => Err(Error::File {
                path: reader.tag_dir().display().to_string(),
                reason: format!(
                    "the frozen parameters are not the ones this checkpoint was trained over \
                     (sum {:e} and sum of squares {:e}; the engine holds {:e} and {:e}): load the \
                     base model's weights from {} before load_checkpoint",
                    base.sum, base.sum_squares, got.0, got.1, base.path
                ),
            }),
        }
    }

    /// Restores this rank's groups and the counters, seed and loss scale from `reader`.
    fn restore(&mut self, reader: &checkpoint::CheckpointReader) -> Result<()> {
        // The shard this rank holds (its shard group's position under hybrid sharding).
        let rank = self.shard_rank();
        (self.params.swap).settle(&mut self.groups, &mut self.ledger)?;
        let stores = (self.params.swap.store_mut(), self.opt.nvme.get());
        checkpoint::restore_groups(reader, &mut self.groups, stores, rank)?;
        let m = reader.meta();
        self.opt.steps = m.step;
        self.acts.micro = 0;
        self.acts.losses.clear();
        self.acts.tokens = 0;
        // Dropout masks derive from the seed; resuming with another seed would diverge.
        self.cfg.seed = m.seed;
        if checkpoint::same_kind(&self.opt.scaler, &m.scaler) {
            self.opt.scaler = m.scaler.clone();
        } else {
            tracing::warn!(
                saved = ?m.scaler,
                "the checkpoint's loss scaler does not match this precision; starting afresh"
            );
        }
        Ok(())
    }

    /// Before parameters are written wholesale: the optimizer's uploads land first, and
    /// uploads started ahead from the shards are dropped.
    fn before_writes(&mut self) -> Result<()> {
        self.await_landings()?;
        (self.params.uploads).drop_all(&*self.be, &mut self.ledger)
    }
}
