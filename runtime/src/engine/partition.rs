//! All shard arithmetic in one place: how a parameter group's flat buffer is laid out,
//! padded and split into one contiguous shard per rank.
//!
//! Invariant: these functions are pure; every stage, the ledger and the estimator use them,
//! so a layout question has one answer.

use std::ops::Range;

use crate::nn::ParamSpec;

/// Elements every shard length is rounded up to, so shard boundaries stay SIMD- and
/// cache-line-friendly (16 f32 = one 64-byte line).
pub const SHARD_ALIGN: usize = 16;

/// Where one parameter sits in its group's flat buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamSlot {
    /// The parameter's name.
    pub name: String,
    /// Its shape.
    pub shape: Vec<usize>,
    /// First element in the flat buffer.
    pub offset: usize,
    /// Element count.
    pub numel: usize,
}

impl ParamSlot {
    /// The element range in the flat buffer.
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.numel
    }
}

/// The layout of one flat buffer and its split across `world_size` ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupLayout {
    /// Parameters in declaration order, packed without gaps.
    pub slots: Vec<ParamSlot>,
    /// Real elements (sum of parameter sizes).
    pub numel: usize,
    /// Elements per rank's shard.
    pub shard_len: usize,
    /// Ranks the buffer is split across.
    pub world_size: usize,
}

impl GroupLayout {
    /// Lays out `specs` for `world_size` ranks.
    pub fn new(specs: &[ParamSpec], world_size: usize) -> Self {
        let mut offset = 0;
        let slots = specs
            .iter()
            .map(|s| {
                let slot = ParamSlot {
                    name: s.name.clone(),
                    shape: s.shape.clone(),
                    offset,
                    numel: s.numel(),
                };
                offset += slot.numel;
                slot
            })
            .collect();
        Self {
            slots,
            numel: offset,
            shard_len: shard_len(offset, world_size),
            world_size,
        }
    }

    /// Elements in the padded buffer: `shard_len * world_size >= numel`.
    pub fn padded(&self) -> usize {
        self.shard_len * self.world_size
    }

    /// The element range of `rank`'s shard in the padded buffer.
    pub fn shard_range(&self, rank: usize) -> Range<usize> {
        rank * self.shard_len..(rank + 1) * self.shard_len
    }
}

/// Elements per shard for a buffer of `numel` split over `world_size` ranks: the smallest
/// multiple of [`SHARD_ALIGN`] such that the shards cover the buffer.
pub fn shard_len(numel: usize, world_size: usize) -> usize {
    let world = world_size.max(1);
    numel.div_ceil(world).div_ceil(SHARD_ALIGN) * SHARD_ALIGN
}

/// Ranks one copy of the sharded state is split across: the hybrid-sharding group size
/// (`mics_shard_size`; 1 is a group per rank, as in DeepSpeed) when it splits `world` into
/// several equal groups, else `world`.
pub fn shard_world(world: usize, mics: usize) -> usize {
    if mics >= 1 && mics < world && world.is_multiple_of(mics) {
        mics
    } else {
        world
    }
}

/// Splits `0..len` into consecutive chunks of at most `chunk` elements (at least one element
/// per chunk; an empty range yields nothing). Used for bucketed communication.
pub fn chunks(len: usize, chunk: usize) -> impl Iterator<Item = Range<usize>> {
    let step = chunk.max(1);
    (0..len.div_ceil(step)).map(move |i| i * step..((i + 1) * step).min(len))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::Init;

    fn spec(name: &str, shape: &[usize]) -> ParamSpec {
        ParamSpec {
            name: name.into(),
            shape: shape.to_vec(),
            init: Init::Zeros,
        }
    }

    #[test]
    fn shards_cover_the_buffer_and_are_aligned() {
        for numel in [0, 1, 15, 16, 17, 1000, 12345] {
            for world in 1..=8 {
                let s = shard_len(numel, world);
                assert!(s * world >= numel, "numel {numel} world {world}");
                assert_eq!(s % SHARD_ALIGN, 0);
                // Minimal: one alignment step less would not cover.
                assert!(s == 0 || (s - SHARD_ALIGN) * world < numel);
            }
        }
    }

    #[test]
    fn slots_are_packed_in_order() {
        let l = GroupLayout::new(&[spec("a", &[3, 5]), spec("b", &[7])], 3);
        assert_eq!(l.slots[0].range(), 0..15);
        assert_eq!(l.slots[1].range(), 15..22);
        assert_eq!(l.numel, 22);
        assert_eq!(l.shard_len, 16);
        assert_eq!(l.padded(), 48);
        assert_eq!(l.shard_range(2), 32..48);
    }

    #[test]
    fn chunks_partition_the_range() {
        let c: Vec<_> = chunks(10, 4).collect();
        assert_eq!(c, vec![0..4, 4..8, 8..10]);
        assert_eq!(chunks(0, 4).count(), 0);
        assert_eq!(chunks(3, 0).count(), 3);
    }
}
