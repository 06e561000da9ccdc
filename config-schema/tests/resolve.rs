//! Resolution: `"auto"` with Hugging Face's rules, stage-dependent defaults, DeepSpeed's batch
//! derivation, and errors that say what is missing.

use ferrozero_config::resolved::*;
use ferrozero_config::{parse, DiagnosticKind, Format, ResolveContext};

fn config(src: &str) -> ferrozero_config::Config {
    parse(src, Format::Toml, "t.toml")
        .unwrap_or_else(|e| panic!("{e}"))
        .config
}

const ADAMW: &str = "[optimizer]\ntype = \"AdamW\"\nparams = { lr = 0.01 }\n";

#[test]
fn hugging_face_auto_values_resolve_from_the_model() {
    let src = r#"{"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
      "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
      "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto"},
      "optimizer": {"type": "AdamW", "params": {"lr": 2e-5, "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
      "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": 10}}}"#;
    let c = parse(src, Format::Json, "hf.json").unwrap().config;
    let ctx = ResolveContext {
        world_size: 4,
        hidden_size: Some(1024),
        micro_batch_hint: Some(2),
    };
    let r = c.resolve_explained(&ctx).unwrap();
    let z = &r.config.zero;
    assert_eq!(
        (
            z.reduce_bucket_size,
            z.prefetch_bucket_size,
            z.param_persistence_threshold
        ),
        (1_048_576, 943_718, 10_240)
    );
    assert_eq!(
        (
            r.config.train_batch_size,
            r.config.train_micro_batch_size_per_gpu,
            r.config.gradient_accumulation_steps
        ),
        (8, 2, 1)
    );
    assert_eq!(r.config.precision, Precision::F32);
    assert_eq!(r.config.gradient_clipping, 1.0);
    assert_eq!(
        r.config.optimizer,
        OptimizerConfig::Adam {
            lr: 2e-5,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.0,
            adam_w_mode: true,
            bias_correction: true
        }
    );
    let Some(SchedulerConfig::WarmupLR {
        warmup_min_lr,
        warmup_max_lr,
        ..
    }) = r.config.scheduler
    else {
        panic!()
    };
    assert_eq!((warmup_min_lr, warmup_max_lr), (0.0, 2e-5));
    assert!(r
        .decisions
        .iter()
        .any(|d| d.path == "zero_optimization.reduce_bucket_size" && d.value == "1048576"));
}

#[test]
fn unresolvable_auto_says_what_is_missing_with_position() {
    let src = format!("train_micro_batch_size_per_gpu = \"auto\"\n[zero_optimization]\nstage = 3\nreduce_bucket_size = \"auto\"\n{ADAMW}");
    let err = config(&src).resolve(&ResolveContext::new(2)).unwrap_err();
    let ds: Vec<_> = err.errors().collect();
    assert_eq!(ds.len(), 2, "{err}");
    assert_eq!(ds[0].kind, DiagnosticKind::Auto);
    assert!(ds[0].message.contains("micro-batch"));
    let ctx = ResolveContext {
        world_size: 2,
        hidden_size: None,
        micro_batch_hint: Some(4),
    };
    let err = config(&src).resolve(&ctx).unwrap_err();
    let d = err.errors().next().unwrap();
    assert_eq!(d.path, "zero_optimization.reduce_bucket_size");
    assert!(d.message.contains("hidden size"), "{d}");
    assert_eq!(
        d.location.as_ref().map(|l| (l.line, l.column)),
        Some((4, 22))
    );
}

#[test]
fn batch_rule_failure_prints_every_value() {
    let src = format!("train_batch_size = 32\ntrain_micro_batch_size_per_gpu = 4\ngradient_accumulation_steps = 2\n{ADAMW}");
    let c = config(&src);
    assert_eq!(
        c.resolve(&ResolveContext::new(4)).unwrap().train_batch_size,
        32
    );
    let err = c.resolve(&ResolveContext::new(3)).unwrap_err();
    let text = err.to_string();
    assert!(text.contains("32 != 4 × 2 × 3"), "{text}");
    assert!(text.contains("train_batch_size = 32, train_micro_batch_size_per_gpu = 4, gradient_accumulation_steps = 2, world size = 3"), "{text}");
    assert!(text.contains("t.toml:1:20"), "{text}");
    assert_eq!(c.check_batch_size(3).len(), 1);
    assert!(c.check_batch_size(4).is_empty());
}

#[test]
fn batch_values_derive_like_deepspeed() {
    let c = config(&format!(
        "train_batch_size = 64\ntrain_micro_batch_size_per_gpu = 4\n{ADAMW}"
    ));
    let r = c.resolve(&ResolveContext::new(4)).unwrap();
    assert_eq!(r.gradient_accumulation_steps, 4);
    // 64 / 4 / 3 = 5 by integer division, and 4 × 5 × 3 = 60 != 64: rejected, not rounded.
    assert!(c.resolve(&ResolveContext::new(3)).is_err());
    assert!(config(ADAMW).resolve(&ResolveContext::new(1)).is_err());
    assert!(config(&format!("train_batch_size = 8\n{ADAMW}"))
        .resolve(&ResolveContext::new(0))
        .is_err());
}

#[test]
fn overlap_comm_defaults_on_only_at_stage_3() {
    for (stage, expected) in [(0, false), (1, false), (2, false), (3, true)] {
        let c = config(&format!(
            "train_batch_size = 8\n[zero_optimization]\nstage = {stage}\n{ADAMW}"
        ));
        assert_eq!(
            c.resolve(&ResolveContext::new(1))
                .unwrap()
                .zero
                .overlap_comm,
            expected,
            "stage {stage}"
        );
    }
}

#[test]
fn adam_is_adamw_unless_adam_w_mode_is_false() {
    let adam = |extra: &str| {
        let c = config(&format!(
            "train_batch_size = 8\n[optimizer]\ntype = \"adam\"\nparams = {{ lr = 0.1{extra} }}\n"
        ));
        match c.resolve(&ResolveContext::new(1)).unwrap().optimizer {
            OptimizerConfig::Adam { adam_w_mode, .. } => adam_w_mode,
            other => panic!("{other:?}"),
        }
    };
    assert!(adam(""));
    assert!(!adam(", adam_w_mode = false"));
}

#[test]
fn missing_optimizer_is_a_resolution_error() {
    let err = config("train_batch_size = 8\n")
        .resolve(&ResolveContext::new(1))
        .unwrap_err();
    assert_eq!(err.errors().next().unwrap().path, "optimizer");
}

#[test]
fn fp16_dynamic_and_static_scaling() {
    let c = config(&format!(
        "train_batch_size = 8\n[fp16]\nenabled = true\nhysteresis = 3\n{ADAMW}"
    ));
    let p = c.resolve(&ResolveContext::new(1)).unwrap().precision;
    assert_eq!(
        p,
        Precision::Fp16(LossScaling::Dynamic {
            initial_scale_power: 16,
            loss_scale_window: 1000,
            hysteresis: 3,
            consecutive_hysteresis: false,
            min_loss_scale: 1.0
        })
    );
    let c = config(&format!(
        "train_batch_size = 8\n[fp16]\nenabled = true\nloss_scale = 128\n{ADAMW}"
    ));
    assert_eq!(
        c.resolve(&ResolveContext::new(1)).unwrap().precision,
        Precision::Fp16(LossScaling::Static(128.0))
    );
}

#[test]
fn offload_sections_resolve_with_deepspeed_buffer_defaults() {
    let src = format!("train_batch_size = 8\n[zero_optimization]\nstage = 3\noffload_param = {{ device = \"nvme\", nvme_path = \"/nvme\" }}\noffload_optimizer = {{ device = \"cpu\", pin_memory = true }}\n{ADAMW}");
    let z = config(&src).resolve(&ResolveContext::new(1)).unwrap().zero;
    assert_eq!(z.offload_param.target, OffloadTarget::Nvme("/nvme".into()));
    assert_eq!(
        (z.offload_param.buffer_count, z.offload_param.buffer_size),
        (5, 100_000_000)
    );
    assert_eq!(z.offload_optimizer.target, OffloadTarget::Cpu);
    assert_eq!(z.offload_optimizer.buffer_count, 4);
    assert!(z.offload_optimizer.pin_memory);
}

#[test]
fn deepspeed_v0_19_defaults() {
    let r = config(&format!("train_batch_size = 8\n{ADAMW}"))
        .resolve(&ResolveContext::new(2))
        .unwrap();
    let z = &r.zero;
    assert_eq!(z.stage, ZeroStage::Stage0);
    assert_eq!(
        (
            z.reduce_bucket_size,
            z.allgather_bucket_size,
            z.sub_group_size
        ),
        (500_000_000, 500_000_000, 1_000_000_000)
    );
    assert_eq!(
        (z.prefetch_bucket_size, z.param_persistence_threshold),
        (50_000_000, 100_000)
    );
    assert_eq!(
        (z.max_live_parameters, z.max_reuse_distance),
        (1_000_000_000, 1_000_000_000)
    );
    assert_eq!((r.gradient_clipping, r.steps_per_print), (1.0, 10));
    assert_eq!(
        r.aio,
        AioConfig {
            block_size: 1_048_576,
            queue_depth: 8,
            intra_op_parallelism: 1,
            single_submit: false,
            overlap_events: true
        }
    );
    assert_eq!(
        r.comms,
        CommsConfig {
            backend: CommBackend::Local,
            timeout: std::time::Duration::from_secs(300),
            reduction: ferrozero_config::resolved::CommReduction::Native,
            data_type: None,
        }
    );
    assert_eq!(
        (
            r.train_micro_batch_size_per_gpu,
            r.gradient_accumulation_steps
        ),
        (4, 1)
    );
}

#[test]
fn a_deepspeed_lamb_section_resolves_with_fused_lambs_meanings_and_defaults() {
    let ctx = ResolveContext {
        world_size: 2,
        hidden_size: None,
        micro_batch_hint: None,
    };
    let optimizer = |src: &str| {
        let c = parse(src, Format::Json, "ds.json").unwrap().config;
        c.resolve(&ctx).unwrap().optimizer
    };
    let defaults = OptimizerConfig::Lamb {
        lr: 1e-3,
        betas: (0.9, 0.999),
        eps: 1e-8,
        eps_inside_sqrt: false,
        weight_decay: 0.0,
        bias_correction: true,
        max_coeff: 10.0,
        min_coeff: 0.01,
    };
    let src = r#"{"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Lamb"}}"#;
    assert_eq!(optimizer(src), defaults);
    // Every key given (`lr` and `min_coeff` at their defaults' values), `amsgrad` false.
    let src = r#"{"train_micro_batch_size_per_gpu": 2,
      "optimizer": {"type": "lamb", "params": {"lr": 1e-3, "betas": [0.8, 0.99], "eps": 1e-6,
        "eps_inside_sqrt": true, "weight_decay": 0.01, "bias_correction": false,
        "max_coeff": 0.3, "min_coeff": 0.01, "amsgrad": false}}}"#;
    let mut want = defaults;
    if let OptimizerConfig::Lamb {
        betas,
        eps,
        eps_inside_sqrt,
        weight_decay,
        bias_correction,
        max_coeff,
        ..
    } = &mut want
    {
        (*betas, *eps, *eps_inside_sqrt) = ((0.8, 0.99), 1e-6, true);
        (*weight_decay, *bias_correction, *max_coeff) = (0.01, false, 0.3);
    }
    assert_eq!(optimizer(src), want);
}
