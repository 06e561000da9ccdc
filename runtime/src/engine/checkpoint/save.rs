//! `Engine::save_checkpoint`: every rank writes its shard file into a temporary directory,
//! rank 0 adds the metadata, publishes the directory by rename and then moves `latest`.
//! Under hybrid sharding only the first shard group writes (the others hold copies of the
//! same shards), so the checkpoint is that of a plain run over one group's ranks and loads
//! at any world size, stage and group size.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use ferrozero_config::resolved::ResolvedConfig;

use super::agree::{agree, all_gather_text};
use super::fsio;
use super::meta::{
    dtype_name, rank_file_name, CheckpointMeta, FileMeta, FrozenBase, GroupMeta, TensorKind,
    FORMAT, LATEST_FILE, META_FILE, MODEL_DIR, VERSION,
};
use super::reader::st_dtype;
use super::shard_file::{self, Bytes, RawTensor};
use super::stream::Streamer;
use crate::comm::{BufMut, BufRef};
use crate::engine::group::{not_resident, Group, ParamStore, Shard};
use crate::engine::nvme::NvmeOffload;
use crate::engine::param_swap::ParamSwap;
use crate::engine::step_state::StepState;
use crate::engine::topology::Comms;
use crate::nn::weights::ModelFiles;
use crate::tensor::{DType, FlatBuf, Storage};
use crate::{Error, Result};

/// Checks that a tag is a plain, portable directory name.
pub fn check_tag(tag: &str) -> Result<()> {
    let ok_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
    if tag.is_empty() || tag.starts_with('.') || tag == LATEST_FILE || !tag.chars().all(ok_char) {
        return Err(Error::Invalid(format!(
            "checkpoint tag {tag:?} must be a non-empty name of letters, digits, '.', '_' or \
             '-', not starting with '.' and not \"{LATEST_FILE}\""
        )));
    }
    Ok(())
}

fn lp_bytes(b: &FlatBuf, r: std::ops::Range<usize>) -> &[u8] {
    match b {
        FlatBuf::F32(v) => bytemuck::cast_slice(&v[r]),
        FlatBuf::Bf16(v) => bytemuck::cast_slice(&v[r]),
        FlatBuf::F16(v) => bytemuck::cast_slice(&v[r]),
    }
}

/// The bytes of `b[r]`: borrowed from host memory, or copied out of device memory.
fn storage_bytes(b: &Storage, r: std::ops::Range<usize>) -> Result<Bytes<'_>> {
    match b.host() {
        Some(h) => Ok(Bytes::Borrowed(lp_bytes(h, r))),
        None => {
            let h = b.range(r)?.to_host()?;
            Ok(Bytes::Owned(lp_bytes(&h, 0..h.len()).to_vec()))
        }
    }
}

/// Where a save reads NVMe-resident state from.
#[derive(Clone, Copy)]
struct NvmeSources<'a> {
    nvme: Option<&'a NvmeOffload>,
    swap: Option<&'a ParamSwap>,
    streamer: &'a Streamer,
}

/// The tensors of group `gi` for `rank`'s canonical shard, borrowed from the engine, or
/// streamed from NVMe when the optimizer state or the parameter shard lives there.
fn group_tensors<'a>(
    gi: usize,
    g: &'a Group,
    src: NvmeSources<'a>,
    rank: usize,
    out: &mut Vec<(String, RawTensor<'a>)>,
) -> Result<()> {
    let sr = g.layout.shard_range(rank);
    let n = sr.len();
    let one = |dtype: DType, bytes: Bytes<'a>| RawTensor {
        dtype: st_dtype(dtype),
        shape: [n],
        bytes,
    };
    let params = match (&g.params, src.swap) {
        (ParamStore::Replicated(b), _) => one(b.dtype(), storage_bytes(b, sr.clone())?),
        (
            ParamStore::Partitioned {
                shard: Shard::Nvme(slot),
                ..
            },
            Some(swap),
        ) => {
            let len = n * slot.dtype.size();
            let read = Box::new(move || src.streamer.shard_bytes(g, swap, len));
            one(slot.dtype, Bytes::Lazy { len, read })
        }
        (ParamStore::Partitioned { shard, .. }, _) => {
            let b = shard
                .resident()
                .ok_or_else(|| not_resident("save_checkpoint"))?;
            one(b.dtype(), storage_bytes(b, 0..b.len())?)
        }
    };
    out.push((TensorKind::Params.tensor_name(gi), params));
    // Frozen parameters are saved (a resume must not lose them); they have no state.
    if g.frozen {
        return Ok(());
    }
    if sr.start < g.owned.start || sr.end > g.owned.end {
        return Err(Error::Invalid(format!(
            "group {gi}: optimizer range {:?} does not cover shard {sr:?}",
            g.owned
        )));
    }
    let local = sr.start - g.owned.start..sr.end - g.owned.start;
    if let (Some(_), Some(nvme)) = (&g.nvme_adam, src.nvme) {
        for kind in [TensorKind::Master, TensorKind::M, TensorKind::V] {
            let local = local.clone();
            let read = Box::new(move || src.streamer.state_bytes(gi, g, nvme, kind, local.clone()));
            let bytes = Bytes::Lazy { len: n * 4, read };
            out.push((kind.tensor_name(gi), one(DType::F32, bytes)));
        }
        return Ok(());
    }
    let f32s = |v: &'a Storage| -> Result<RawTensor<'a>> {
        Ok(one(DType::F32, storage_bytes(v, local.clone())?))
    };
    if let Some(master) = &g.master {
        out.push((TensorKind::Master.tensor_name(gi), f32s(master)?));
    }
    if !g.m.is_empty() {
        out.push((TensorKind::M.tensor_name(gi), f32s(&g.m)?));
    }
    if !g.v.is_empty() {
        out.push((TensorKind::V.tensor_name(gi), f32s(&g.v)?));
    }
    Ok(())
}

/// The engine's state a save reads.
pub(in crate::engine) struct Saving<'a> {
    pub(in crate::engine) cfg: &'a ResolvedConfig,
    pub(in crate::engine) comm: &'a Comms,
    pub(in crate::engine) groups: &'a [Group],
    pub(in crate::engine) opt: &'a StepState,
    pub(in crate::engine) swap: Option<&'a ParamSwap>,
    pub(in crate::engine) model_files: &'a ModelFiles,
}

impl Saving<'_> {
    /// Saves a checkpoint as `dir/tag` and points `dir/latest` at it (collective; the
    /// caller checked the tag and that it is an accumulation boundary).
    pub(in crate::engine) fn save(
        &self,
        dir: &Path,
        tag: &str,
        data_position: u64,
    ) -> Result<PathBuf> {
        let world = self.comm.world.as_ref();
        let tmp = dir.join(format!(".tmp-{tag}"));
        let dst = dir.join(tag);
        let rank = world.rank();
        agree(
            world,
            if rank == 0 {
                fresh_dir(dir, &tmp)
            } else {
                Ok(())
            },
        )?;
        let base = self.frozen_base()?;
        // Under hybrid sharding every shard group holds the same state: the first group's
        // ranks write it, and the checkpoint is the one a plain run over one group writes.
        let writes = rank == self.comm.shards().rank();
        let mine = writes
            .then(|| self.write_rank_file(&tmp, base.is_some()))
            .transpose();
        let mine = agree(world, mine)?;
        let files = self.gather_file_meta(mine)?;
        let publish = if rank == 0 {
            self.write_meta(&tmp, (tag, data_position), files, base)
                .and_then(|()| fsio::publish_dir(&tmp, &dst))
                .and_then(|()| fsio::replace_file(&dir.join(LATEST_FILE), tag.as_bytes()))
        } else {
            Ok(())
        };
        agree(world, publish)?;
        Ok(dst)
    }

    /// The base model the frozen parameters are named by instead of copied, with their
    /// fingerprint (collective), when the run named one and has frozen parameters.
    fn frozen_base(&self) -> Result<Option<FrozenBase>> {
        let Some(path) = &self.model_files.base else {
            return Ok(None);
        };
        if !self.groups.iter().any(|g| g.frozen) {
            return Ok(None);
        }
        let stores = (self.opt.nvme.get(), self.swap);
        let fp = crate::engine::params::frozen_fingerprint(self.groups, self.comm.shards(), stores);
        let (sum, sum_squares) = fp?;
        Ok(Some(FrozenBase {
            path: path.display().to_string(),
            sum,
            sum_squares,
        }))
    }

    /// Writes this rank's shard file; `by_reference`: frozen groups are left out (the base
    /// model holds them).
    fn write_rank_file(&self, tmp: &Path, by_reference: bool) -> Result<FileMeta> {
        let rank = self.comm.shards().rank();
        // NVMe-resident state streams into the file one group at a time.
        let streamer = Streamer::default();
        let src = NvmeSources {
            nvme: self.opt.nvme.get(),
            swap: self.swap,
            streamer: &streamer,
        };
        let mut tensors = Vec::new();
        for (gi, g) in self.groups.iter().enumerate() {
            if !(g.frozen && by_reference) {
                group_tensors(gi, g, src, rank, &mut tensors)?;
            }
        }
        let info = HashMap::from([
            ("format".to_string(), FORMAT.to_string()),
            ("rank".to_string(), rank.to_string()),
        ]);
        let name = rank_file_name(rank);
        let path = tmp.join(&name);
        shard_file::write(&path, &tensors, info)?;
        if let Some(e) = streamer.take_fault() {
            return Err(e);
        }
        let (bytes, crc32c, tensors) = shard_file::checksums(&path)?;
        Ok(FileMeta {
            name,
            bytes,
            crc32c,
            tensors,
        })
    }

    /// Every written file's size and checksum, on every rank (the writers are the world's
    /// first ranks: all of them, or the first shard group). Values travel as 16-bit pieces in
    /// f32, which the collectives carry exactly.
    fn gather_file_meta(&self, mine: Option<FileMeta>) -> Result<Vec<FileMeta>> {
        let per_tensor = mine.as_ref().map_or(Ok(String::new()), |m| {
            serde_json::to_string(&m.tensors)
                .map_err(|e| Error::Invalid(format!("tensor checksums do not serialise: {e}")))
        })?;
        let per_tensor = all_gather_text(self.comm.world.as_ref(), &per_tensor)?;
        let pieces = |x: u64| (0..4).map(move |i| ((x >> (16 * i)) & 0xffff) as f32);
        let (bytes, crc) = mine.map_or((0, 0), |m| (m.bytes, m.crc32c));
        let local: Vec<f32> = pieces(bytes).chain(pieces(crc as u64)).collect();
        let mut all = vec![0.0f32; local.len() * self.comm.world.world_size()];
        self.comm
            .world
            .all_gather(BufRef::F32(&local), BufMut::F32(&mut all))?;
        let join = |p: &[f32]| {
            p.iter()
                .enumerate()
                .fold(0u64, |acc, (i, &x)| acc | ((x as u64) << (16 * i)))
        };
        Ok(all
            .chunks_exact(8)
            .take(self.comm.shards().world_size())
            .enumerate()
            .map(|(q, c)| FileMeta {
                name: rank_file_name(q),
                bytes: join(&c[..4]),
                crc32c: join(&c[4..]) as u32,
                tensors: serde_json::from_str(&per_tensor[q]).unwrap_or_default(),
            })
            .collect())
    }

    fn write_meta(
        &self,
        tmp: &Path,
        (tag, pos): (&str, u64),
        files: Vec<FileMeta>,
        frozen_base: Option<FrozenBase>,
    ) -> Result<()> {
        let dtype = match &self.groups.first().map(|g| &g.params) {
            Some(ParamStore::Replicated(b)) => b.dtype(),
            Some(ParamStore::Partitioned { shard, .. }) => shard.dtype(),
            None => DType::F32,
        };
        let meta = CheckpointMeta {
            format: FORMAT.into(),
            version: VERSION,
            tag: tag.into(),
            step: self.opt.steps,
            data_position: pos,
            world_size: self.comm.shards().world_size(),
            stage: self.cfg.zero.stage.number(),
            param_dtype: dtype_name(dtype).into(),
            has_master: self
                .groups
                .iter()
                .any(|g| g.master.is_some() || g.nvme_adam.is_some()),
            moments: self.opt.optimizer.moments(),
            seed: self.cfg.seed,
            scaler: self.opt.scaler.clone(),
            next_lr: self.opt.schedule.lr_at(self.opt.steps),
            config: serde_json::to_value(self.cfg)
                .map_err(|e| Error::Invalid(format!("config does not serialise: {e}")))?,
            groups: self
                .groups
                .iter()
                .map(|g| GroupMeta {
                    frozen: g.frozen,
                    ..GroupMeta::from_layout(&g.layout)
                })
                .collect(),
            files,
            frozen_base,
        };
        let json = serde_json::to_vec_pretty(&meta)
            .map_err(|e| Error::Invalid(format!("metadata does not serialise: {e}")))?;
        fsio::write_durable(&tmp.join(META_FILE), &json)?;
        if !self.model_files.files.is_empty() {
            let dir = tmp.join(MODEL_DIR);
            std::fs::create_dir(&dir).map_err(|e| fsio::io_err("create", &dir, e))?;
            for (name, bytes) in &self.model_files.files {
                fsio::write_durable(&dir.join(name), bytes)?;
            }
            fsio::sync_dir(&dir)?;
        }
        fsio::sync_dir(tmp)
    }
}

/// Creates `dir` and an empty `tmp` in it, removing temporary directories that crashed
/// saves left behind (saves into one directory are sequential, so none is live).
fn fresh_dir(dir: &Path, tmp: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| fsio::io_err("create directory", dir, e))?;
    let entries = std::fs::read_dir(dir).map_err(|e| fsio::io_err("list", dir, e))?;
    for entry in entries.flatten() {
        if entry.file_name().to_string_lossy().starts_with(".tmp-") {
            let stale = entry.path();
            std::fs::remove_dir_all(&stale).map_err(|e| fsio::io_err("remove stale", &stale, e))?;
        }
    }
    std::fs::create_dir(tmp).map_err(|e| fsio::io_err("create", tmp, e))?;
    fsio::sync_dir(dir)
}
