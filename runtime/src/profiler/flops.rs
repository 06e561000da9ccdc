//! The FLOPs the profiler counts, from each backend operation's shape: matrix products only
//! (the convention behind `6N`: elementwise work, norms, softmax and the optimizer count 0).
//!
//! - a product `[m, k] · [k, n]`: `2·m·n·k`, whatever its epilogue;
//! - causal attention forward over `batch` sequences of `T` tokens with `H` query heads of
//!   width `d`: `QKᵀ` and `PV` are `2·T·T·d` each per head, half of them masked, so
//!   `2·batch·H·d·T²`; backward computes four such products (`dV`, `dP`, `dQ`, `dK`):
//!   twice forward;
//! - the loss head of `rows` tokens, width `dim`, vocabulary `V`: the logits `2·rows·dim·V`
//!   forward, `dx` and `dW` `4·rows·dim·V` backward (a device that recomputes the logits in
//!   backward does more work than it is credited with: model FLOPs, not hardware FLOPs); the
//!   fused head (forward and backward in one call) runs exactly those three products.
//!
//! Per token of a causal decoder with `N` parameters, `L` layers of attention width `C` and
//! `T` tokens per sequence, training (forward and backward) is therefore `6·N + 6·L·C·T`
//! when every parameter sits in a matrix product ([`model_flops_per_token`], the figure
//! behind `mfu`).

use crate::backend::{AttentionShape, HeadShape, MatmulShape};
use crate::nn::Model;

/// A matrix product: `2·m·n·k`.
pub fn matmul(s: &MatmulShape) -> u64 {
    2 * (s.m as u64) * (s.n as u64) * (s.k as u64)
}

/// Causal attention forward: `2·batch·q_heads·head_dim·seq²`.
pub fn attention_forward(s: &AttentionShape) -> u64 {
    let t = s.seq as u64;
    2 * (s.batch as u64) * (s.q_heads as u64) * (s.head_dim as u64) * t * t
}

/// Causal attention backward: twice forward.
pub fn attention_backward(s: &AttentionShape) -> u64 {
    2 * attention_forward(s)
}

/// The loss head's logits: `2·rows·dim·vocab`.
pub fn head_forward(s: &HeadShape) -> u64 {
    2 * (s.rows as u64) * (s.dim as u64) * (s.vocab as u64)
}

/// The loss head's backward (`dx` and `dW`): twice forward.
pub fn head_backward(s: &HeadShape) -> u64 {
    2 * head_forward(s)
}

/// The fused loss head (logits, `dx` and `dW` in one call): three products of forward's size.
pub fn head_fused(s: &HeadShape) -> u64 {
    head_forward(s) + head_backward(s)
}

/// Model FLOPs of one training token (forward and backward) at `seq` tokens per sequence:
/// `6·N + 6·seq·Σ attention widths`, `N` every parameter of the model (shared ones once)
/// and the widths each unit's causal attention (query heads × head dim, summed over
/// layers): PaLM's `6N + 6·L·C·T` for a causal decoder.
pub fn model_flops_per_token(model: &Model, seq: usize) -> u64 {
    let width: u64 = model
        .units
        .iter()
        .map(|u| u.module.attention_width() as u64)
        .sum();
    6 * model.num_params() as u64 + 6 * width * seq as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Transpose;

    #[test]
    fn products_count_two_flops_per_multiply_add() {
        let s = MatmulShape {
            m: 3,
            n: 5,
            k: 7,
            ta: Transpose::Yes,
            tb: Transpose::No,
        };
        assert_eq!(matmul(&s), 210);
        let a = AttentionShape {
            batch: 2,
            seq: 4,
            q_heads: 3,
            kv_heads: 1,
            head_dim: 8,
            dropout: None,
        };
        // Half of 2 · (2·T·T·d) per head and sequence: GQA's shared K/V change nothing.
        assert_eq!(attention_forward(&a), 2 * 2 * 3 * 8 * 16);
        assert_eq!(attention_backward(&a), 2 * attention_forward(&a));
        let h = HeadShape {
            rows: 6,
            dim: 4,
            vocab: 10,
        };
        assert_eq!(head_forward(&h), 480);
        assert_eq!(head_backward(&h), 960);
        assert_eq!(head_fused(&h), 1440);
    }
}
