//! The ZeRO engine: `initialize`, the per-stage strategies, mixed precision and the training loop.
