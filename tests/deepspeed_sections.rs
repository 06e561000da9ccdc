//! The kinds of section that kept real DeepSpeed configs from running, each written as
//! DeepSpeed documents it and run through `ferrozero train` (two ranks, a few steps): f32
//! gradient accumulation in a bf16 run, bf16 optimizer states, ZeRO++'s quantized weights
//! and gradients, ZenFlow (answered with ferrozero's overlapped offload), and the top-level
//! `gradient_accumulation_dtype` DeepSpeed never reads. OneBitAdam and fp8 are refused with
//! their reason before anything runs. (Lamb's section: `train_cli.rs`.)

mod train_common;

use serde_json::{json, Value};
use train_common::{train_ds_config, TempDir};

/// Trains six steps under `config` (merged over a micro-batch of 2 and AdamW); returns
/// whether it ran, the log and the losses.
fn run(tag: &str, config: Value) -> (bool, String, Vec<f64>) {
    let tmp = TempDir::new(tag);
    let mut c = json!({"train_micro_batch_size_per_gpu": 2,
                       "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}});
    for (k, v) in config.as_object().unwrap() {
        c[k] = v.clone();
    }
    train_ds_config(&tmp.0, &c, 6)
}

fn trains(tag: &str, config: Value) -> String {
    let (ok, text, losses) = run(tag, config);
    assert!(ok, "{tag}: {text}");
    assert_eq!(losses.len(), 6, "{tag}: {text}");
    assert!(losses.iter().all(|l| l.is_finite()), "{tag}: {losses:?}");
    text
}

#[test]
fn fp32_gradient_accumulation_in_a_bf16_run_trains() {
    trains(
        "accum",
        json!({"bf16": {"enabled": true}, "gradient_accumulation_steps": 2,
               "zero_optimization": {"stage": 1},
               "data_types": {"grad_accum_dtype": "fp32"}}),
    );
}

#[test]
fn bf16_optimizer_states_train() {
    trains(
        "bf16state",
        json!({"bf16": {"enabled": true, "bf16_master_weights_and_grads": true,
                        "bf16_optimizer_states": true},
               "zero_optimization": {"stage": 2}}),
    );
}

#[test]
fn zeropp_quantized_weights_and_gradients_train() {
    trains(
        "zeropp",
        json!({"bf16": {"enabled": true},
               "zero_optimization": {"stage": 3, "zero_quantized_weights": true,
                                     "zero_quantized_gradients": true,
                                     "stage3_param_persistence_threshold": 0}}),
    );
}

#[test]
fn zenflow_runs_the_overlapped_offload_and_says_so() {
    let text = trains(
        "zenflow",
        json!({"zero_optimization": {"stage": 2,
                   "offload_optimizer": {"device": "cpu", "pin_memory": true},
                   "zenflow": {"topk_ratio": 0.1, "update_interval": 4,
                               "full_warm_up_rounds": 0, "overlap_step": true}}}),
    );
    assert!(text.contains("ZenFlow"), "{text}");
}

#[test]
fn the_top_level_accumulation_dtype_is_ignored_with_the_key_that_works() {
    let text = trains("stray", json!({"gradient_accumulation_dtype": "fp32"}));
    assert!(text.contains("data_types.grad_accum_dtype"), "{text}");
}

#[test]
fn onebit_adam_and_fp8_are_refused_with_their_reason() {
    let onebit = json!({"optimizer": {"type": "OneBitAdam",
                                      "params": {"lr": 1e-3, "freeze_step": 100}}});
    let fp8 = json!({"fp8": {"enabled": true}});
    let refusals = [
        (
            "onebit",
            onebit,
            "sign-compressed, error-compensated momentum",
        ),
        ("fp8", fp8, "fp8 matmuls"),
    ];
    for (tag, config, why) in refusals {
        let (ok, text, _) = run(tag, config);
        assert!(!ok, "{tag} ran: {text}");
        assert!(text.contains(why), "{tag}: {text}");
    }
}
