//! `Engine::load_checkpoint`'s work: restores every rank's state from a checkpoint saved at
//! any world size and stage, one group at a time, re-sharding by this engine's own layout.

use std::ops::Range;
use std::path::Path;

use super::agree::agree;
use super::meta::{GroupMeta, TensorKind};
use super::reader::CheckpointReader;
use super::Tag;
use crate::comm::Communicator;
use crate::engine::group::{Group, ParamStore};
use crate::engine::loss_scale::LossScaler;
use crate::engine::nvme::NvmeOffload;
use crate::engine::param_swap::ParamSwap;
use crate::engine::swap::edit_shard;
use crate::tensor::{FlatBuf, Storage};
use crate::{Error, Result};

/// Opens checkpoint `tag` of `dir` on every rank of `comm` (collective), verifies this rank's
/// share of its files against their checksums and checks that it fits `groups` and an
/// optimizer of `moments` moments; any rank's failure is every rank's.
pub(in crate::engine) fn open_checked(
    comm: &dyn Communicator,
    (dir, tag): (&Path, &Tag),
    groups: &[Group],
    moments: usize,
) -> Result<CheckpointReader> {
    let reader = agree(comm, CheckpointReader::open(dir, tag))?;
    let checked =
        verify_share(&reader, comm).and_then(|()| check_compatible(&reader, groups, moments));
    agree(comm, checked)?;
    Ok(reader)
}

/// Restores every group's parameters and optimizer state for shard `rank` (collectively
/// agreed by the caller), refreshing gathered working copies.
pub(in crate::engine) fn restore_groups(
    reader: &CheckpointReader,
    groups: &mut [Group],
    (mut swap, nvme): (Option<&mut ParamSwap>, Option<&NvmeOffload>),
    rank: usize,
) -> Result<()> {
    let by_reference = reader.meta().frozen_base.is_some();
    for (gi, g) in groups.iter_mut().enumerate() {
        // Frozen values the checkpoint names rather than holds stay as loaded (the caller
        // checks their fingerprint).
        if by_reference && reader.meta().groups.get(gi).is_some_and(|m| m.frozen) {
            continue;
        }
        restore_group(reader, gi, g, swap.as_deref_mut(), rank)?;
        restore_nvme_state(reader, gi, g, nvme)?;
        if g.work.is_some() {
            refresh_work(g)?;
        }
    }
    Ok(())
}

/// Verifies the files this rank of `comm` checks (every world-th from its rank).
fn verify_share(reader: &CheckpointReader, comm: &dyn Communicator) -> Result<()> {
    let (rank, world) = (comm.rank(), comm.world_size());
    (0..reader.meta().world_size)
        .filter(|q| q % world == rank)
        .try_for_each(|q| reader.verify_file(q))
}

/// Whether the checkpoint holds `groups`' layouts and at least `moments` moments.
fn check_compatible(reader: &CheckpointReader, groups: &[Group], moments: usize) -> Result<()> {
    let m = reader.meta();
    let path = reader.tag_dir().display().to_string();
    let bad = |reason: String| {
        Err(Error::File {
            path: path.clone(),
            reason,
        })
    };
    if m.groups.len() != groups.len() {
        return bad(format!(
            "holds {} parameter groups, this model has {}",
            m.groups.len(),
            groups.len()
        ));
    }
    for (gi, (saved, g)) in m.groups.iter().zip(groups).enumerate() {
        let mine = GroupMeta::from_layout(&g.layout);
        if saved.slots != mine.slots {
            let diff = saved.slots.iter().zip(&mine.slots).find(|(a, b)| a != b);
            return bad(match diff {
                Some((a, b)) => format!(
                    "group {gi}: saved parameter {} {:?} where the model has {} {:?}",
                    a.name, a.shape, b.name, b.shape
                ),
                None => format!(
                    "group {gi}: {} parameters saved, the model has {}",
                    saved.slots.len(),
                    mine.slots.len()
                ),
            });
        }
    }
    if m.moments < moments {
        return bad(format!(
            "holds {} optimizer moments per element; this optimizer needs {moments}",
            m.moments
        ));
    }
    Ok(())
}

fn refresh_work(g: &mut Group) -> Result<()> {
    let Group { params, work, .. } = g;
    let full = match params {
        ParamStore::Replicated(b) => Some(&*b),
        ParamStore::Partitioned { gathered, .. } => gathered.as_ref(),
    };
    if let (Some(full), Some(w)) = (full, work.as_mut()) {
        full.cast_into(w)?;
    }
    Ok(())
}

/// The part of the padded range `r` that holds real elements.
fn real(r: &Range<usize>, numel: usize) -> Range<usize> {
    r.start.min(numel)..r.end.min(numel)
}

fn restore_group(
    reader: &CheckpointReader,
    gi: usize,
    g: &mut Group,
    swap: Option<&mut ParamSwap>,
    rank: usize,
) -> Result<()> {
    let numel = g.layout.numel;
    let range = match &mut g.params {
        ParamStore::Replicated(_) => 0..g.layout.padded(),
        ParamStore::Partitioned { gathered, .. } => {
            *gathered = None;
            g.layout.shard_range(rank)
        }
    };
    edit_shard(g, swap, |b| fill_params(reader, gi, b, range, numel))?;
    let owned = g.owned.clone();
    g.grad.fill_zero()?;
    if g.nvme_adam.is_some() {
        // Master weights and moments live on NVMe: `restore_nvme_state` writes them.
        return Ok(());
    }
    if let Some(master) = &mut g.master {
        fill_stored(master, &owned, numel, |r| reader.read_values(gi, r))?;
    }
    fill_stored(&mut g.m, &owned, numel, |r| {
        reader.read_f32(gi, TensorKind::M, r)
    })?;
    if !g.v.is_empty() {
        fill_stored(&mut g.v, &owned, numel, |r| {
            reader.read_f32(gi, TensorKind::V, r)
        })?;
    }
    g.grad.fill_zero()?;
    Ok(())
}

/// Writes the saved master weights and moments of the owned range into NVMe-resident state.
fn restore_nvme_state(
    reader: &CheckpointReader,
    gi: usize,
    g: &Group,
    nvme: Option<&crate::engine::nvme::NvmeOffload>,
) -> Result<()> {
    let (Some(state), Some(n)) = (&g.nvme_adam, nvme) else {
        return Ok(());
    };
    let (owned, numel) = (g.owned.clone(), g.layout.numel);
    let (mut master, mut m, mut v) = (
        vec![0.0; owned.len()],
        vec![0.0; owned.len()],
        vec![0.0; owned.len()],
    );
    fill_f32(&mut master, &owned, numel, |r| reader.read_values(gi, r))?;
    fill_f32(&mut m, &owned, numel, |r| {
        reader.read_f32(gi, TensorKind::M, r)
    })?;
    fill_f32(&mut v, &owned, numel, |r| {
        reader.read_f32(gi, TensorKind::V, r)
    })?;
    state.write_state(&n.store, &n.pool, &master, &m, &v)?;
    Ok(())
}

/// Fills `dst` (covering padded range `range`) with saved values; padding becomes zero.
fn fill_f32(
    dst: &mut [f32],
    range: &Range<usize>,
    numel: usize,
    read: impl Fn(Range<usize>) -> Result<Vec<f32>>,
) -> Result<()> {
    dst.fill(0.0);
    let r = real(range, numel);
    if !r.is_empty() {
        let vals = read(r.clone())?;
        dst[r.start - range.start..r.end - range.start].copy_from_slice(&vals);
    }
    Ok(())
}

/// [`fill_f32`] into f32 state wherever it lives (device state is written by an explicit
/// upload).
fn fill_stored(
    dst: &mut Storage,
    range: &Range<usize>,
    numel: usize,
    read: impl Fn(Range<usize>) -> Result<Vec<f32>>,
) -> Result<()> {
    dst.with_host_mut(|h| match h {
        FlatBuf::F32(v) => fill_f32(v, range, numel, read),
        other => Err(Error::Invalid(format!(
            "optimizer state stored as {:?}, expected f32",
            other.dtype()
        ))),
    })
}

/// Fills the parameter buffer covering padded `range`: the saved bits when the dtype
/// matches (bit-exact resume), else the saved fp32 values rounded to this dtype.
fn fill_params(
    reader: &CheckpointReader,
    gi: usize,
    b: &mut FlatBuf,
    range: Range<usize>,
    numel: usize,
) -> Result<()> {
    b.fill_zero();
    let r = real(&range, numel);
    if r.is_empty() {
        return Ok(());
    }
    let at = r.start - range.start;
    if reader.kind_dtype(TensorKind::Params) != b.dtype() {
        let vals = reader.read_values(gi, r)?;
        b.store_f32(at, &vals);
        return Ok(());
    }
    let bytes = reader.read_raw(gi, TensorKind::Params, r.clone())?;
    let n = r.len();
    match b {
        FlatBuf::F32(v) => bytemuck::cast_slice_mut(&mut v[at..at + n]).copy_from_slice(&bytes),
        FlatBuf::Bf16(v) => bytemuck::cast_slice_mut(&mut v[at..at + n]).copy_from_slice(&bytes),
        FlatBuf::F16(v) => bytemuck::cast_slice_mut(&mut v[at..at + n]).copy_from_slice(&bytes),
    }
    Ok(())
}

/// Whether a scaler state came from the same kind of scaler.
pub(in crate::engine) fn same_kind(a: &LossScaler, b: &LossScaler) -> bool {
    std::mem::discriminant(a) == std::mem::discriminant(b)
}
