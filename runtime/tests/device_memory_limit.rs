//! `device_memory_limit` on the CPU backend, where "device" is the working set a GPU would
//! hold: a run under the cap trains and its ledger proves the cap held; a cap below the
//! resident state is refused when the engine is built; a cap below the step's peak fails at
//! the first pass that crosses it, with the same named error a GPU's allocator gives; with a
//! sequence length the estimator refuses at `initialize` before anything is allocated.

mod common;

use std::time::Duration;

use common::{config, toy};
use ferrozero_config::resolved::{Precision, ResolvedConfig, ZeroStage};
use ferrozero_runtime::comm::local::run_ranks;
use ferrozero_runtime::engine::ledger::Location;
use ferrozero_runtime::engine::{Engine, EngineBuilder};
use ferrozero_runtime::Error;

const VOCAB: usize = 97;
const SEQ: usize = 8;
const MICRO: usize = 2;

fn cfg(limit: Option<u64>) -> ResolvedConfig {
    let mut c = config(ZeroStage::Stage3, 1, MICRO, 2, Precision::Bf16);
    c.device_memory_limit = limit;
    c
}

/// Peak device bytes and the resident bytes at build time, from `steps` steps under `cfg`.
fn run(cfg: &ResolvedConfig, steps: usize) -> Result<(u64, u64, Vec<u64>), Error> {
    let out = run_ranks(1, Duration::from_secs(60), |comm| {
        let mut e = Engine::new(toy::model(VOCAB, 64, SEQ, 3), cfg.clone(), comm)?;
        let resident = e.ledger().current_total(Location::Device);
        let mut peaks = Vec::new();
        for s in 0..steps {
            let batches: Vec<_> = (0..2)
                .map(|m| toy::batch(VOCAB, SEQ, (s * 2 + m) * MICRO, MICRO))
                .collect();
            let r = e.train_batch(&batches)?;
            assert_eq!(r.memory.device_memory_limit, cfg.device_memory_limit);
            peaks.push(r.memory.peak_device_bytes);
        }
        Ok((e.ledger().peak_total(Location::Device), resident, peaks))
    });
    out.map(|mut v| v.remove(0))
}

fn expect_device_memory(r: Result<impl std::fmt::Debug, Error>, what: &str) -> String {
    match r {
        Err(Error::DeviceMemory { detail, limit, .. }) => {
            assert!(detail.contains("device_memory_limit"), "{what}: {detail}");
            format!("{limit} {detail}")
        }
        other => panic!("{what}: expected a device-memory error, got {other:?}"),
    }
}

#[test]
fn a_run_at_its_own_peak_fits_and_the_ledger_proves_it() {
    let (peak, resident, _) = run(&cfg(None), 2).unwrap();
    assert!(peak > resident && resident > 0, "{peak} {resident}");
    let (capped_peak, _, per_step) = run(&cfg(Some(peak)), 2).unwrap();
    assert_eq!(capped_peak, peak, "the cap changes no allocation");
    assert!(
        per_step.iter().all(|&p| p <= peak),
        "{per_step:?} <= {peak}"
    );
}

#[test]
fn a_cap_below_the_resident_state_is_refused_at_build() {
    let (_, resident, _) = run(&cfg(None), 0).unwrap();
    let msg = expect_device_memory(run(&cfg(Some(resident - 1)), 0), "build");
    assert!(msg.starts_with(&format!("{} ", resident - 1)), "{msg}");
}

#[test]
fn a_cap_below_the_step_peak_fails_in_the_step_not_silently() {
    let (peak, resident, _) = run(&cfg(None), 1).unwrap();
    let cap = resident + (peak - resident) / 2;
    let msg = expect_device_memory(run(&cfg(Some(cap)), 1), "step");
    assert!(
        ["Activations", "Prefetch", "Gradients", "CommBuffers"]
            .iter()
            .any(|c| msg.contains(c)),
        "the error names the category: {msg}"
    );
}

/// With the sequence length known, `initialize` refuses from the estimate (before the engine
/// allocates), and says what would fit.
#[test]
fn initialize_refuses_from_the_estimate() {
    let src = r#"
        device = "cpu"
        device_memory_limit = "2KB"
        train_micro_batch_size_per_gpu = 2
        bf16 = { enabled = true }
        optimizer = { type = "AdamW", params = { lr = 1e-3 } }
        zero_optimization = { stage = 0 }
    "#;
    let loaded = ferrozero_config::parse(src, ferrozero_config::Format::Toml, "cap.toml").unwrap();
    assert_eq!(
        loaded.config.device_memory_limit.map(|b| b.bytes()),
        Some(2000)
    );
    // A model the size-only device can run (the toy computes with host loops).
    let gpt2 = ferrozero_runtime::nn::gpt2::Gpt2Config::preset("tiny").unwrap();
    let r = EngineBuilder::new(ferrozero_runtime::nn::gpt2::build(&gpt2).unwrap())
        .config(loaded.config)
        .sequence_length(SEQ)
        .build();
    let msg = expect_device_memory(r.map(|_| ()), "initialize");
    assert!(msg.contains("estimator"), "{msg}");
    assert!(
        msg.contains("fits if you") || msg.contains("no change"),
        "{msg}"
    );
}
