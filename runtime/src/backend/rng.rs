//! Counter-based random numbers: every value is a pure function of `(seed, index)`, so
//! results never depend on thread count or on which shard computes them.

/// The splitmix64 finaliser: a bijective 64-bit mixer with good avalanche.
#[inline]
pub fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The `index`-th 64 random bits of stream `seed`.
#[inline]
pub fn bits(seed: u64, index: u64) -> u64 {
    mix64(mix64(seed) ^ index.wrapping_mul(0xD1B5_4A32_D192_ED03))
}

/// Uniform in `[0, 1)` with 24 bits of precision (exactly representable in f32).
#[inline]
pub fn uniform_f32(seed: u64, index: u64) -> f32 {
    (bits(seed, index) >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
}

/// Standard normal via Box-Muller on two 32-bit halves of one draw (f64 internally).
#[inline]
pub fn normal(seed: u64, index: u64) -> f64 {
    let b = bits(seed, index);
    // +1 keeps u1 in (0, 1] so ln never sees zero.
    let u1 = ((b >> 32) as f64 + 1.0) / 4_294_967_296.0;
    let u2 = (b & 0xFFFF_FFFF) as f64 / 4_294_967_296.0;
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// Derives an independent seed for a named sub-stream (e.g. a dropout site in a unit).
pub fn derive(seed: u64, tag: u64) -> u64 {
    mix64(seed ^ mix64(tag.wrapping_add(0x5851_F42D_4C95_7F2D)))
}

/// Stable 64-bit FNV-1a hash of a string, for deriving seeds from parameter names.
pub fn hash_str(s: &str) -> u64 {
    s.bytes().fold(0xCBF2_9CE4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01B3)
    })
}
