//! Deterministic parameter initialisation: each element is a pure function of
//! `(seed, index)` (a counter-based generator), so every thread count, shard layout and
//! world size produces the same values.

use rayon::prelude::*;

use super::Init;
use crate::backend::rng;

const CHUNK: usize = 64 * 1024;

/// Fills `out` according to `init`, deterministically from `seed`.
pub fn fill(init: &Init, seed: u64, out: &mut [f32]) {
    fill_from(init, seed, 0, out);
}

/// Fills `out` with elements `start..start + out.len()` of what [`fill`] writes for a whole
/// parameter: the generator is counter-based, so a shard of a parameter costs its own
/// elements only.
pub fn fill_from(init: &Init, seed: u64, start: usize, out: &mut [f32]) {
    out.par_chunks_mut(CHUNK)
        .enumerate()
        .for_each(|(c, chunk)| {
            let base = (start + c * CHUNK) as u64;
            for (i, v) in chunk.iter_mut().enumerate() {
                let idx = base + i as u64;
                *v = match *init {
                    Init::Zeros => 0.0,
                    Init::Ones => 1.0,
                    Init::Normal { std } => (rng::normal(seed, idx) * f64::from(std)) as f32,
                    Init::Uniform { bound } => (rng::uniform_f32(seed, idx) * 2.0 - 1.0) * bound,
                };
            }
        });
}

/// The seed for one parameter: a mix of the global seed and the parameter's full name, so
/// a parameter's values do not depend on where it sits in a unit or a shard.
pub fn param_seed(global_seed: u64, name: &str) -> u64 {
    rng::derive(global_seed, rng::hash_str(name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn any_range_is_that_slice_of_the_whole_parameters_values() {
        let init = Init::Normal { std: 0.02 };
        let mut whole = vec![0.0; 3 * CHUNK + 17];
        fill(&init, 7, &mut whole);
        let ranges = [
            (0, 5),
            (CHUNK - 3, CHUNK + 9),
            (2 * CHUNK + 1, 3 * CHUNK + 17),
        ];
        for (a, b) in ranges {
            let mut part = vec![0.0; b - a];
            fill_from(&init, 7, a, &mut part);
            assert!(part == whole[a..b], "{a}..{b}");
        }
    }
}
