//! ZeRO++'s quantized collectives over any [`Communicator`]: each rank quantizes its part
//! ([`crate::tensor::quant`]: int8 or int4 codes with an f32 scale per block, on the device
//! that holds it), the packed words travel through the communicator's own collectives (which
//! copy them, never read them), and every rank dequantizes what it received. So the local,
//! MPI and NCCL communicators, the comms logger (which counts the packed bytes actually sent)
//! and the hybrid and worker wrappers carry them unchanged. qwZ gathers packed words with
//! `all_gather`; qgZ exchanges them with `all_to_all` ([`Communicator::all_to_all`]).

use super::Communicator;
use crate::tensor::quant::{Packed, QuantFormat, WIRE_DTYPE};
use crate::tensor::{DType, Storage, View, ViewMut};
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
    shard.quantize_into(0..shard_len, fmt, &mut mine, 0)?;
    let mut all = shard.uninit_like(WIRE_DTYPE, w * world)?;
    bucketed(comm, true, (&mine, &mut all), w, bucket)?;
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

/// qgZ's reduction: `input` (`world * shard_len` elements) is this rank's gradient; slot `r`
/// (the part rank `r` owns) is quantized in [`QuantFormat::gradients`], the slots are
/// exchanged by one all-to-all, and this rank dequantizes the `world` parts it received and
/// sums them in rank order in f32, `((d0 + d1) + d2) + ...`, rounded once into `out`
/// (`shard_len` elements, `out`'s dtype). The sum depends on the values alone, never on
/// timing. `bucket` bounds the words of one collective.
pub fn reduce_scatter_quantized(
    comm: &dyn Communicator,
    input: &Storage,
    out: &mut Storage,
    shard_len: usize,
    bucket: usize,
) -> Result<()> {
    let (world, s) = (comm.world_size(), shard_len);
    let fmt = QuantFormat::gradients(s);
    let w = Packed { fmt, len: s }.words();
    let mut send = input.uninit_like(WIRE_DTYPE, w * world)?;
    for r in 0..world {
        input.quantize_into(r * s..(r + 1) * s, fmt, &mut send, r * w)?;
    }
    let mut recv = input.uninit_like(WIRE_DTYPE, w * world)?;
    bucketed(comm, false, (&send, &mut recv), w, bucket)?;
    let f32_out = out.dtype() == DType::F32;
    let mut acc = if f32_out {
        None
    } else {
        Some(out.uninit_like(DType::F32, s)?)
    };
    let sum = acc.as_mut().unwrap_or(out);
    recv.dequantize_into(0, fmt, sum, 0, s)?;
    let mut part = sum.uninit_like(DType::F32, s)?;
    let mut scratch = Vec::new();
    for r in 1..world {
        recv.dequantize_into(r * w, fmt, &mut part, 0, s)?;
        sum.accumulate(0, &part, s, &mut scratch)?;
    }
    if let Some(acc) = acc {
        acc.cast_into(out)?;
    }
    Ok(())
}

/// Bytes of the buffers [`reduce_scatter_quantized`] holds at once besides its input and
/// output: the packed slots sent and received, the f32 part being added, and the f32 sum
/// when the output is narrower.
pub fn reduce_staging_bytes(world: usize, shard_len: usize, out: DType) -> u64 {
    let w = Packed {
        fmt: QuantFormat::gradients(shard_len),
        len: shard_len,
    }
    .words();
    let sums = if out == DType::F32 { 1 } else { 2 };
    (2 * world * w * WIRE_DTYPE.size() + sums * shard_len * 4) as u64
}

/// Moves `w` words per slot from `src` into `dst`'s `world` slots through `comm`: an
/// all-gather of `src`'s one slot, or (not `gather`) an all-to-all of its `world` slots; at
/// most `bucket` words per collective, each carrying the same range of every slot.
fn bucketed(
    comm: &dyn Communicator,
    gather: bool,
    (src, dst): (&Storage, &mut Storage),
    w: usize,
    bucket: usize,
) -> Result<()> {
    let world = comm.world_size();
    let run = |i: View<'_>, o: ViewMut<'_>| match gather {
        true => comm.all_gather_view(i, o),
        false => comm.all_to_all_view(i, o),
    };
    let k = (bucket / world.max(1)).max(1);
    if k >= w {
        let slots = if gather { 1 } else { world };
        return run(src.range(0..w * slots)?, dst.range_mut(0..w * world)?);
    }
    // An all-to-all's slots are gathered into one buffer; an all-gather sends its range as is.
    let mut sent = match gather {
        true => None,
        false => Some(src.uninit_like(WIRE_DTYPE, k * world)?),
    };
    let mut got = src.uninit_like(WIRE_DTYPE, k * world)?;
    let mut start = 0;
    while start < w {
        let n = k.min(w - start);
        let input = match &mut sent {
            None => src.range(start..start + n)?,
            Some(a) => {
                for r in 0..world {
                    src.copy_to(r * w + start, a, r * n, n)?;
                }
                a.range(0..n * world)?
            }
        };
        run(input, got.range_mut(0..n * world)?)?;
        for r in 0..world {
            got.copy_to(r * n, dst, r * w + start, n)?;
        }
        start += n;
    }
    Ok(())
}
