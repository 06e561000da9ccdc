//! bf16 optimizer values in the device's memory (`bf16.bf16_master_weights_and_grads` with
//! `bf16.bf16_optimizer_states`, no offload), on every device: the step over bf16 parameters
//! and moments is the CPU host step's bits (which `optim_bf16_state.rs` holds to the widen,
//! f32 update, round-to-nearest-even reference, and `optim_bf16_reference.rs` to PyTorch), for
//! Adam, AdamW, SGD and Lion and gradients in every form the engine hands over; and the
//! engine keeps bf16 moments on the device, counts a third of the f32 state's optimizer bytes,
//! and trains to the same bits at stages 1-3, with and without overlapped communication, and
//! with the state offloaded to the host step.

mod common;
mod device_common;

use std::sync::Arc;

use common::config;
use common::runs::{losses, rank0, toy_steps};
use device_common::{rand, Dev};
use ferrozero_config::resolved::{OffloadTarget, Precision, ResolvedConfig, ZeroStage};
use ferrozero_runtime::backend::{Backend, GradView, StepTensor, UpdateRule};
use ferrozero_runtime::engine::ledger::{Category, Location};
use ferrozero_runtime::engine::Engine;
use ferrozero_runtime::nn::Model;
use ferrozero_runtime::tensor::{DType, FlatBuf, Storage};

/// Past one chunk of the device's launch (65536) and of the host step's widened run, with
/// a tail that is not a multiple of the kernels' vectors.
const N: usize = 70_001;

fn rules() -> Vec<UpdateRule> {
    common::update_rules(0.1, false)
}

fn put(d: &Dev, dtype: DType, vals: &[f32]) -> Storage {
    let mut b = FlatBuf::zeros(dtype, vals.len());
    b.store_f32(0, vals);
    d.be.upload(b.as_ref()).expect("upload")
}

fn bits(s: &Storage) -> Vec<u32> {
    s.to_vec_f32()
        .expect("download")
        .iter()
        .map(|x| x.to_bits())
        .collect()
}

/// How the gradients come: bf16 as stored, f32 as stored, or f32 read as the bf16
/// accumulator they stand for (one micro-step per step).
const GRADS: [(DType, Option<DType>); 3] = [
    (DType::Bf16, None),
    (DType::F32, None),
    (DType::F32, Some(DType::Bf16)),
];

/// One tensor's values: parameters, first and second moments in `state`, and, for f32
/// state, a bf16 copy written in the same pass.
struct Tensor {
    p: Storage,
    m: Storage,
    v: Storage,
    lp: Option<Storage>,
}

fn tensor(d: &Dev, n: usize, seed: u64, state: DType, adam: bool) -> Tensor {
    let v0: Vec<f32> = rand(n, seed + 2).iter().map(|x| x * x * 1e-3).collect();
    Tensor {
        p: put(d, state, &rand(n, seed)),
        m: put(
            d,
            state,
            &rand(n, seed + 1)
                .iter()
                .map(|x| x * 1e-2)
                .collect::<Vec<_>>(),
        ),
        v: put(d, state, if adam { &v0 } else { &[] }),
        lp: (state == DType::F32).then(|| put(d, DType::Bf16, &vec![0.0; n])),
    }
}

/// Three steps of `rule` over two bf16-state tensors and an f32-state one in one call (the
/// device launches each kernel variant once), gradients read as `grads` says; every value's
/// bits after.
fn steps(d: &Dev, rule: &UpdateRule, grads: (DType, Option<DType>)) -> Vec<Vec<u32>> {
    let adam = matches!(rule, UpdateRule::Adam(_));
    let mut ts = [
        tensor(d, N, 10, DType::Bf16, adam),
        tensor(d, 13, 20, DType::Bf16, adam),
        tensor(d, 300, 30, DType::F32, adam),
    ];
    for step in 1..=3u64 {
        let gs: Vec<Storage> = ts
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let g = rand(t.p.len(), 100 * step + i as u64);
                put(d, grads.0, &g.iter().map(|x| x * 3.0).collect::<Vec<_>>())
            })
            .collect();
        let tensors = ts
            .iter_mut()
            .zip(&gs)
            .map(|(t, g)| StepTensor {
                params: t.p.view_mut(),
                grads: match grads.1 {
                    Some(r) => GradView::rounded(g.view(), r),
                    None => GradView::exact(g.view()),
                },
                m: t.m.view_mut(),
                v: t.v.view_mut(),
                lp: t.lp.as_mut().map(|l| l.view_mut()),
            })
            .collect();
        d.be.optimizer_update_all(rule, step, 0.5, tensors)
            .expect("optimizer step");
    }
    ts.iter()
        .flat_map(|t| [&t.p, &t.m, &t.v].into_iter().chain(t.lp.as_ref()))
        .map(bits)
        .collect()
}

/// The device's step over bf16 parameters and moments (and an f32-state tensor beside them)
/// is the CPU's, bit for bit.
fn bf16_state_step_equals_the_cpu(d: &Dev) {
    let cpu = device_common::cpu();
    for rule in rules() {
        for grads in GRADS {
            let got = steps(d, &rule, grads);
            let want = steps(&cpu, &rule, grads);
            for (k, (g, w)) in got.iter().zip(&want).enumerate() {
                let diff = g.iter().zip(w).filter(|(a, b)| a != b).count();
                assert!(
                    diff == 0,
                    "{}: {rule:?}, gradients {grads:?}: buffer {k} differs from the CPU's in \
                     {diff} of {} elements",
                    d.name,
                    g.len()
                );
            }
            // The bf16 values moved, and stayed bf16 (the low half of every f32 is zero).
            let start = tensor(&cpu, N, 10, DType::Bf16, true);
            assert!(got[0] != bits(&start.p), "{}: nothing moved", d.name);
            assert!(got[0].iter().all(|b| b & 0xffff == 0), "{}", d.name);
        }
    }
}
test_device!(bf16_state_step_equals_the_cpu);

/// A rounded copy beside bf16 master weights is refused (the parameters are their own), on
/// the device as on the CPU.
fn a_copy_beside_bf16_state_is_refused(d: &Dev) {
    let mut t = tensor(d, 8, 1, DType::Bf16, true);
    let g = put(d, DType::Bf16, &[0.5; 8]);
    let mut lp = put(d, DType::Bf16, &[0.0; 8]);
    let err =
        d.be.optimizer_update(
            &rules()[0],
            1,
            1.0,
            t.p.view_mut(),
            GradView::exact(g.view()),
            t.m.view_mut(),
            t.v.view_mut(),
            Some(lp.view_mut()),
        )
        .expect_err("two parameter copies");
    assert!(err.to_string().contains("updated in place"), "{err}");
}
test_device!(a_copy_beside_bf16_state_is_refused);

const V: usize = 23;
const T: usize = 6;

fn model() -> Model {
    common::tiny::small_llama(V, T)
}

/// bf16 training at two ranks with bf16 master weights and moments in the device's memory.
fn cfg_for(stage: ZeroStage) -> ResolvedConfig {
    cfg_world(stage, 2)
}

fn cfg_world(stage: ZeroStage, world: usize) -> ResolvedConfig {
    let mut c = config(stage, world, 2, 2, Precision::Bf16);
    c.bf16_state.master_weights_and_grads = true;
    c.bf16_state.optimizer_states = true;
    c
}

/// Rank 0's losses, parameter bits, and peak optimizer bytes on the device and the host.
type Run = (Vec<f64>, Vec<Vec<u32>>, (u64, u64));

fn train(be: &Arc<dyn Backend>, cfg: &ResolvedConfig) -> Run {
    rank0(cfg.world_size, |comm| {
        let rank = comm.rank();
        let mut e = Engine::with_backend(model(), cfg.clone(), comm, be.clone())?;
        let losses = losses(&toy_steps(&mut e, cfg, (V, T), 4, rank)?);
        let bits = e
            .parameters()?
            .iter()
            .map(|t| t.data.iter().map(|x| x.to_bits()).collect())
            .collect();
        let opt = |at| e.ledger().peak(at, Category::OptimizerState);
        Ok((losses, bits, (opt(Location::Device), opt(Location::Host))))
    })
    .expect("training failed")
}

/// Stages 1-3, with and without overlapped communication, and with the state and the
/// parameter shards offloaded (the host step, the optimizer overlapped with backward): the same losses and
/// parameters; the device holds a third of the optimizer bytes f32 state takes (no f32
/// master weights, bf16 moments of half the bytes), and training moves the loss.
fn bf16_state_trains_bitwise_across_stages(d: &Dev) {
    if d.act() != DType::Bf16 && d.name != "cpu" {
        // bf16_optimizer_states needs bf16 training, which a device computing in f32 does
        // not run (the CPU runs it with f32 arithmetic).
        eprintln!("skipped on {}: f32 activations", d.name);
        return;
    }
    let (losses, want, (opt, host)) = train(&d.be, &cfg_for(ZeroStage::Stage1));
    assert!(losses[3] < losses[0], "{}: {losses:?}", d.name);
    assert_eq!(host, 0, "{}: optimizer bytes on the host", d.name);
    let mut f32_state = cfg_for(ZeroStage::Stage1);
    f32_state.bf16_state = Default::default();
    let (_, _, (full, _)) = train(&d.be, &f32_state);
    eprintln!(
        "{}: device optimizer bytes: f32 state {full}, bf16 state {opt}",
        d.name
    );
    assert_eq!(opt * 3, full, "{}: f32 state {full}, bf16 {opt}", d.name);
    let mut others = Vec::new();
    for stage in [ZeroStage::Stage1, ZeroStage::Stage2, ZeroStage::Stage3] {
        let mut c = cfg_for(stage);
        others.push((format!("{stage:?}"), c.clone()));
        c.zero.overlap_comm = true;
        others.push((format!("{stage:?} overlapped"), c));
    }
    let mut host_step = cfg_for(ZeroStage::Stage3);
    host_step.zero.offload_optimizer.target = OffloadTarget::Cpu;
    host_step.zero.offload_param.target = OffloadTarget::Cpu;
    host_step.zero.overlap_comm = true;
    others.push((
        "the host step (offloaded, optimizer overlap)".into(),
        host_step,
    ));
    for (what, cfg) in others.into_iter().skip(1) {
        let (l, p, _) = train(&d.be, &cfg);
        assert_eq!(l, losses, "{}: {what}: losses", d.name);
        assert!(p == want, "{}: {what}: parameters differ", d.name);
    }
}
test_device!(bf16_state_trains_bitwise_across_stages);

/// At one rank the step is whole (status, clipping scale and update in one call on a
/// device): stages 1 and 3 give the same bits there too, and the loss falls.
fn bf16_state_whole_step_at_one_rank(d: &Dev) {
    if d.act() != DType::Bf16 && d.name != "cpu" {
        eprintln!("skipped on {}: f32 activations", d.name);
        return;
    }
    let (losses, want, _) = train(&d.be, &cfg_world(ZeroStage::Stage1, 1));
    assert!(losses[3] < losses[0], "{}: {losses:?}", d.name);
    let (l, p, _) = train(&d.be, &cfg_world(ZeroStage::Stage3, 1));
    assert_eq!(l, losses, "{}: stage 3 losses", d.name);
    assert!(p == want, "{}: stage 3 parameters differ", d.name);
}
test_device!(bf16_state_whole_step_at_one_rank);
