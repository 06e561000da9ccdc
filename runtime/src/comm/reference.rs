//! Sequential reference collectives over every rank's buffer at once: the specification
//! that the real communicators are tested against (rank-ordered f32 sums, rounded once).

use half::{bf16, f16};

use super::local::kernels::{combine_f32, finish};
use super::ReduceOp;

/// An element type the reference understands.
pub trait RefElem: Copy {
    /// Widens to f32.
    fn widen(self) -> f32;
    /// Rounds from f32 (round-to-nearest-even).
    fn narrow(x: f32) -> Self;
}

impl RefElem for f32 {
    fn widen(self) -> f32 {
        self
    }
    fn narrow(x: f32) -> Self {
        x
    }
}

impl RefElem for bf16 {
    fn widen(self) -> f32 {
        self.to_f32()
    }
    fn narrow(x: f32) -> Self {
        bf16::from_f32(x)
    }
}

impl RefElem for f16 {
    fn widen(self) -> f32 {
        self.to_f32()
    }
    fn narrow(x: f32) -> Self {
        f16::from_f32(x)
    }
}

/// The all-reduce of `inputs` (one equal-length buffer per rank, in rank order), computed
/// element by element in rank order.
pub fn all_reduce<T: RefElem>(inputs: &[Vec<T>], op: ReduceOp) -> Vec<T> {
    let Some(first) = inputs.first() else {
        return Vec::new();
    };
    let mut acc: Vec<f32> = first.iter().map(|x| x.widen()).collect();
    for input in &inputs[1..] {
        let wide: Vec<f32> = input.iter().map(|x| x.widen()).collect();
        combine_f32(&mut acc, &wide, op);
    }
    finish(&mut acc, op, inputs.len());
    acc.into_iter().map(T::narrow).collect()
}

/// Rank `rank`'s output of a reduce-scatter of `inputs`.
pub fn reduce_scatter<T: RefElem>(inputs: &[Vec<T>], op: ReduceOp, rank: usize) -> Vec<T> {
    let full = all_reduce(inputs, op);
    let m = full.len() / inputs.len().max(1);
    full[rank * m..(rank + 1) * m].to_vec()
}

/// The output of an all-gather of `inputs` (identical on every rank).
pub fn all_gather<T: RefElem>(inputs: &[Vec<T>]) -> Vec<T> {
    inputs.concat()
}
