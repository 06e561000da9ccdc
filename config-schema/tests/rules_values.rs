//! One breaking config per validation rule (see `rules`): types, integral floats, ranges,
//! schedules, batch sizes, optimizer parameters, enum values and where `"auto"` may stand.

mod rules_common;

use ferrozero_config::{parse, DiagnosticKind, Format, Severity};
use rules_common::{diags, expect, json_diags, BASE};

#[test]
fn wrong_types_name_the_expected_type_and_hint_at_quotes() {
    let src = "train_micro_batch_size_per_gpu = \"8\"\nwall_clock_breakdown = \"true\"\ngradient_clipping = [1]\n[zero_optimization]\nstage = 2.5\n";
    let ds = diags(src);
    let d = expect(
        &ds,
        Severity::Error,
        DiagnosticKind::WrongType,
        "train_micro_batch_size_per_gpu",
        (1, 34),
        "expected an integer, found a string",
    );
    assert_eq!(
        d.help.as_deref(),
        Some("remove the quotes: write 8 instead of \"8\"")
    );
    let d = expect(
        &ds,
        Severity::Error,
        DiagnosticKind::WrongType,
        "wall_clock_breakdown",
        (2, 24),
        "expected a boolean",
    );
    assert!(d.help.unwrap().contains("write true"));
    expect(
        &ds,
        Severity::Error,
        DiagnosticKind::WrongType,
        "gradient_clipping",
        (3, 21),
        "expected a number, found an array",
    );
    expect(
        &ds,
        Severity::Error,
        DiagnosticKind::InvalidValue,
        "zero_optimization.stage",
        (5, 9),
        "whole number",
    );
}

#[test]
fn integral_floats_are_integers_as_in_deepspeed_json() {
    let c = parse(
        r#"{"train_batch_size": 8, "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8}}"#,
        Format::Json,
        "t",
    )
    .unwrap()
    .config;
    assert_eq!(
        c.zero_optimization.reduce_bucket_size,
        ferrozero_config::AutoOr::Value(500_000_000)
    );
}

#[test]
fn zero_and_negative_bucket_sizes() {
    // 0 is DeepSpeed's (each parameter alone): accepted, resolved to one collective per unit.
    let src = format!("{BASE}[zero_optimization]\nstage = 2\nreduce_bucket_size = 0\nallgather_bucket_size = -5\n");
    let ds = diags(&src);
    assert!(
        !ds.iter()
            .any(|d| d.path == "zero_optimization.reduce_bucket_size"),
        "{ds:#?}"
    );
    expect(
        &ds,
        Severity::Error,
        DiagnosticKind::InvalidValue,
        "zero_optimization.allgather_bucket_size",
        (5, 25),
        "negative",
    );
}

#[test]
fn loss_scale_parameters_out_of_range() {
    let src = format!("{BASE}[fp16]\nenabled = true\nloss_scale = -1\ninitial_scale_power = 70\nloss_scale_window = 0\nhysteresis = 0\nmin_loss_scale = 0\n");
    let ds = diags(&src);
    expect(
        &ds,
        Severity::Error,
        DiagnosticKind::InvalidValue,
        "fp16.loss_scale",
        (4, 14),
        "found -1",
    );
    expect(
        &ds,
        Severity::Error,
        DiagnosticKind::InvalidValue,
        "fp16.initial_scale_power",
        (5, 23),
        "at most 63",
    );
    expect(
        &ds,
        Severity::Error,
        DiagnosticKind::InvalidValue,
        "fp16.loss_scale_window",
        (6, 21),
        "at least 1",
    );
    expect(
        &ds,
        Severity::Error,
        DiagnosticKind::InvalidValue,
        "fp16.hysteresis",
        (7, 14),
        "at least 1",
    );
    expect(
        &ds,
        Severity::Error,
        DiagnosticKind::InvalidValue,
        "fp16.min_loss_scale",
        (8, 18),
        "positive",
    );
    let src =
        format!("{BASE}[fp16]\nenabled = true\ninitial_scale_power = 4\nmin_loss_scale = 32\n");
    let d = expect(
        &diags(&src),
        Severity::Error,
        DiagnosticKind::Conflict,
        "fp16.min_loss_scale",
        (5, 18),
        "above",
    );
    assert!(d.notes[0].contains("min_loss_scale = 32, initial_scale_power = 4"));
}

#[test]
fn schedules_that_cannot_work() {
    let src = format!("{BASE}[scheduler]\ntype = \"WarmupDecayLR\"\n[scheduler.params]\nwarmup_num_steps = 500\ntotal_num_steps = 100\nwarmup_min_lr = 0.1\nwarmup_max_lr = 0.01\n");
    let ds = diags(&src);
    let d = expect(
        &ds,
        Severity::Error,
        DiagnosticKind::Conflict,
        "scheduler.params.warmup_num_steps",
        (5, 20),
        "longer",
    );
    assert!(d.notes[0].contains("warmup_num_steps = 500, total_num_steps = 100"));
    expect(
        &ds,
        Severity::Error,
        DiagnosticKind::Conflict,
        "scheduler.params.warmup_min_lr",
        (7, 17),
        "above",
    );
    let src = format!("{BASE}[scheduler]\ntype = \"OneCycle\"\nparams = {{ cycle_min_lr = 1.0, cycle_max_lr = 0.1 }}\n");
    expect(
        &diags(&src),
        Severity::Error,
        DiagnosticKind::Conflict,
        "scheduler.params.cycle_min_lr",
        (4, 27),
        "above",
    );
    let src = format!("{BASE}[scheduler]\ntype = \"WarmupCosineLR\"\n");
    expect(
        &diags(&src),
        Severity::Error,
        DiagnosticKind::InvalidValue,
        "scheduler.params",
        (2, 1),
        "total_num_steps",
    );
}

#[test]
fn batch_sizes_that_no_world_size_fits() {
    let src = "train_batch_size = 30\ntrain_micro_batch_size_per_gpu = 4\ngradient_accumulation_steps = 2\n";
    let d = expect(
        &diags(src),
        Severity::Error,
        DiagnosticKind::BatchSize,
        "train_batch_size",
        (1, 20),
        "multiple",
    );
    assert!(d.notes[0].contains("train_batch_size = 30, train_micro_batch_size_per_gpu = 4, gradient_accumulation_steps = 2"));
}

#[test]
fn optimizer_parameters_that_do_not_apply() {
    let src = format!("{BASE}[optimizer]\ntype = \"SGD\"\nparams = {{ lr = 0.1, betas = [0.9, 0.99], max_grad_norm = 1.0 }}\n");
    let ds = diags(&src);
    expect(
        &ds,
        Severity::Error,
        DiagnosticKind::InvalidValue,
        "optimizer.params.betas",
        (4, 30),
        "not a parameter of Sgd",
    );
    expect(
        &ds,
        Severity::Error,
        DiagnosticKind::Unsupported,
        "optimizer.params.max_grad_norm",
        (4, 43),
        "not supported",
    );
    let src = format!("{BASE}[optimizer]\ntype = \"AdamW\"\nparams = {{ adam_w_mode = false }}\n");
    expect(
        &diags(&src),
        Severity::Error,
        DiagnosticKind::Conflict,
        "optimizer.params.adam_w_mode",
        (4, 26),
        "contradictory",
    );
}

#[test]
fn enum_values_suggest_the_nearest() {
    let src = format!("{BASE}[zero_optimization]\nstage = 3\noffload_param = {{ device = \"nvm\" }}\n[comms]\nbackend = \"ncll\"\n");
    let ds = diags(&src);
    let d = expect(
        &ds,
        Severity::Error,
        DiagnosticKind::InvalidValue,
        "zero_optimization.offload_param.device",
        (4, 28),
        "unknown value",
    );
    assert_eq!(d.help.as_deref(), Some("did you mean \"nvme\"?"));
    expect(
        &ds,
        Severity::Error,
        DiagnosticKind::InvalidValue,
        "comms.backend",
        (6, 11),
        "ncll",
    );
}

#[test]
fn auto_is_accepted_only_where_deepspeed_accepts_it() {
    let ok = r#"{"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
      "gradient_clipping": "auto", "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
      "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto"},
      "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
      "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto", "total_num_steps": "auto"}}}"#;
    assert!(json_diags(ok).is_empty(), "{:#?}", json_diags(ok));
    let ds = json_diags(r#"{"train_batch_size": 8, "steps_per_print": "auto"}"#);
    expect(
        &ds,
        Severity::Error,
        DiagnosticKind::WrongType,
        "steps_per_print",
        (1, 44),
        "expected an integer",
    );
}

#[test]
fn lamb_parameters_deepspeed_refuses_are_refused_by_name() {
    let src = r#"{"train_micro_batch_size_per_gpu": 2,
  "optimizer": {"type": "Lamb", "params": {"lr": 0.01, "amsgrad": true, "max_coef": 0.3,
    "adam_w_mode": true, "torch_adam": true, "min_coeff": 5.0, "max_coeff": 1.0}}}"#;
    let ds = json_diags(src);
    expect(
        &ds,
        Severity::Error,
        DiagnosticKind::Unsupported,
        "optimizer.params.amsgrad",
        (2, 67),
        "AMSGrad",
    );
    let typo = ds
        .iter()
        .find(|d| d.path == "optimizer.params.max_coef")
        .unwrap_or_else(|| panic!("no diagnostic on the typo in {ds:#?}"));
    assert_eq!(typo.severity, Severity::Error, "{typo}");
    assert!(typo.to_string().contains("max_coeff"), "{typo}");
    expect(
        &ds,
        Severity::Error,
        DiagnosticKind::InvalidValue,
        "optimizer.params.adam_w_mode",
        (3, 20),
        "not a parameter of Lamb",
    );
    expect(
        &ds,
        Severity::Error,
        DiagnosticKind::InvalidValue,
        "optimizer.params.torch_adam",
        (3, 40),
        "not a parameter of Lamb",
    );
    expect(
        &ds,
        Severity::Error,
        DiagnosticKind::InvalidValue,
        "optimizer.params.min_coeff",
        (3, 59),
        "min_coeff <= max_coeff",
    );
    // Lamb's own keys belong to no other optimizer.
    let src = r#"{"train_micro_batch_size_per_gpu": 2,
  "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "max_coeff": 0.3}}}"#;
    expect(
        &json_diags(src),
        Severity::Error,
        DiagnosticKind::InvalidValue,
        "optimizer.params.max_coeff",
        (2, 70),
        "not a parameter of Adam",
    );
}
