//! Stage 3 whose shard group is one rank at two ranks (MiCS, `mics_shard_size = 1`: every
//! rank's state replicated) with the parameters in host memory, on the emulated device: each
//! unit's shard goes up from the host store ahead of use, as at world size 1, with no
//! all-gather; the bits are stage 0's at the same world size, and the estimate prices the
//! uploads ahead (its device peak within 5% of the allocator's).
#![cfg(feature = "cuda")]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{config, toy};
use ferrozero_config::resolved::ZeroStage;
use ferrozero_config::resolved::{CommsLoggerConfig, OffloadTarget, Precision, ResolvedConfig};
use ferrozero_config::Device;
use ferrozero_runtime::backend::{self, Backend};
use ferrozero_runtime::comm::local::run_ranks;
use ferrozero_runtime::engine::estimate::estimate;
use ferrozero_runtime::engine::Engine;
use ferrozero_runtime::nn::{llama, Model};
use ferrozero_runtime::tensor::DType;

const MICRO: usize = 2;
const SEQ: usize = 32;
const VOCAB: usize = 64;
const WORLD: usize = 2;
const STEPS: usize = 2;

fn model() -> Model {
    llama::build(&llama::LlamaConfig::preset("tiny").unwrap()).unwrap()
}

fn cfg(stage: ZeroStage, mics: usize) -> ResolvedConfig {
    let mut c = config(stage, WORLD, MICRO, 2, Precision::Bf16);
    c.device = Device::Cuda(None);
    // The global norm sums each rank's shard range in f64 and the ranks' sums in f32: the
    // split into shard groups moves that rounding, so a clipped step could differ in its last
    // bit; without clipping the norm changes nothing.
    c.gradient_clipping = 0.0;
    c.zero.mics_shard_size = mics;
    c.monitor.comms_logger = Some(CommsLoggerConfig {
        verbose: false,
        prof_all: true,
        prof_ops: Vec::new(),
        debug: false,
    });
    if stage == ZeroStage::Stage3 {
        c.zero.offload_optimizer.target = OffloadTarget::Cpu;
        c.zero.offload_param.target = OffloadTarget::Cpu;
    }
    c
}

/// What rank 0 of a run leaves: its parameters' bits, the allocator's peak and the bytes
/// all-gathered.
struct Run {
    bits: Vec<(String, Vec<u32>)>,
    peak: u64,
    gathered: u64,
}

fn train(cfg: &ResolvedConfig) -> Run {
    let out = run_ranks(WORLD, Duration::from_secs(300), |comm| {
        let rank = comm.rank();
        let be: Arc<dyn Backend> = backend::cuda::emulated(DType::Bf16)?;
        let mut e = Engine::with_backend(model(), cfg.clone(), comm, be)?;
        for s in 0..STEPS {
            let batches: Vec<_> = (0..cfg.gradient_accumulation_steps)
                .map(|m| {
                    let first = ((s * cfg.gradient_accumulation_steps + m) * WORLD + rank) * MICRO;
                    toy::batch(VOCAB, SEQ, first, MICRO)
                })
                .collect();
            e.train_batch(&batches)?;
        }
        let peak = e.backend().memory_stats().map_or(0, |m| m.peak);
        let gathered = e
            .comm_stats()
            .map_or(0, |s| s.bytes("all_gather_into_tensor"));
        let bits = common::runs::named_bits(&e.parameters()?);
        Ok(Run {
            bits,
            peak,
            gathered,
        })
    })
    .expect("training on the emulated device");
    out.into_iter().next().unwrap()
}

#[test]
fn a_one_rank_shard_group_uploads_ahead_like_one_rank() {
    let plain = train(&cfg(ZeroStage::Stage0, 0));
    let c = cfg(ZeroStage::Stage3, 1);
    let got = train(&c);
    assert_eq!(got.gathered, 0, "a collective gathered parameters");
    assert!(plain.bits == got.bits, "MiCS 1 differs from stage 0");
    // With groups of one, stage 3 at two ranks is a plain gather: the rule is the shard
    // group's, not the world's.
    let flat = train(&cfg(ZeroStage::Stage3, 0));
    assert!(flat.gathered > 0, "plain stage 3 at two ranks gathers");
    let est = estimate(&model(), &c, MICRO, SEQ)
        .unwrap()
        .device
        .peak_bytes;
    let off = (est as f64 - got.peak as f64).abs() / got.peak as f64;
    assert!(
        off <= 0.05,
        "estimate {est} vs allocator peak {} ({:.2}%)",
        got.peak,
        off * 100.0
    );
}
