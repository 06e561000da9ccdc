//! What a device keeps in memory for training, described without opening the device: the
//! activation dtype, what attention and the loss head keep (the CPU: probabilities and full
//! logits; a flash-style GPU: per-row log-sum-exp), whether layers read parameters widened to
//! f32, and the allocator's block rounding. Each backend reports its own
//! ([`super::MemoryOps::memory_model`]); the size-only CPU stand-in sizes the state it saves
//! from it, the CUDA head its logits chunks, and an estimate's report names it. A struct rather
//! than a trait because a report must describe a GPU on a machine that has none
//! ([`MemoryModel::for_device`]).

use super::{AttentionShape, Device, HeadShape};
use crate::tensor::DType;

/// The CUDA caching allocator's smallest block, written here so that builds without the
/// `cuda` feature can still describe a GPU (the allocator's own constant is checked equal).
const CUDA_BLOCK: u64 = 512;
#[cfg(feature = "cuda")]
const _: () = assert!(CUDA_BLOCK == super::cuda::driver::MIN_BLOCK);

/// The most bytes of logits a chunked loss head holds at once (256 MiB).
pub const LOGIT_CHUNK_BYTES: usize = 256 << 20;

/// A chunked loss head's logits rows are padded to a multiple of this many elements
/// ([`MemoryModel::head_ld`]): 16-byte aligned rows in every dtype, and cuBLASLt's tiles.
pub const HEAD_LD_MULTIPLE: usize = 128;

/// What attention's forward keeps for backward besides Q, K, V and its output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionState {
    /// The softmax probabilities: f32, `seq x seq` per sequence and query head (the CPU).
    Probabilities,
    /// One f32 log-sum-exp per row and query head (flash-style attention: the CUDA backend).
    LogSumExp,
}

/// What the loss head keeps for backward besides its input and weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeadState {
    /// Every row's full-vocabulary probabilities in f32 (the CPU).
    Probabilities,
    /// One f32 log-sum-exp per row; logits are recomputed a chunk of rows at a time (CUDA).
    LogSumExp,
}

/// A device's memory behaviour, as layers and the estimator need it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryModel {
    /// The dtype activations are stored in.
    pub act: DType,
    /// Layers read parameters in f32 whatever their storage dtype (the CPU), so a gathered
    /// low-precision group gets an f32 working copy; a GPU reads them as stored.
    pub widens_params: bool,
    /// What attention saves.
    pub attention: AttentionState,
    /// What the loss head saves.
    pub head: HeadState,
    /// Every device buffer occupies a multiple of this many bytes (the caching allocator's
    /// smallest block; 1 where allocations are exact).
    pub block: u64,
    /// Bytes of the page-locked ring small uploads go through (0: the device page-locks no
    /// host memory: the CPU, where every view is host memory already).
    pub upload_ring: u64,
}

/// Bytes of a CUDA device's page-locked small-upload ring (`backend/cuda/upload.rs`).
pub const UPLOAD_RING_BYTES: u64 = 4 << 20;

impl std::fmt::Display for MemoryModel {
    /// One line for reports: the figures an estimate was priced with.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let attention = match self.attention {
            AttentionState::Probabilities => "attention keeps probabilities",
            AttentionState::LogSumExp => "flash attention keeps log-sum-exp",
        };
        let head = match self.head {
            HeadState::Probabilities => "head keeps full logits",
            HeadState::LogSumExp => "chunked head",
        };
        let work = if self.widens_params {
            "f32 working copies"
        } else {
            "no working copies"
        };
        write!(
            f,
            "{:?} activations, {attention}, {head}, {work}, {}-byte blocks",
            self.act, self.block
        )
    }
}

impl MemoryModel {
    /// The CPU backend: f32 activations, probabilities kept, parameters widened, exact sizes.
    pub const fn cpu() -> Self {
        MemoryModel {
            act: DType::F32,
            widens_params: true,
            attention: AttentionState::Probabilities,
            head: HeadState::Probabilities,
            block: 1,
            upload_ring: 0,
        }
    }

    /// The CUDA backend computing activations in `act`: flash-style attention and a chunked
    /// loss head (log-sum-exp only), parameters read as stored, sizes in the caching
    /// allocator's blocks.
    pub const fn cuda(act: DType) -> Self {
        MemoryModel {
            act,
            widens_params: false,
            attention: AttentionState::LogSumExp,
            head: HeadState::LogSumExp,
            block: CUDA_BLOCK,
            upload_ring: UPLOAD_RING_BYTES,
        }
    }

    /// The model of the backend `device` would open for activations in `act`, without opening
    /// it: a GPU is described on a machine that has none. `Auto` is a GPU only where one is
    /// usable (as [`super::open`] decides).
    pub fn for_device(device: Device, act: DType) -> Self {
        if super::memory_is_host_ram(device) {
            Self::cpu()
        } else {
            Self::cuda(act)
        }
    }

    /// The dtype layers read parameters stored in `storage` in.
    pub fn param_dtype(&self, storage: DType) -> DType {
        if self.widens_params {
            DType::F32
        } else {
            storage
        }
    }

    /// Bytes one buffer of `elems` elements of `dtype` occupies on the device.
    pub fn bytes(&self, dtype: DType, elems: usize) -> usize {
        self.round((elems * dtype.size()) as u64) as usize
    }

    /// `bytes` rounded up to the device's allocation block.
    pub fn round(&self, bytes: u64) -> u64 {
        bytes.div_ceil(self.block.max(1)) * self.block.max(1)
    }

    /// Bytes attention keeps for backward beyond Q, K, V and O (one buffer).
    pub fn attention_saved(&self, s: AttentionShape) -> usize {
        let per_row = match self.attention {
            AttentionState::Probabilities => s.seq,
            AttentionState::LogSumExp => 1,
        };
        self.bytes(DType::F32, s.batch * s.q_heads * s.seq * per_row)
    }

    /// Elements between consecutive rows of the loss head's logits buffer: the vocabulary
    /// where it keeps probabilities, else the vocabulary rounded up to
    /// [`HEAD_LD_MULTIPLE`], so that every row of a chunk starts 16-byte aligned and
    /// cuBLASLt can pick its aligned kernels for all the head's products (GPT-2's 50257 is
    /// odd). The padding columns are never computed, read, or part of the loss.
    pub fn head_ld(&self, s: HeadShape) -> usize {
        match self.head {
            HeadState::Probabilities => s.vocab,
            HeadState::LogSumExp => s.vocab.div_ceil(HEAD_LD_MULTIPLE) * HEAD_LD_MULTIPLE,
        }
    }

    /// Rows of logits the loss head computes at once: all of them where it keeps
    /// probabilities, else as many padded rows ([`MemoryModel::head_ld`]) as fit
    /// [`LOGIT_CHUNK_BYTES`] (at least one).
    pub fn head_chunk_rows(&self, s: HeadShape) -> usize {
        match self.head {
            HeadState::Probabilities => s.rows,
            HeadState::LogSumExp => (LOGIT_CHUNK_BYTES
                / (self.head_ld(s).max(1) * self.act.size()))
            .clamp(1, s.rows.max(1)),
        }
    }

    /// Bytes the loss head keeps for backward beyond its input and weight (one buffer).
    pub fn head_saved(&self, s: HeadShape) -> usize {
        let per_row = match self.head {
            HeadState::Probabilities => s.vocab,
            HeadState::LogSumExp => 1,
        };
        self.bytes(DType::F32, s.rows * per_row)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attn() -> AttentionShape {
        AttentionShape {
            batch: 2,
            seq: 8,
            q_heads: 4,
            kv_heads: 4,
            head_dim: 16,
            dropout: None,
        }
    }

    #[test]
    fn the_cpu_keeps_probabilities_in_exact_f32() {
        let m = MemoryModel::cpu();
        assert_eq!(m.attention_saved(attn()), 2 * 4 * 8 * 8 * 4);
        let head = HeadShape {
            rows: 16,
            dim: 8,
            vocab: 50,
        };
        assert_eq!(m.head_saved(head), 16 * 50 * 4);
        assert_eq!(m.bytes(m.act, 3), 12);
        assert_eq!(m.param_dtype(DType::Bf16), DType::F32);
    }

    #[test]
    fn a_gpu_keeps_row_statistics_in_allocator_blocks() {
        let m = MemoryModel::cuda(DType::Bf16);
        // 2 x 4 x 8 f32 log-sum-exps: 256 bytes, one 512-byte block.
        assert_eq!(m.attention_saved(attn()), 512);
        assert_eq!(m.bytes(m.act, 300), 1024);
        assert_eq!(m.param_dtype(DType::Bf16), DType::Bf16);
        assert_eq!(m.round(0), 0);
    }

    #[test]
    fn a_gpu_pads_the_heads_logits_rows_and_chunks_them_within_the_budget() {
        let gpt2 = HeadShape {
            rows: 16 * 1024,
            dim: 768,
            vocab: 50257,
        };
        let (cpu, gpu) = (MemoryModel::cpu(), MemoryModel::cuda(DType::Bf16));
        assert_eq!(cpu.head_ld(gpt2), 50257);
        assert_eq!(cpu.head_chunk_rows(gpt2), 16 * 1024);
        assert_eq!(gpu.head_ld(gpt2), 50304); // llm.c's padded vocabulary
        assert_eq!(gpu.head_ld(HeadShape { vocab: 128, ..gpt2 }), 128);
        // 256 MiB of bf16 rows of 50304: 2668 rows (50257 would allow 2670).
        assert_eq!(gpu.head_chunk_rows(gpt2), 2668);
        assert!(gpu.bytes(gpu.act, 2668 * 50304) <= LOGIT_CHUNK_BYTES);
    }

    #[test]
    fn a_gpu_is_described_without_opening_one() {
        assert_eq!(
            MemoryModel::for_device(Device::Cuda(Some(7)), DType::Bf16),
            MemoryModel::cuda(DType::Bf16)
        );
        assert_eq!(
            MemoryModel::for_device(Device::Cpu, DType::Bf16),
            MemoryModel::cpu()
        );
    }
}
