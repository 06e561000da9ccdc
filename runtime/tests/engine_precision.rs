//! fp16 with dynamic loss scaling: overflowing steps are skipped, the scale falls as
//! DeepSpeed's scaler says, and parameters never see Inf or NaN.

mod common;

use std::time::Duration;

use common::{config, toy};
use ferrozero_config::resolved::{LossScaling, Precision, ZeroStage};
use ferrozero_runtime::comm::local::run_ranks;
use ferrozero_runtime::engine::Engine;

#[test]
fn fp16_overflow_skips_steps_and_never_corrupts_parameters() {
    let scaling = common::dynamic_scaling(40, 4, 1);
    for stage in [ZeroStage::Stage0, ZeroStage::Stage3] {
        let cfg = config(stage, 2, 2, 1, Precision::Fp16(scaling.clone()));
        let reports = run_ranks(2, Duration::from_secs(30), |comm| {
            let rank = comm.rank();
            let mut e = Engine::new(toy::model(11, 6, 5, 2), cfg.clone(), comm)?;
            let before = e.parameters()?;
            let mut out = Vec::new();
            for s in 0..30 {
                let r = e.train_batch(&[toy::batch(11, 5, (s * 2 + rank) * 2, 2)])?;
                let p = e.parameters()?;
                assert!(
                    p.iter().all(|t| t.data.iter().all(|x| x.is_finite())),
                    "non-finite parameter at step {s}"
                );
                if s == 0 {
                    assert!(r.skipped);
                    assert_eq!(p, before, "a skipped step changed parameters");
                }
                out.push(r);
            }
            Ok(out)
        })
        .unwrap();
        let r = &reports[0];
        // 2^40 overflows f16 at once; each overflow halves the scale until gradients fit.
        let skipped = r.iter().take_while(|s| s.skipped).count();
        assert!((1..30).contains(&skipped), "{stage:?}: {skipped} skipped");
        for (i, s) in r.iter().take(skipped).enumerate() {
            assert_eq!(s.loss_scale, 2f64.powi(40 - i as i32));
            assert!(s.grad_norm.is_nan());
        }
        assert!(r[skipped..]
            .iter()
            .any(|s| !s.skipped && s.grad_norm.is_finite()));
        // Ranks agree on every decision (memory differs per rank, so compare the rest).
        let decisions = |r: &Vec<ferrozero_runtime::engine::StepReport>| {
            r.iter()
                .map(|s| {
                    (
                        s.step,
                        s.loss.to_bits(),
                        s.loss_scale.to_bits(),
                        s.skipped,
                        s.grad_norm.to_bits(),
                    )
                })
                .collect::<Vec<_>>()
        };
        assert!(
            decisions(&reports[0]) == decisions(&reports[1]),
            "ranks disagree"
        );
    }
}

#[test]
fn static_loss_scale_trains() {
    let cfg = config(
        ZeroStage::Stage2,
        1,
        4,
        1,
        Precision::Fp16(LossScaling::Static(128.0)),
    );
    let losses = run_ranks(1, Duration::from_secs(30), |comm| {
        let mut e = Engine::new(toy::model(11, 6, 5, 2), cfg.clone(), comm)?;
        (0..20)
            .map(|s| Ok(e.train_batch(&[toy::batch(11, 5, s * 4, 4)])?.loss))
            .collect::<Result<Vec<_>, _>>()
    })
    .unwrap();
    assert!(losses[0][19] < losses[0][0]);
}
