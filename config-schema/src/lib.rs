//! ferrozero's configuration: DeepSpeed's config surface as typed, documented structs, loaded
//! from TOML (native) or DeepSpeed JSON, validated completely at load time.
//!
//! Invariant: this crate knows nothing about tensors, models or communicators. The engine
//! consumes only [`resolved::ResolvedConfig`], in which every `"auto"` and every default has
//! been decided.

pub mod resolved;
