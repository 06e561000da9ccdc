//! f32 gradient accumulators (`data_types.grad_accum_dtype = "fp32"`) on every device: in a
//! bf16 run two ranks on one device train to the same bits at stages 0, 1 and 3 (offloaded and
//! overlapped), unlike bf16 accumulation, and close to the CPU's run; in an f32 run the key
//! changes nothing.

mod common;
mod device_common;

use std::sync::Arc;
use std::time::Duration;

use common::{config, tiny, toy};
use device_common::Dev;
use ferrozero_config::resolved::{OffloadTarget, ResolvedConfig, ZeroStage};
use ferrozero_runtime::backend::Backend;
use ferrozero_runtime::comm::local::run_ranks;
use ferrozero_runtime::engine::Engine;
use ferrozero_runtime::tensor::DType;

const T: usize = 8;
const GAS: usize = 4;
const WORLD: usize = 2;

fn cfg(d: &Dev, stage: ZeroStage, f32_acc: bool) -> ResolvedConfig {
    let precision = d.training_precision();
    let mut c = config(stage, WORLD, 1, GAS, precision);
    c.grad_accum_f32 = f32_acc;
    c
}

/// Rank 0's losses and final parameter bits over two steps; both ranks compute on `be`.
fn train(be: &Arc<dyn Backend>, cfg: &ResolvedConfig) -> (Vec<f64>, Vec<Vec<u32>>) {
    let out = run_ranks(WORLD, Duration::from_secs(300), |comm| {
        let rank = comm.rank();
        let mut e = Engine::with_backend(tiny::gpt2_model(2), cfg.clone(), comm, be.clone())?;
        let mut losses = Vec::new();
        for s in 0..2 {
            let batches: Vec<_> = (0..GAS)
                .map(|m| toy::batch(tiny::VOCAB, T, (s * GAS + m) * WORLD + rank, 1))
                .collect();
            losses.push(e.train_batch(&batches)?.loss);
        }
        let params = e.parameters()?;
        let bits = params
            .iter()
            .map(|t| t.data.iter().map(|x| x.to_bits()).collect());
        Ok((losses, bits.collect()))
    })
    .expect("training failed");
    out.into_iter().next().unwrap()
}

fn f32_accumulation(d: &Dev) {
    let (losses, params) = train(&d.be, &cfg(d, ZeroStage::Stage0, true));
    let mut busy = cfg(d, ZeroStage::Stage3, true);
    busy.zero.offload_optimizer.target = OffloadTarget::Cpu;
    busy.zero.overlap_comm = true;
    for c in [cfg(d, ZeroStage::Stage1, true), busy] {
        let (l, p) = train(&d.be, &c);
        assert_eq!(l, losses, "{}: {:?}", d.name, c.zero.stage);
        assert!(
            p == params,
            "{}: {:?} changed the parameters",
            d.name,
            c.zero.stage
        );
    }
    let (_, narrow) = train(&d.be, &cfg(d, ZeroStage::Stage0, false));
    // Only a half-precision run has anything to widen.
    assert_eq!(narrow == params, d.act() == DType::F32, "{}", d.name);
    let cpu = device_common::cpu();
    let (want, _) = train(&cpu.be, &cfg(d, ZeroStage::Stage0, true));
    device_common::assert_losses_close(d, &losses, &want);
}
test_device!(f32_accumulation);
