//! ZeRO++'s quantized collectives over any [`Communicator`]: each rank quantizes its part
//! ([`crate::tensor::quant`]: int8 or int4 codes with an f32 scale per block, on the device
//! that holds it), the packed words travel through the communicator's own collectives (which
//! copy them, never read them), and every rank dequantizes what it received. So the local,
//! MPI and NCCL communicators, the comms logger (which counts the packed bytes actually sent)
//! and the hybrid and worker wrappers carry them unchanged.

use super::Communicator;
use crate::tensor::quant::{Packed, QuantFormat, WIRE_DTYPE};
use crate::tensor::Storage;
use crate::Result;

/// qwZ's all-gather: every rank's `shard` (`shard_len` elements) quantized in
/// [`QuantFormat::weights`], gathered, and dequantized in rank order into `full`
/// (`world * shard_len` elements, `full`'s dtype, the rank's own shard included, so every rank
/// computes with the same values). `bucket` bounds the elements (words) of one collective.
pub fn all_gather_quantized(
    comm: &dyn Communicator,
    shard: &Storage,
    full: &mut Storage,
    shard_len: usize,
    bucket: usize,
) -> Result<()> {
    let world = comm.world_size();
    let fmt = QuantFormat::weights(shard_len);
    let w = Packed {
        fmt,
        len: shard_len,
    }
    .words();
    let mut mine = shard.uninit_like(WIRE_DTYPE, w)?;
    shard.quantize_into(0..shard_len, fmt, &mut mine)?;
    let mut all = shard.uninit_like(WIRE_DTYPE, w * world)?;
    gather_words(comm, &mine, &mut all, w, bucket)?;
    for r in 0..world {
        all.dequantize_into(r * w, fmt, full, r * shard_len, shard_len)?;
    }
    Ok(())
}

/// Bytes of the packed buffers [`all_gather_quantized`] holds at once (this rank's and the
/// gathered ones), for the ledger and the estimator.
pub fn all_gather_staging_bytes(world: usize, shard_len: usize) -> u64 {
    let w = Packed {
        fmt: QuantFormat::weights(shard_len),
        len: shard_len,
    }
    .words();
    ((world + 1) * w * WIRE_DTYPE.size()) as u64
}

/// All-gathers `w` words per rank from `mine` into `all`, at most `bucket` words per
/// collective.
fn gather_words(
    comm: &dyn Communicator,
    mine: &Storage,
    all: &mut Storage,
    w: usize,
    bucket: usize,
) -> Result<()> {
    let world = comm.world_size();
    let k = (bucket / world.max(1)).max(1);
    if k >= w {
        return comm.all_gather_view(mine.range(0..w)?, all.range_mut(0..w * world)?);
    }
    let mut out = mine.uninit_like(WIRE_DTYPE, k * world)?;
    let mut start = 0;
    while start < w {
        let n = k.min(w - start);
        comm.all_gather_view(mine.range(start..start + n)?, out.range_mut(0..n * world)?)?;
        for r in 0..world {
            out.copy_to(r * n, all, r * w + start, n)?;
        }
        start += n;
    }
    Ok(())
}
