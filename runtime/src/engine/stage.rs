//! ZeRO stages: one type per stage behind one trait.
//!
//! A stage decides three things and nothing else: whether parameters, gradients and optimizer
//! state are held in full or as this rank's shard. The communication that follows from those
//! choices (all-reduce vs reduce-scatter of gradients, all-gather of updated shards, gather
//! and release of parameters around each unit) is written once, in the trait's provided
//! methods, so all stages share the same arithmetic and stay bitwise comparable.

use std::ops::Range;

use ferrozero_config::resolved::ZeroStage;

use super::group::{not_resident, Group, ParamStore};
use super::ledger::{Category, Ledger, Location};
use super::partition::{chunks, GroupLayout};
use crate::backend::Backend;
use crate::comm::{Communicator, ReduceOp};
use crate::tensor::{DType, Storage};
use crate::Result;

/// Whether a rank holds a whole buffer or only its shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Extent {
    /// The whole padded buffer.
    Full,
    /// This rank's contiguous shard.
    Shard,
}

impl Extent {
    /// The padded range covered on `rank`.
    pub fn range(self, layout: &GroupLayout, rank: usize) -> Range<usize> {
        match self {
            Extent::Full => 0..layout.padded(),
            Extent::Shard => layout.shard_range(rank),
        }
    }
}

/// How a stage-3 parameter gather travels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParamWire {
    /// The shards as stored.
    Exact,
    /// ZeRO++ qwZ: int8 codes and block scales ([`crate::comm::quantized`]), dequantized by
    /// every rank.
    Quantized,
}

/// How a gradient reduce-scatter travels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GradWire {
    /// The gradient in the wire dtype, summed by the communicator's reduce-scatter.
    Exact,
    /// ZeRO++ qgZ: 4-bit codes and block scales exchanged by an all-to-all, dequantized and
    /// summed in rank order by each owner ([`crate::comm::quantized`]).
    Quantized,
}

/// The behaviour of a ZeRO stage.
pub trait Stage: Send + Sync {
    /// Which stage this is.
    fn stage(&self) -> ZeroStage;
    /// Parameters held in full or sharded between steps.
    fn params(&self) -> Extent;
    /// Gradient accumulators held in full or sharded.
    fn grads(&self) -> Extent;
    /// Optimizer state (and the range this rank updates) in full or sharded.
    fn optimizer(&self) -> Extent;

    /// Makes the group's full parameters available for compute (stage 3 all-gathers).
    fn gather(
        &self,
        g: &mut Group,
        comm: &dyn Communicator,
        be: &dyn Backend,
        (bucket, wire): (usize, ParamWire),
        ledger: &mut Ledger,
    ) -> Result<()> {
        if let ParamStore::Partitioned {
            shard,
            gathered: gathered @ None,
        } = &mut g.params
        {
            let shard = shard.resident().ok_or_else(|| not_resident("gather"))?;
            let (world, s) = (g.layout.world_size, g.layout.shard_len);
            let staging = wire_staging_bytes(wire, world, s);
            ledger.alloc(Location::Device, Category::CommBuffers, staging);
            let full = gather_buffer(shard, world, s)
                .and_then(|full| gather_shards(shard, full, s, comm, (bucket, wire), be));
            ledger.free(Location::Device, Category::CommBuffers, staging);
            let full = full?;
            ledger.alloc(Location::Device, Category::Prefetch, full.bytes());
            *gathered = Some(full);
        }
        g.ensure_work(be, ledger)
    }

    /// Releases what `gather` made (the converted copy always; the gathered buffer in stage 3).
    fn release(&self, g: &mut Group, be: &dyn Backend, ledger: &mut Ledger) {
        g.drop_work(be, ledger);
        if let ParamStore::Partitioned { gathered, .. } = &mut g.params {
            if let Some(full) = gathered.take() {
                ledger.free(Location::Device, Category::Prefetch, full.bytes());
                be.recycle(full);
            }
        }
    }

    /// After the optimizer updated this rank's range: makes every rank's replicated
    /// parameters current again (stages 1-2 all-gather the updated shards).
    fn publish(
        &self,
        g: &mut Group,
        comm: &dyn Communicator,
        bucket: usize,
        ledger: &mut Ledger,
    ) -> Result<()> {
        // With one rank the owned range is everything and the optimizer wrote it in place.
        if self.optimizer() != Extent::Shard || g.layout.world_size == 1 {
            return Ok(());
        }
        if let ParamStore::Replicated(full) = &mut g.params {
            let own = g.layout.shard_range(comm.rank());
            let (world, s) = (g.layout.world_size, g.layout.shard_len);
            let bytes = (own.len() * full.dtype().size()) as u64;
            ledger.alloc(Location::Device, Category::CommBuffers, bytes);
            let r = own_shard(full, own)
                .and_then(|shard| all_gather_chunked(comm, &shard, full, world, s, bucket));
            ledger.free(Location::Device, Category::CommBuffers, bytes);
            r?;
        }
        Ok(())
    }
}

/// The stage type for a configured stage.
pub fn for_stage(stage: ZeroStage) -> Box<dyn Stage> {
    match stage {
        ZeroStage::Stage0 => Box::new(Stage0),
        ZeroStage::Stage1 => Box::new(Stage1),
        ZeroStage::Stage2 => Box::new(Stage2),
        ZeroStage::Stage3 => Box::new(Stage3),
    }
}

/// Stage 0: plain data parallelism; gradients all-reduced, everything replicated.
pub struct Stage0;
/// Stage 1: optimizer state sharded; updated shards all-gathered.
pub struct Stage1;
/// Stage 2: gradients reduce-scattered into shards as well.
pub struct Stage2;
/// Stage 3: parameters sharded too; gathered around each unit's forward and backward.
pub struct Stage3;

macro_rules! stage {
    ($t:ty, $s:expr, $p:expr, $g:expr, $o:expr) => {
        impl Stage for $t {
            fn stage(&self) -> ZeroStage {
                $s
            }
            fn params(&self) -> Extent {
                $p
            }
            fn grads(&self) -> Extent {
                $g
            }
            fn optimizer(&self) -> Extent {
                $o
            }
        }
    };
}

stage!(
    Stage0,
    ZeroStage::Stage0,
    Extent::Full,
    Extent::Full,
    Extent::Full
);
stage!(
    Stage1,
    ZeroStage::Stage1,
    Extent::Full,
    Extent::Full,
    Extent::Shard
);
stage!(
    Stage2,
    ZeroStage::Stage2,
    Extent::Full,
    Extent::Shard,
    Extent::Shard
);
stage!(
    Stage3,
    ZeroStage::Stage3,
    Extent::Shard,
    Extent::Shard,
    Extent::Shard
);

/// A micro-step gradient in the storage dtype (f32 moves without a copy).
pub fn to_storage(v: Storage, dtype: DType, be: &dyn Backend) -> Result<Storage> {
    if v.dtype() == dtype {
        return Ok(v);
    }
    let mut b = be.buffer_uninit(dtype, v.len())?;
    v.cast_into(&mut b)?;
    be.recycle(v);
    Ok(b)
}

/// A copy of `full[own]` beside it (the all-gather's input may not alias its output).
fn own_shard(full: &Storage, own: Range<usize>) -> Result<Storage> {
    let mut shard = full.zeros_like(full.dtype(), own.len())?;
    full.copy_to(own.start, &mut shard, 0, own.len())?;
    Ok(shard)
}

/// Elements per rank in one communication chunk for a bucket of `bucket` elements in total.
fn per_rank_chunk(bucket: usize, world: usize) -> usize {
    (bucket / world.max(1)).max(1)
}

/// What [`reduce_gradient`] hands back: the reduced gradient, and the micro-step buffer it
/// was reduced from when that is another buffer, for the caller to recycle on its own thread
/// (a reduction on the comm worker would otherwise free it where it is never reused).
pub struct Reduced {
    /// The whole sum (`Full`) or this rank's shard of it (`Shard`).
    pub sum: Storage,
    /// The consumed input, when `sum` is not that same buffer.
    pub spent: Option<Storage>,
}

/// The output [`reduce_gradient`] writes for a shard reduction (`None` when it reduces in
/// place), with unspecified contents, allocated by the thread that will recycle it.
pub fn reduce_output(
    extent: Extent,
    buf: &Storage,
    world: usize,
    shard_len: usize,
) -> Result<Option<Storage>> {
    if world == 1 || extent == Extent::Full {
        return Ok(None);
    }
    buf.uninit_like(buf.dtype(), shard_len).map(Some)
}

/// Reduces every rank's padded micro-step gradient `buf` with rank-order sums, `bucket`
/// elements of input at a time: the whole sum (`Full`) or this rank's shard of it (`Shard`,
/// into `out` from [`reduce_output`], which the reduce-scatters overwrite whole).
/// Pure over owned buffers, so it runs inline or on the communication worker alike; the
/// collectives take the buffers where they live (device buffers stay on the device), and the
/// staging buffers are allocated beside them.
pub fn reduce_gradient(
    extent: Extent,
    mut buf: Storage,
    out: Option<Storage>,
    world: usize,
    shard_len: usize,
    comm: &dyn Communicator,
    (bucket, wire): (usize, GradWire),
) -> Result<Reduced> {
    let in_place = |sum| Reduced { sum, spent: None };
    if world == 1 {
        // One rank's sum (or shard, which is everything) is its own buffer.
        return Ok(in_place(buf));
    }
    if extent == Extent::Full {
        for c in chunks(buf.len(), bucket) {
            comm.all_reduce_view(buf.range_mut(c)?, ReduceOp::Sum)?;
        }
        return Ok(in_place(buf));
    }
    let s = shard_len;
    let mut out = match out {
        Some(o) => o,
        None => buf.uninit_like(buf.dtype(), s)?,
    };
    let k = per_rank_chunk(bucket, world);
    if wire == GradWire::Quantized {
        crate::comm::quantized::reduce_scatter_quantized(comm, &buf, &mut out, s, bucket)?;
    } else if k >= s {
        comm.reduce_scatter_view(buf.view(), out.view_mut(), ReduceOp::Sum)?;
    } else {
        let mut input = buf.zeros_like(buf.dtype(), k * world)?;
        for c in chunks(s, k) {
            let n = c.len();
            for r in 0..world {
                buf.copy_to(r * s + c.start, &mut input, r * n, n)?;
            }
            comm.reduce_scatter_view(input.range(0..n * world)?, out.range_mut(c)?, ReduceOp::Sum)?;
        }
    }
    Ok(Reduced {
        sum: out,
        spent: Some(buf),
    })
}

/// All-gathers every rank's shard into one full padded buffer, `bucket` elements of output
/// at a time, placed on the compute device: gathered where the shard lives (device memory,
/// or host memory for offloaded shards), then adopted by the backend.
///
/// `full` comes from [`gather_buffer`] on the thread that will release it, so that the
/// thread's buffer cache serves the next step's gather of the same unit (a prefetch runs on
/// the comm worker, whose cache would never see the buffer again).
///
/// Under [`ParamWire::Quantized`] every rank's shard travels quantized and `full` holds the
/// dequantized values (the rank's own shard included).
pub fn gather_shards(
    shard: &Storage,
    mut full: Storage,
    shard_len: usize,
    comm: &dyn Communicator,
    (bucket, wire): (usize, ParamWire),
    be: &dyn Backend,
) -> Result<Storage> {
    let world = comm.world_size();
    match wire {
        ParamWire::Exact => all_gather_chunked(comm, shard, &mut full, world, shard_len, bucket)?,
        ParamWire::Quantized => {
            crate::comm::quantized::all_gather_quantized(comm, shard, &mut full, shard_len, bucket)?
        }
    }
    be.adopt_storage(full)
}

/// The buffers a shard reduction of `world` shards of `shard_len` in `dtype` holds besides
/// its input and output (the ledger's and the estimator's `CommBuffers` while it runs).
pub fn grad_staging_bytes(wire: GradWire, world: usize, shard_len: usize, dtype: DType) -> u64 {
    match wire {
        GradWire::Exact => 0,
        GradWire::Quantized => {
            crate::comm::quantized::reduce_staging_bytes(world, shard_len, dtype)
        }
    }
}

/// The packed bytes a gather of `world` shards of `shard_len` holds besides its output (the
/// ledger's and the estimator's `CommBuffers` while it runs).
pub fn wire_staging_bytes(wire: ParamWire, world: usize, shard_len: usize) -> u64 {
    match wire {
        ParamWire::Exact => 0,
        ParamWire::Quantized => crate::comm::quantized::all_gather_staging_bytes(world, shard_len),
    }
}

/// The output of [`gather_shards`]: `world` shards of `shard_len` elements beside `shard`, with
/// unspecified contents (the all-gather writes every element, padding included).
pub fn gather_buffer(shard: &Storage, world: usize, shard_len: usize) -> Result<Storage> {
    shard.uninit_like(shard.dtype(), shard_len * world)
}

/// All-gathers `src` (one shard) from every rank into `full` (padded).
fn all_gather_chunked(
    comm: &dyn Communicator,
    src: &Storage,
    full: &mut Storage,
    world: usize,
    s: usize,
    bucket: usize,
) -> Result<()> {
    let k = per_rank_chunk(bucket, world);
    if k >= s {
        return comm.all_gather_view(src.range(0..s)?, full.range_mut(0..s * world)?);
    }
    let mut out = src.zeros_like(src.dtype(), k * world)?;
    for c in chunks(s, k) {
        let n = c.len();
        comm.all_gather_view(src.range(c.clone())?, out.range_mut(0..n * world)?)?;
        for r in 0..world {
            out.copy_to(r * n, full, r * s + c.start, n)?;
        }
    }
    Ok(())
}
