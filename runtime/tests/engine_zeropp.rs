//! ZeRO++ quantized communication (DeepSpeed's meaning) at two local ranks on the CPU: qwZ
//! (`zero_quantized_weights`), qgZ (`zero_quantized_gradients`) and both train to the same
//! bits with and without optimizer and parameter offload, overlapped communication, prefetch
//! and chunked buckets, and qwZ with hpZ (4 ranks in groups of 2) equals it without; the
//! quantization really happens (the parameters differ from unquantized training); frozen
//! parameters' gathers are quantized under `zero_quantized_nontrainable_weights` only; the
//! comms logger sees the packed bytes, by the ratio the wire formats give; and a tiny GPT
//! trains to within a stated tolerance of unquantized training.

mod common;

use common::runs::{train_logged as train, Logged as Run, D, LAYERS, T, V};
use common::{comms_logger, config, tiny, toy};
use ferrozero_config::resolved::{OffloadTarget, Precision, ResolvedConfig, ZeroStage};
use ferrozero_runtime::comm::logger::OpSummary;
use ferrozero_runtime::engine::partition::GroupLayout;
use ferrozero_runtime::engine::NamedTensor;
use ferrozero_runtime::nn::Model;
use ferrozero_runtime::tensor::quant::{Packed, QuantFormat};

fn toy_model() -> Model {
    toy::model(V, D, T, LAYERS)
}

fn toy_run(cfg: &ResolvedConfig) -> Run {
    train(cfg, toy_model, V, 6)
}

#[derive(Clone, Copy, Debug)]
enum Mode {
    Weights,
    Gradients,
    Both,
}

fn stage3(world: usize, mode: Option<Mode>) -> ResolvedConfig {
    let mut cfg = config(ZeroStage::Stage3, world, 2, 2, Precision::F32);
    cfg.zero.quantized_weights = matches!(mode, Some(Mode::Weights | Mode::Both));
    cfg.zero.quantized_gradients = matches!(mode, Some(Mode::Gradients | Mode::Both));
    cfg
}

fn bits(p: &[NamedTensor]) -> Vec<Vec<u32>> {
    p.iter()
        .map(|t| t.data.iter().map(|x| x.to_bits()).collect())
        .collect()
}

fn same(a: &Run, b: &Run) -> bool {
    a.losses
        .iter()
        .map(|x| x.to_bits())
        .eq(b.losses.iter().map(|x| x.to_bits()))
        && bits(&a.params) == bits(&b.params)
}

/// The schedules a quantized run must not change the bits under.
fn variants(mode: Mode) -> Vec<(&'static str, ResolvedConfig)> {
    let base = || stage3(2, Some(mode));
    let mut opt = base();
    opt.zero.offload_optimizer.target = OffloadTarget::Cpu;
    let mut both = base();
    both.zero.offload_optimizer.target = OffloadTarget::Cpu;
    both.zero.offload_param.target = OffloadTarget::Cpu;
    let mut overlap = base();
    overlap.zero.overlap_comm = true;
    let mut prefetch = base();
    (prefetch.zero.overlap_comm, prefetch.zero.max_reuse_distance) = (true, 0);
    prefetch.zero.prefetch_bucket_size = 1 << 20;
    prefetch.zero.offload_param.target = OffloadTarget::Cpu;
    let mut whole = base();
    whole.zero.allgather_bucket_size = 1 << 30;
    whole.zero.reduce_bucket_size = 1 << 30;
    vec![
        ("optimizer offload", opt),
        ("optimizer and parameter offload", both),
        ("overlap", overlap),
        ("overlap, prefetch, no reuse, parameter offload", prefetch),
        ("whole-unit buckets", whole),
    ]
}

#[test]
fn quantized_stage3_is_bitwise_across_offload_overlap_and_prefetch() {
    let plain = toy_run(&stage3(2, None));
    for mode in [Mode::Weights, Mode::Gradients, Mode::Both] {
        let want = toy_run(&stage3(2, Some(mode)));
        // The quantization really happens.
        assert!(
            bits(&want.params) != bits(&plain.params),
            "{mode:?}: no effect"
        );
        for (what, cfg) in variants(mode) {
            let got = toy_run(&cfg);
            assert!(
                same(&got, &want),
                "{mode:?}, {what}: losses {:?} vs {:?}",
                got.losses,
                want.losses
            );
        }
    }
}

#[test]
fn qgz_over_a_bf16_wire_sums_in_f32_and_rounds_once() {
    // `communication_data_type` rounds each rank's gradient to bf16 before qgZ quantizes it
    // (DeepSpeed casts before its all-to-all too); the owner's f32 sum is rounded once into
    // the bf16 shard: bitwise across overlap and offload, and not the f32 wire's result.
    let with = |c: &mut ResolvedConfig| {
        c.comms.data_type = Some(ferrozero_config::resolved::CommDataType::Bf16)
    };
    let mut base = stage3(2, Some(Mode::Gradients));
    let f32_wire = toy_run(&base);
    with(&mut base);
    let want = toy_run(&base);
    assert!(bits(&want.params) != bits(&f32_wire.params));
    for (what, mut cfg) in variants(Mode::Gradients) {
        with(&mut cfg);
        assert!(same(&toy_run(&cfg), &want), "bf16 wire, {what}");
    }
}

#[test]
fn qwz_with_hpz_trains_like_qwz_alone() {
    // hpZ's secondary copy holds the values forward's quantized gather produced, so
    // backward computes with forward's bits.
    for overlap in [false, true] {
        let mut cfg = stage3(4, Some(Mode::Both));
        (cfg.zero.overlap_comm, cfg.zero.max_reuse_distance) = (overlap, 0);
        let want = toy_run(&cfg);
        cfg.zero.hpz_partition_size = 2;
        let got = toy_run(&cfg);
        assert!(same(&got, &want), "overlap {overlap}");
    }
}

fn part_frozen() -> Model {
    let f = ferrozero_runtime::nn::freeze::Freeze::new(&["*.attn.*"]).unwrap();
    tiny::gpt2_model(2).freeze(f).unwrap()
}

#[test]
fn nontrainable_weights_quantize_only_frozen_gathers() {
    let run = |nontrainable: bool, weights: bool| {
        let mut cfg = stage3(2, weights.then_some(Mode::Weights));
        cfg.zero.quantized_nontrainable_weights = nontrainable;
        train(&cfg, part_frozen, tiny::VOCAB, 3)
    };
    let plain = run(false, false);
    let frozen_q = run(true, false);
    let all_q = run(false, true);
    // Frozen values are stored unchanged either way; what trains sees their quantized copy.
    let frozen: Vec<_> = plain
        .params
        .iter()
        .map(|p| p.name.contains(".attn."))
        .collect();
    for ((a, b), f) in plain.params.iter().zip(&frozen_q.params).zip(&frozen) {
        if *f {
            assert_eq!(bits(std::slice::from_ref(a)), bits(std::slice::from_ref(b)));
        }
    }
    assert!(bits(&plain.params) != bits(&frozen_q.params));
    assert!(bits(&frozen_q.params) != bits(&all_q.params));
    // Under qwZ every gather is quantized already: the frozen flag adds nothing.
    let mut both = stage3(2, Some(Mode::Weights));
    both.zero.quantized_nontrainable_weights = true;
    assert!(same(&train(&both, part_frozen, tiny::VOCAB, 3), &all_q));
}

fn logged(mode: Option<Mode>) -> Vec<OpSummary> {
    let mut cfg = stage3(2, mode);
    cfg.zero.allgather_bucket_size = 1 << 30;
    cfg.zero.reduce_bucket_size = 1 << 30;
    cfg.monitor.comms_logger = Some(comms_logger());
    toy_run(&cfg).comms.expect("the logger is on")
}

/// (message size, calls) of `op`'s rows.
fn rows(r: &[OpSummary], op: &str) -> Vec<(u64, u64)> {
    let mut v: Vec<_> = r
        .iter()
        .filter(|x| x.op == op)
        .map(|x| (x.msg_size, x.count))
        .collect();
    v.sort();
    v
}

fn total(r: &[OpSummary], op: &str) -> u64 {
    r.iter().filter(|x| x.op == op).map(|x| x.bytes).sum()
}

/// Every stage-3 group's shard length at world 2.
fn shard_lens() -> Vec<usize> {
    let model = toy_model();
    let mut specs: Vec<_> = model.units.iter().map(|u| u.module.param_specs()).collect();
    specs.push(model.shared.clone());
    specs
        .iter()
        .filter(|s| !s.is_empty())
        .map(|s| GroupLayout::new(s, 2).shard_len)
        .collect()
}

#[test]
fn comms_logger_counts_the_packed_bytes() {
    let plain = logged(None);
    let q = logged(Some(Mode::Both));
    // Each gather's message is a shard's int8 codes and f32 block scales instead of its f32
    // values: for every shard length s, (s + 4 blocks) rounded to 4 bytes, not 4 s.
    let packed = |fmt: fn(usize) -> QuantFormat, s: usize| {
        Packed {
            fmt: fmt(s),
            len: s,
        }
        .bytes() as u64
    };
    let gather_plain = rows(&plain, "all_gather_into_tensor");
    let mut want: Vec<_> = gather_plain
        .iter()
        .map(|&(m, c)| (packed(QuantFormat::weights, m as usize / 4), c))
        .collect();
    want.sort();
    assert_eq!(rows(&q, "all_gather_into_tensor"), want);
    // The reduce-scatter (DeepSpeed logs its output: 4 s bytes) becomes an all-to-all
    // (logged by its input: 2 slots of 4-bit codes and scales, (s / 2 + 4 blocks) each).
    let rs = rows(&plain, "reduce_scatter_tensor");
    let mut want: Vec<_> = rs
        .iter()
        .map(|&(m, c)| (2 * packed(QuantFormat::gradients, m as usize / 4), c))
        .collect();
    want.sort();
    assert_eq!(rows(&q, "all_to_all_single"), want);
    assert!(rows(&q, "reduce_scatter_tensor").is_empty());
    // The ratios these shards give (the toy's shards are small: scales weigh more than at
    // DeepSpeed's 8000-element groups, where int8 is 0.2505 of f32).
    let ratio = |a: u64, b: u64| a as f64 / b as f64;
    let g = ratio(
        total(&q, "all_gather_into_tensor"),
        total(&plain, "all_gather_into_tensor"),
    );
    let r = ratio(
        total(&q, "all_to_all_single"),
        total(&plain, "reduce_scatter_tensor"),
    );
    let lens = shard_lens();
    let s = lens.iter().max().copied().unwrap();
    assert!(g < 0.25 + 4.0 / s as f64 + 0.05, "all-gather ratio {g}");
    assert!(
        r < 2.0 * (0.125 + 4.0 / s as f64) + 0.05,
        "reduction ratio {r}"
    );
    eprintln!("all-gather bytes x{g:.4}, reduction bytes x{r:.4} (shards {lens:?})");
}

/// Mean loss of the last 20 steps.
fn tail(r: &Run) -> f64 {
    let n = r.losses.len();
    r.losses[n - 20..].iter().sum::<f64>() / 20.0
}

/// A one-block GPT-2 (16 wide), 200 steps at two ranks: the mean loss of the last 20 steps
/// within 5% of unquantized training. Measured (loss 4.09 at the start, 2.132 unquantized):
/// qwZ -0.07%, qgZ +1.86%, both +1.66% (qgZ's 4-bit codes cost the most, as in DeepSpeed).
#[test]
fn tiny_gpt_trains_close_to_unquantized() {
    const STEPS: usize = 200;
    let build = || tiny::gpt2_model(1);
    let mut cfg = stage3(2, None);
    cfg.optimizer = ferrozero_config::resolved::OptimizerConfig::Adam {
        lr: 3e-3,
        betas: (0.9, 0.95),
        eps: 1e-8,
        weight_decay: 0.0,
        adam_w_mode: true,
        bias_correction: true,
    };
    let plain = train(&cfg, build, tiny::VOCAB, STEPS);
    let start = plain.losses[0];
    for mode in [Mode::Weights, Mode::Gradients, Mode::Both] {
        let mut c = cfg.clone();
        c.zero.quantized_weights = matches!(mode, Mode::Weights | Mode::Both);
        c.zero.quantized_gradients = matches!(mode, Mode::Gradients | Mode::Both);
        let q = train(&c, build, tiny::VOCAB, STEPS);
        let gap = (tail(&q) - tail(&plain)) / tail(&plain);
        eprintln!(
            "{mode:?}: loss {start:.4} -> {:.4} vs unquantized {:.4} (relative gap {gap:+.4})",
            tail(&q),
            tail(&plain)
        );
        assert!(tail(&q) < 0.6 * start, "{mode:?} did not train");
        assert!(gap.abs() < 0.05, "{mode:?}: relative gap {gap}");
        assert!(
            bits(&q.params) != bits(&plain.params),
            "{mode:?}: no effect"
        );
    }
}
