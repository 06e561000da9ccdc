//! ZeRO++ quantized communication on every device: a tiny GPT-2 at two ranks sharing one
//! device trains under qwZ, qgZ and both to the same bits at stage 3 with and without
//! optimizer and parameter offload and overlapped communication (the quantizer's kernels
//! equal the CPU's bit for bit, so host and device shards quantize alike), and close to the
//! CPU's run.

mod common;
mod device_common;

use std::sync::Arc;

use common::runs::{losses, rank0, toy_steps};
use common::{config, tiny};
use device_common::Dev;
use ferrozero_config::resolved::{OffloadTarget, ResolvedConfig, ZeroStage};
use ferrozero_runtime::backend::Backend;
use ferrozero_runtime::engine::{Engine, NamedTensor};

const T: usize = 8;
const STEPS: usize = 2;

/// Each step's loss and the parameters after, on rank 0.
type Run = (Vec<f64>, Vec<NamedTensor>);

fn train(be: &Arc<dyn Backend>, cfg: &ResolvedConfig) -> Run {
    rank0(cfg.world_size, |comm| {
        let rank = comm.rank();
        let mut e = Engine::with_backend(tiny::gpt2_model(2), cfg.clone(), comm, be.clone())?;
        let reports = toy_steps(&mut e, cfg, (tiny::VOCAB, T), STEPS, rank)?;
        Ok((losses(&reports), e.parameters()?))
    })
    .expect("training failed")
}

fn bits(r: &Run) -> (Vec<u64>, Vec<Vec<u32>>) {
    let p = (r.1.iter())
        .map(|t| t.data.iter().map(|x| x.to_bits()).collect())
        .collect();
    (r.0.iter().map(|x| x.to_bits()).collect(), p)
}

fn quantized(d: &Dev, weights: bool, gradients: bool) -> ResolvedConfig {
    let precision = d.training_precision();
    let mut c = config(ZeroStage::Stage3, 2, 2, 2, precision);
    (c.zero.quantized_weights, c.zero.quantized_gradients) = (weights, gradients);
    c
}

fn zeropp_bitwise(d: &Dev) {
    let plain = train(&d.be, &quantized(d, false, false));
    for (w, g) in [(true, false), (false, true), (true, true)] {
        let base = quantized(d, w, g);
        let want = train(&d.be, &base);
        assert!(
            bits(&want).1 != bits(&plain).1,
            "{}: {w} {g}: no effect",
            d.name
        );
        let mut offload = base.clone();
        offload.zero.offload_optimizer.target = OffloadTarget::Cpu;
        offload.zero.offload_param.target = OffloadTarget::Cpu;
        let mut overlap = base.clone();
        (overlap.zero.overlap_comm, overlap.zero.max_reuse_distance) = (true, 0);
        let mut busy = offload.clone();
        (busy.zero.overlap_comm, busy.zero.max_reuse_distance) = (true, 0);
        for (what, cfg) in [
            ("offload", offload),
            ("overlap", overlap),
            ("offload, overlap, prefetch", busy),
        ] {
            let got = train(&d.be, &cfg);
            assert!(bits(&got) == bits(&want), "{}: {w} {g}, {what}", d.name);
        }
        let cpu = device_common::cpu();
        let (on_cpu, _) = train(&cpu.be, &base);
        device_common::assert_losses_close(d, &want.0, &on_cpu);
    }
}
test_device!(zeropp_bitwise);
