//! Placeholder replaced by the compute core's deterministic initialisers at merge.

use super::Init;

/// Fills `out` according to `init`, deterministically from `seed`.
pub fn fill(init: &Init, seed: u64, out: &mut [f32]) {
    let mut s = seed;
    for v in out.iter_mut() {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let u = (s >> 40) as f32 / (1u64 << 24) as f32;
        *v = match *init {
            Init::Zeros => 0.0,
            Init::Ones => 1.0,
            Init::Normal { std } => (u - 0.5) * 3.46 * std,
            Init::Uniform { bound } => (u * 2.0 - 1.0) * bound,
        };
    }
}

/// The seed for one parameter.
pub fn param_seed(global_seed: u64, name: &str) -> u64 {
    name.bytes().fold(global_seed ^ 0xcbf29ce484222325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100000001b3)
    })
}
