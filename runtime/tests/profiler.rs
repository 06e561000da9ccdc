//! `flops_profiler` on every device (the CPU, the CUDA backend on the emulator): the FLOPs
//! of a GPT-2 and a Llama step equal the analytic count, the profile is taken at
//! `profile_step` only and names every unit, the training thread's shares fill the step,
//! the table is written to `output_file`; the profiler changes no bit of training.

mod common;
mod device_common;
mod nn_common;

use std::sync::Arc;
use std::time::Duration;

use common::config;
use common::scratch::Scratch;
use device_common::Dev;
use ferrozero_config::resolved::{FlopsProfilerConfig, MonitorOutput, ResolvedConfig, ZeroStage};
use ferrozero_runtime::backend::Backend;
use ferrozero_runtime::comm::local::run_ranks;
use ferrozero_runtime::engine::{Engine, NamedTensor, StepReport};
use ferrozero_runtime::nn::gpt2::{self, Gpt2Config};
use ferrozero_runtime::nn::llama::{self, LlamaConfig};
use ferrozero_runtime::nn::Model;
use ferrozero_runtime::profiler::{model_flops_per_token, Family, FlopsProfile};

const B: usize = 2;
const T: usize = 7;
const STEPS: usize = 3;

fn gpt2_cfg() -> Gpt2Config {
    let mut c = Gpt2Config::preset("tiny").unwrap();
    (c.n_layer, c.n_head, c.n_embd, c.vocab_size, c.n_positions) = (2, 3, 24, 37, 16);
    c
}

fn llama_cfg() -> LlamaConfig {
    let mut c = LlamaConfig::preset("tiny").unwrap();
    (c.hidden_size, c.intermediate_size, c.num_hidden_layers) = (24, 40, 2);
    (c.num_attention_heads, c.num_key_value_heads, c.vocab_size) = (6, Some(2), 29);
    c.max_position_embeddings = 16;
    c.tie_word_embeddings = false;
    c
}

/// GPT-2's matrix products per step: per token `2·(12·L·C² + V·C)` forward (the head tied
/// to `wte`), twice that backward; causal attention `6·L·B·C·T²`.
fn gpt2_flops(c: &Gpt2Config) -> u64 {
    let (l, e, v) = (c.n_layer as u64, c.n_embd as u64, c.vocab_size as u64);
    let tokens = (B * T) as u64;
    6 * tokens * (12 * l * e * e + v * e) + 6 * l * (B as u64) * e * (T * T) as u64
}

/// Llama's: q and o `C·Hq·d`, k and v `C·Hkv·d`, gate, up and down `C·I` per layer, the
/// untied head `V·C`; attention over the query heads.
fn llama_flops(c: &LlamaConfig) -> u64 {
    let (e, i, l) = (
        c.hidden_size as u64,
        c.intermediate_size as u64,
        c.num_hidden_layers as u64,
    );
    let d = (c.hidden_size / c.num_attention_heads) as u64;
    let (hq, hkv) = (
        c.num_attention_heads as u64,
        c.num_key_value_heads.unwrap() as u64,
    );
    let per_layer = 2 * e * hq * d + 2 * e * hkv * d + 3 * e * i;
    let tokens = (B * T) as u64;
    let v = c.vocab_size as u64;
    6 * tokens * (l * per_layer + v * e) + 6 * l * (B as u64) * hq * d * (T * T) as u64
}

fn cfg_for(d: &Dev, profiler: Option<FlopsProfilerConfig>) -> ResolvedConfig {
    let precision = d.training_precision();
    let mut c = config(ZeroStage::Stage2, 1, B, 1, precision);
    c.monitor.flops_profiler = profiler;
    c
}

fn profiler_at(step: u64, file: &std::path::Path) -> FlopsProfilerConfig {
    FlopsProfilerConfig {
        profile_step: step,
        module_depth: None,
        top_modules: 2,
        detailed: true,
        output_file: Some(file.to_path_buf()),
    }
}

/// Trains `STEPS` steps of `model()` on `be`: every report and the final parameters.
fn train(
    be: &Arc<dyn Backend>,
    cfg: &ResolvedConfig,
    model: fn() -> Model,
    vocab: usize,
) -> (Vec<StepReport>, Vec<NamedTensor>) {
    let out = run_ranks(1, Duration::from_secs(300), |comm| {
        let mut e = Engine::with_backend(model(), cfg.clone(), comm, be.clone())?;
        let mut reports = Vec::new();
        for s in 0..STEPS {
            let b = nn_common::batch(B, T, vocab, 11 + s as u64);
            reports.push(e.train_batch(&[b])?);
        }
        Ok((reports, e.parameters()?))
    })
    .expect("training failed");
    out.into_iter().next().unwrap()
}

fn gpt2_model() -> Model {
    gpt2::build(&gpt2_cfg()).unwrap()
}

fn llama_model() -> Model {
    llama::build(&llama_cfg()).unwrap()
}

/// The one profile of a run, taken at step 2.
fn profile_of(reports: &[StepReport]) -> &FlopsProfile {
    let taken: Vec<u64> = reports
        .iter()
        .filter(|r| r.flops_profile.is_some())
        .map(|r| r.step)
        .collect();
    assert_eq!(taken, vec![2], "profiled steps");
    reports[1].flops_profile.as_ref().unwrap()
}

fn check_profile(d: &Dev, model: fn() -> Model, vocab: usize, want_flops: u64, units: &[&str]) {
    let scratch = Scratch::new();
    let file = scratch.dir();
    let cfg = cfg_for(d, Some(profiler_at(2, &file)));
    let (reports, _) = train(&d.be, &cfg, model, vocab);
    let p = profile_of(&reports);
    assert_eq!(p.flops, want_flops, "{}: FLOPs of one step", d.name);
    let matmul_and_more: u64 = p.families.iter().map(|f| f.flops).sum();
    assert_eq!(matmul_and_more, want_flops);
    let attention = p.families.iter().find(|f| f.family == Family::Attention);
    assert!(
        attention.is_some_and(|a| a.flops > 0 && a.calls > 0),
        "{p:?}"
    );
    for u in units {
        let row = p.modules.iter().find(|m| m.name == *u);
        let row = row.unwrap_or_else(|| panic!("{}: no row for {u}: {p:?}", d.name));
        assert!(row.calls > 0 && row.seconds > 0.0, "{u}: {row:?}");
    }
    let share: f64 = p.training_thread_modules().map(|m| m.percent_of_step).sum();
    assert!(
        (share - 100.0).abs() < 0.5,
        "{}: shares sum to {share}",
        d.name
    );
    assert!(p.step_seconds > 0.0 && p.tflops_per_s > 0.0);
    let table = std::fs::read_to_string(&file).expect("the table was written");
    assert!(table.contains("Profile Summary at step 2:"), "{table}");
    for u in units {
        assert!(
            table.contains(&format!("\n  {u} ")),
            "{u} missing:\n{table}"
        );
    }
    assert!(
        table.contains("Top 2 modules in terms of time at depth 1"),
        "{table}"
    );
}

fn gpt2_step_flops_are_the_analytic_count(d: &Dev) {
    let units = ["embed", "h.0", "h.1", "head"];
    check_profile(d, gpt2_model, 37, gpt2_flops(&gpt2_cfg()), &units);
}
test_device!(gpt2_step_flops_are_the_analytic_count);

fn llama_step_flops_are_the_analytic_count(d: &Dev) {
    let units = ["embed", "layers.0", "layers.1", "head"];
    check_profile(d, llama_model, 29, llama_flops(&llama_cfg()), &units);
}
test_device!(llama_step_flops_are_the_analytic_count);

#[test]
fn the_profiler_changes_no_bit_of_training() {
    let d = device_common::cpu();
    let scratch = Scratch::new();
    let plain = train(&d.be, &cfg_for(&d, None), gpt2_model, 37);
    assert!(plain.0.iter().all(|r| r.flops_profile.is_none()));
    let cfg = cfg_for(&d, Some(profiler_at(1, &scratch.dir())));
    let profiled = train(&d.be, &cfg, gpt2_model, 37);
    let bits = |r: &[StepReport]| r.iter().map(|r| r.loss.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&plain.0), bits(&profiled.0));
    assert_eq!(plain.1, profiled.1);
    assert!(profiled.0[0].flops_profile.is_some());
}

#[test]
fn module_depth_and_detailed_shape_the_table() {
    let d = device_common::cpu();
    let scratch = Scratch::new();
    let file = scratch.dir();
    let mut p = profiler_at(1, &file);
    p.module_depth = Some(1);
    let _ = train(&d.be, &cfg_for(&d, Some(p.clone())), gpt2_model, 37);
    let table = std::fs::read_to_string(&file).unwrap();
    assert!(table.contains("\n  h.0 "), "{table}");
    assert!(
        !table.contains("\n    matmul "),
        "depth 1 shows no families:\n{table}"
    );
    p.detailed = false;
    let _ = train(&d.be, &cfg_for(&d, Some(p)), gpt2_model, 37);
    let table = std::fs::read_to_string(&file).unwrap();
    assert!(!table.contains("Detailed Profile per module"), "{table}");
    assert!(table.contains("Profile per kernel family"), "{table}");
}

#[test]
fn model_flops_per_token_is_six_n_plus_six_lct() {
    let c = gpt2_cfg();
    let m = gpt2_model();
    let n = m.num_params() as u64;
    let want = 6 * n + 6 * (c.n_layer * c.n_embd * T) as u64;
    assert_eq!(model_flops_per_token(&m, T), want);
    let c = llama_cfg();
    let m = llama_model();
    let width = (c.num_hidden_layers * c.hidden_size) as u64;
    assert_eq!(
        model_flops_per_token(&m, T),
        6 * m.num_params() as u64 + 6 * width * T as u64
    );
}

#[test]
fn the_monitors_get_the_profiled_steps_figures() {
    let d = device_common::cpu();
    let scratch = Scratch::new();
    let dir = scratch.dir();
    let mut cfg = cfg_for(&d, Some(profiler_at(2, &scratch.dir())));
    cfg.monitor.csv_monitor = Some(MonitorOutput {
        dir: dir.clone(),
        all_ranks: false,
    });
    let (reports, _) = train(&d.be, &cfg, gpt2_model, 37);
    drop(reports);
    let read = |name: &str| std::fs::read_to_string(dir.join(name)).unwrap();
    // One row, at the profiled step's samples (2 steps of B rows).
    let rate = read("Train_Samples_profile_tflops_per_second.csv");
    let rows: Vec<&str> = rate.lines().collect();
    assert_eq!(rows.len(), 2, "{rate}");
    assert!(rows[1].starts_with(&format!("{},", 2 * B)), "{rate}");
    let matmul = read("Train_Samples_profile_matmul_ms.csv");
    let ms: f64 = matmul
        .lines()
        .nth(1)
        .unwrap()
        .split(',')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    assert!(ms > 0.0, "{matmul}");
}
