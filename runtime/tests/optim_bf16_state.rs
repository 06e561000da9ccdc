//! bf16 optimizer values (`bf16.bf16_master_weights_and_grads`, `bf16.bf16_optimizer_states`):
//! the host step over bf16 parameters and bf16 or f32 moments equals a reference written
//! from DeepSpeed's definition (widen to f32, the f32 update, round to nearest even), bit for
//! bit, across the widened runs' boundaries; and the engine keeps those dtypes, trains, and
//! counts (and estimates) the halved optimizer bytes.

mod common;

use common::runs::{losses, rank0, toy_steps};
use common::{config, toy};
use ferrozero_config::resolved::{OffloadTarget, Precision, ResolvedConfig, ZeroStage};
use ferrozero_offload::optim::{reference, LowPrecision};
use ferrozero_runtime::backend::{cpu, UpdateRule};
use ferrozero_runtime::engine::ledger::{Category, Location};
use ferrozero_runtime::engine::Engine;
use ferrozero_runtime::tensor::{BufMut, BufRef, View, ViewMut};
use half::bf16;

/// Past one widened run (65536 elements) and not a multiple of it.
const N: usize = 70_001;

fn wave(n: usize, k: f32, off: f32) -> Vec<f32> {
    (0..n).map(|i| ((i as f32) * k).sin() * off).collect()
}

fn to_bf16(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x)).collect()
}

fn bits(v: &[bf16]) -> Vec<u16> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn rules() -> Vec<UpdateRule> {
    common::update_rules(0.0, true)
}

/// The reference: every value widened, the reference f32 update, every value rounded back
/// (the moments only when they are stored in bf16).
fn reference_step(
    rule: &UpdateRule,
    step: u64,
    p: &mut [bf16],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    bf16_moments: bool,
) {
    let mut pf: Vec<f32> = p.iter().map(|x| x.to_f32()).collect();
    let lp = LowPrecision::None;
    match rule {
        UpdateRule::Adam(hp) => reference::adam_step(hp, step, 0.5, &mut pf, g, m, v, lp),
        UpdateRule::Sgd(hp) => reference::sgd_step(hp, step, 0.5, &mut pf, g, m, lp),
        UpdateRule::Lion(hp) => reference::lion_step(hp, 0.5, &mut pf, g, m, lp),
    }
    .unwrap();
    p.copy_from_slice(&to_bf16(&pf));
    if bf16_moments {
        for x in m.iter_mut().chain(v.iter_mut()) {
            *x = bf16::from_f32(*x).to_f32();
        }
    }
}

#[test]
fn bf16_parameters_and_moments_step_as_the_reference_does() {
    let be = cpu();
    for rule in rules() {
        let adam = matches!(rule, UpdateRule::Adam(_));
        let vn = if adam { N } else { 0 };
        for bf16_moments in [true, false] {
            let mut p = to_bf16(&wave(N, 0.37, 1.0));
            let (mut m32, mut v32) = (vec![0.0f32; N], vec![0.0f32; vn]);
            let (mut m16, mut v16) = (to_bf16(&m32), to_bf16(&v32));
            let mut want_p = p.clone();
            let (mut want_m, mut want_v) = (m32.clone(), v32.clone());
            for step in 1..=3u64 {
                let g = wave(N, 0.11 * step as f32, 0.3);
                let gv = View::Host(BufRef::F32(&g));
                let pv = ViewMut::Host(BufMut::Bf16(&mut p));
                let (mv, vv) = match bf16_moments {
                    true => (BufMut::Bf16(&mut m16), BufMut::Bf16(&mut v16)),
                    false => (BufMut::F32(&mut m32), BufMut::F32(&mut v32)),
                };
                be.optimizer_update(
                    &rule,
                    step,
                    0.5,
                    pv,
                    gv.into(),
                    ViewMut::Host(mv),
                    ViewMut::Host(vv),
                    None,
                )
                .unwrap();
                reference_step(
                    &rule,
                    step,
                    &mut want_p,
                    &g,
                    &mut want_m,
                    &mut want_v,
                    bf16_moments,
                );
            }
            let what = format!("{rule:?} bf16 moments {bf16_moments}");
            assert_eq!(bits(&p), bits(&want_p), "{what}: parameters");
            let (m, v): (Vec<f32>, Vec<f32>) = match bf16_moments {
                true => (
                    m16.iter().map(|x| x.to_f32()).collect(),
                    v16.iter().map(|x| x.to_f32()).collect(),
                ),
                false => (m32.clone(), v32.clone()),
            };
            let b = |x: &[f32]| x.iter().map(|y| y.to_bits()).collect::<Vec<_>>();
            assert_eq!(b(&m), b(&want_m), "{what}: first moments");
            assert_eq!(b(&v), b(&want_v), "{what}: second moments");
            assert!(p != to_bf16(&wave(N, 0.37, 1.0)), "{what}: nothing moved");
        }
    }
}

#[test]
fn a_separate_rounded_copy_beside_bf16_master_weights_is_an_error() {
    let be = cpu();
    let (mut p, g) = (to_bf16(&[1.0; 4]), [0.5f32; 4]);
    let (mut m, mut v, mut lp) = ([0.0f32; 4], [0.0f32; 4], to_bf16(&[0.0; 4]));
    let err = be
        .optimizer_update(
            &rules()[0],
            1,
            1.0,
            ViewMut::Host(BufMut::Bf16(&mut p)),
            View::Host(BufRef::F32(&g)).into(),
            ViewMut::Host(BufMut::F32(&mut m)),
            ViewMut::Host(BufMut::F32(&mut v)),
            Some(ViewMut::Host(BufMut::Bf16(&mut lp))),
        )
        .expect_err("two parameter copies");
    assert!(err.to_string().contains("updated in place"), "{err}");
}

fn bf16_cfg(stage: ZeroStage, world: usize, states: bool) -> ResolvedConfig {
    let mut cfg = config(stage, world, 2, 2, Precision::Bf16);
    cfg.zero.offload_optimizer.target = OffloadTarget::Cpu;
    cfg.bf16_state.master_weights_and_grads = true;
    cfg.bf16_state.optimizer_states = states;
    cfg
}

/// Parameter bits, per-step losses and host optimizer-state bytes of rank 0.
fn train(cfg: &ResolvedConfig) -> (Vec<u32>, Vec<f64>, u64) {
    rank0(cfg.world_size, |comm| {
        let rank = comm.rank();
        let mut e = Engine::new(toy::model(11, 6, 5, 3), cfg.clone(), comm)?;
        let losses = losses(&toy_steps(&mut e, cfg, (11, 5), 6, rank)?);
        let bits = e
            .parameters()?
            .iter()
            .flat_map(|t| t.data.iter().map(|x| x.to_bits()))
            .collect();
        let opt = e.ledger().peak(Location::Host, Category::OptimizerState);
        Ok((bits, losses, opt))
    })
    .expect("training failed")
}

#[test]
fn the_engine_trains_with_bf16_optimizer_values_and_counts_half_the_bytes() {
    let model = toy::model(11, 6, 5, 3);
    let n = model.num_params() as u64;
    for world in [1, 2] {
        let mut f32_state = bf16_cfg(ZeroStage::Stage2, world, false);
        f32_state.bf16_state = Default::default();
        let (_, _, full) = train(&f32_state);
        for states in [false, true] {
            let mut per_stage = Vec::new();
            for stage in [ZeroStage::Stage1, ZeroStage::Stage2, ZeroStage::Stage3] {
                let cfg = bf16_cfg(stage, world, states);
                let (bits, losses, opt) = train(&cfg);
                let what = format!("{stage:?} world {world} bf16 states {states}");
                assert!(losses[5] < losses[0], "{what}: the loss falls: {losses:?}");
                // Without the f32 master weights (4 of 12 bytes per parameter), and with bf16
                // moments half of the rest; padding adds a little to both.
                let want = if states { full / 3 } else { full * 2 / 3 };
                assert!(
                    opt.abs_diff(want) * 100 <= want,
                    "{what}: optimizer state {opt} bytes, want about {want} (f32 state {full}, {n} parameters)"
                );
                per_stage.push(bits);
            }
            // The update is element-wise: stages give the same bits here too.
            assert!(
                per_stage.windows(2).all(|w| w[0] == w[1]),
                "world {world} bf16 states {states}: stages differ"
            );
        }
    }
}
