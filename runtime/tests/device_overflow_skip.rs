//! fp16's overflow skip when the step runs whole on the device: from a loss scale that makes
//! the gradients overflow, the emulated device skips exactly the steps the CPU skips (the
//! verdict decided on the device, the NaN scale leaving every parameter as it was), halves the
//! scale as the CPU does once it reads the step's status, and updates once the scale fits.

#![cfg(feature = "cuda")]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::tiny::{self, VOCAB};
use common::{config, toy};
use ferrozero_config::resolved::{Precision, ZeroStage};
use ferrozero_runtime::backend::{self, cuda, Backend};
use ferrozero_runtime::comm::local::run_ranks;
use ferrozero_runtime::engine::Engine;

use ferrozero_runtime::tensor::DType;

const STEPS: usize = 14;

/// Per step: skipped, the loss scale used, and whether the parameters changed.
type Trail = Vec<(bool, f64, bool)>;

fn run(be: impl Fn() -> Arc<dyn Backend> + Sync) -> Trail {
    // 2^24 overflows fp16 gradients; hysteresis 1 halves the scale on every overflow.
    let mut cfg = config(
        ZeroStage::Stage0,
        1,
        1,
        1,
        Precision::Fp16(common::dynamic_scaling(24, 1000, 1)),
    );
    cfg.zero.sub_group_size = 1_000_000_000;
    let out = run_ranks(1, Duration::from_secs(300), |comm| {
        let mut e = Engine::with_backend(tiny::gpt2_model(1), cfg.clone(), comm, be())?;
        let mut trail = Vec::new();
        for s in 0..STEPS {
            let before = e.parameters()?;
            let r = e.train_batch(&[toy::batch(VOCAB, 8, s, 1)])?;
            let after = e.parameters()?;
            let changed = before.iter().zip(&after).any(|(a, b)| {
                a.data
                    .iter()
                    .zip(&b.data)
                    .any(|(x, y)| x.to_bits() != y.to_bits())
            });
            trail.push((r.skipped, r.loss_scale, changed));
        }
        Ok(trail)
    })
    .expect("training");
    out.into_iter().next().expect("rank 0")
}

#[test]
fn overflow_skips_on_the_device_as_on_the_cpu() {
    let dev = match cuda::emulated(DType::F16) {
        Ok(d) => d,
        Err(e) => {
            cuda::emu::skip_unless_required(&format!("emulated device: {e}"));
            return;
        }
    };
    let emulated = run(|| dev.clone() as Arc<dyn Backend>);
    let host = run(backend::cpu);
    println!("device: {emulated:?}\nhost:   {host:?}");
    for (i, (&(skipped, scale, changed), &(cpu_skipped, cpu_scale, _))) in
        emulated.iter().zip(&host).enumerate()
    {
        assert_eq!(skipped, cpu_skipped, "step {i}: skipped as on the CPU");
        assert_eq!(scale, cpu_scale, "step {i}: loss scale as on the CPU");
        assert_eq!(
            changed, !skipped,
            "step {i}: parameters change exactly when applied"
        );
    }
    assert!(emulated[0].0, "the first step overflows: {emulated:?}");
    assert!(
        emulated.iter().any(|s| !s.0),
        "a later scale fits and the step is applied: {emulated:?}"
    );
}
