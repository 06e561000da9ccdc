//! CPU optimizer kernels (contract; implemented by the offload work).
//!
//! Invariant: every kernel is element-wise and computes each element with the same sequence
//! of operations whatever the slice's offset, length, tiling or thread count (SIMD lanes and
//! scalar tails use the same operations, with or without FMA consistently), so a ZeRO shard
//! updated alone equals the same elements updated as part of the full buffer, bit for bit.
