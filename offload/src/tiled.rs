//! The optimizer step for NVMe-resident state: the f32 master parameters and Adam moments
//! live in the store, one tensor per `sub_group_size` tile holding `[params | m | v]`; a step
//! reads tile i+1 while tile i is updated and tile i-1 is written back.
//!
//! The update is the in-memory [`optim::adam_step`] on each tile, so the result equals a
//! full in-memory step bit for bit (the kernels are element-wise and position-independent).

use std::ops::Range;

use crate::optim::{self, AdamHyper, LowPrecision};
use crate::pipeline::{Prefetch, WriteBehind};
use crate::pool::BufferPool;
use crate::store::NvmeStore;
use crate::{Error, Result};

/// The layout of one NVMe-resident Adam state: a key prefix and the tiles.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NvmeAdam {
    prefix: String,
    tile: usize,
    len: usize,
}

/// f32 values per parameter in a tile: master, m, v.
const STREAMS: usize = 3;

impl NvmeAdam {
    /// Writes the initial state (the given master parameters, zero moments) as tiles of
    /// `sub_group_size` parameters; each tile must fit one pool buffer.
    pub fn create(
        store: &NvmeStore,
        pool: &BufferPool,
        prefix: &str,
        params: &[f32],
        sub_group_size: usize,
    ) -> Result<NvmeAdam> {
        let fill = |r: Range<usize>, out: &mut [f32]| {
            out.copy_from_slice(&params[r]);
            Ok(())
        };
        Self::create_with(store, pool, prefix, params.len(), sub_group_size, fill)
    }

    /// As [`NvmeAdam::create`] for `len` master parameters that `fill` writes a tile at a
    /// time (its range of the parameters, and the tile's master values to write). A meta
    /// store ([`NvmeStore::meta`]) records the tiles' lengths and never calls `fill`: a
    /// size-only run generates no values.
    pub fn create_with(
        store: &NvmeStore,
        pool: &BufferPool,
        prefix: &str,
        len: usize,
        sub_group_size: usize,
        mut fill: impl FnMut(Range<usize>, &mut [f32]) -> Result<()>,
    ) -> Result<NvmeAdam> {
        let need = sub_group_size.saturating_mul(STREAMS * 4);
        if sub_group_size == 0 || need > pool.buffer_size() {
            return Err(Error::Invalid {
                op: "NvmeAdam::create",
                detail: format!(
                    "sub_group_size {sub_group_size} needs {need}-byte buffers (params, m, v \
                     in f32), the pool has {}",
                    pool.buffer_size()
                ),
            });
        }
        let state = NvmeAdam {
            prefix: prefix.to_string(),
            tile: sub_group_size,
            len,
        };
        let mut writes = WriteBehind::new(store, pool.buffer_count().div_ceil(2));
        for (i, r) in state.tiles().enumerate() {
            let mut buf = pool.acquire();
            if !store.is_meta() {
                let f: &mut [f32] = bytemuck::cast_slice_mut(&mut buf[..r.len() * STREAMS * 4]);
                let (p, moments) = f.split_at_mut(r.len());
                fill(r.clone(), p)?;
                moments.fill(0.0);
            }
            writes.push(&state.key(i), buf, r.len() * STREAMS * 4)?;
        }
        writes.flush()?;
        Ok(state)
    }

    /// Parameters held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no parameters are held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn tiles(&self) -> impl Iterator<Item = Range<usize>> + '_ {
        (0..self.len.div_ceil(self.tile))
            .map(|i| i * self.tile..((i + 1) * self.tile).min(self.len))
    }

    fn key(&self, i: usize) -> String {
        format!("{}.{i}", self.prefix)
    }

    fn keys(&self) -> Vec<String> {
        (0..self.len.div_ceil(self.tile))
            .map(|i| self.key(i))
            .collect()
    }

    /// One Adam step over all tiles, pipelined: read ahead, update, write behind. `lp_out`
    /// receives the updated low-precision parameters for the whole range.
    ///
    /// On an error the tiles before the failing one have been stepped and the rest have not:
    /// the run must stop and resume from its last checkpoint, which this never touches.
    #[allow(clippy::too_many_arguments)]
    pub fn adam_step(
        &self,
        store: &NvmeStore,
        pool: &BufferPool,
        hp: &AdamHyper,
        step: u64,
        grad_scale: f32,
        grads: &[f32],
        mut lp_out: LowPrecision<'_>,
    ) -> Result<()> {
        self.check_len("NvmeAdam::adam_step", grads.len())?;
        let lp_len = match &lp_out {
            LowPrecision::None => self.len,
            LowPrecision::Bf16(b) => b.len(),
            LowPrecision::F16(h) => h.len(),
        };
        self.check_len("NvmeAdam::adam_step (low-precision copy)", lp_len)?;
        // A meta store holds no values to step: a size-only run prices the step's memory,
        // which is the pool's, without computing it.
        if store.is_meta() {
            return Ok(());
        }
        let ahead = pool.buffer_count().div_ceil(2);
        let mut writes = WriteBehind::new(store, ahead);
        let reads = Prefetch::new(store, pool, self.keys(), ahead)?;
        for (swapped, r) in reads.zip(self.tiles()) {
            let mut s = swapped?;
            let n = r.len();
            let f: &mut [f32] = bytemuck::cast_slice_mut(s.bytes_mut());
            let (p, rest) = f.split_at_mut(n);
            let (m, v) = rest.split_at_mut(n);
            let lp = sub(&mut lp_out, r.clone());
            optim::adam_step(hp, step, grad_scale, p, &grads[r], m, v, lp)?;
            writes.push(&s.key, s.buf, s.len)?;
        }
        writes.flush()
    }

    /// Copies the master parameters out (for checkpoints and tests).
    pub fn read_params(&self, store: &NvmeStore, pool: &BufferPool, out: &mut [f32]) -> Result<()> {
        self.check_len("NvmeAdam::read_params", out.len())?;
        let reads = Prefetch::new(store, pool, self.keys(), pool.buffer_count())?;
        for (swapped, r) in reads.zip(self.tiles()) {
            let s = swapped?;
            let f: &[f32] = bytemuck::cast_slice(s.bytes());
            out[r.clone()].copy_from_slice(&f[..r.len()]);
        }
        Ok(())
    }

    /// Copies the whole state out: master parameters and both moments (for checkpoints).
    pub fn read_state(
        &self,
        store: &NvmeStore,
        pool: &BufferPool,
        master: &mut [f32],
        m: &mut [f32],
        v: &mut [f32],
    ) -> Result<()> {
        for n in [master.len(), m.len(), v.len()] {
            self.check_len("NvmeAdam::read_state", n)?;
        }
        let reads = Prefetch::new(store, pool, self.keys(), pool.buffer_count())?;
        for (swapped, r) in reads.zip(self.tiles()) {
            let s = swapped?;
            let n = r.len();
            let f: &[f32] = bytemuck::cast_slice(s.bytes());
            master[r.clone()].copy_from_slice(&f[..n]);
            m[r.clone()].copy_from_slice(&f[n..2 * n]);
            v[r].copy_from_slice(&f[2 * n..3 * n]);
        }
        Ok(())
    }

    /// Replaces the whole state: master parameters and both moments (checkpoint loading).
    pub fn write_state(
        &self,
        store: &NvmeStore,
        pool: &BufferPool,
        master: &[f32],
        m: &[f32],
        v: &[f32],
    ) -> Result<()> {
        for n in [master.len(), m.len(), v.len()] {
            self.check_len("NvmeAdam::write_state", n)?;
        }
        let mut writes = WriteBehind::new(store, pool.buffer_count().div_ceil(2));
        for (i, r) in self.tiles().enumerate() {
            let n = r.len();
            let mut buf = pool.acquire();
            let f: &mut [f32] = bytemuck::cast_slice_mut(&mut buf[..n * STREAMS * 4]);
            f[..n].copy_from_slice(&master[r.clone()]);
            f[n..2 * n].copy_from_slice(&m[r.clone()]);
            f[2 * n..3 * n].copy_from_slice(&v[r]);
            writes.push(&self.key(i), buf, n * STREAMS * 4)?;
        }
        writes.flush()
    }

    fn check_len(&self, op: &'static str, n: usize) -> Result<()> {
        if n == self.len {
            return Ok(());
        }
        Err(Error::Length {
            op,
            detail: format!("state holds {} parameters, buffer has {n}", self.len),
        })
    }
}

/// The part of a low-precision output covering `r`.
fn sub<'b>(lp: &'b mut LowPrecision<'_>, r: Range<usize>) -> LowPrecision<'b> {
    match lp {
        LowPrecision::None => LowPrecision::None,
        LowPrecision::Bf16(b) => LowPrecision::Bf16(&mut b[r]),
        LowPrecision::F16(h) => LowPrecision::F16(&mut h[r]),
    }
}
