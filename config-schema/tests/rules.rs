//! One breaking config per validation rule, each asserting the key path, the position and the
//! message of the diagnostic it must produce.

use ferrozero_config::{parse, Diagnostic, DiagnosticKind, Format, Severity};

const BASE: &str = "train_micro_batch_size_per_gpu = 2\n";

/// All diagnostics of a TOML config (errors make parsing fail; warnings ride along).
fn diags(src: &str) -> Vec<Diagnostic> {
    match parse(src, Format::Toml, "t.toml") {
        Ok(l) => l.warnings,
        Err(e) => e.diagnostics().to_vec(),
    }
}

fn json_diags(src: &str) -> Vec<Diagnostic> {
    match parse(src, Format::Json, "t.json") {
        Ok(l) => l.warnings,
        Err(e) => e.diagnostics().to_vec(),
    }
}

/// Finds the diagnostic at `path` and checks severity, kind, position and message.
#[track_caller]
fn expect(
    ds: &[Diagnostic],
    sev: Severity,
    kind: DiagnosticKind,
    path: &str,
    pos: (usize, usize),
    msg: &str,
) -> Diagnostic {
    let d = ds
        .iter()
        .find(|d| d.path == path && d.kind == kind)
        .unwrap_or_else(|| panic!("no {kind:?} at `{path}` in {ds:#?}"));
    assert_eq!(d.severity, sev, "{d:#?}");
    let loc = d.location.as_ref().expect("a location");
    assert_eq!((loc.line, loc.column), pos, "{d}");
    assert!(
        d.message.contains(msg),
        "message {:?} lacks {msg:?}",
        d.message
    );
    d.clone()
}

#[test]
fn minimal_config_is_valid() {
    assert!(diags(BASE).is_empty());
}

#[test]
fn unknown_keys_at_every_level_suggest_the_nearest() {
    let src = "train_micro_batch_size_per_gpu = 2\nsteps_per_prnt = 5\n[zero_optimization]\nstage = 3\n[zero_optimization.offload_param]\ndevice = \"nvme\"\nnvme_pth = \"/x\"\n[aio]\nqueue_dept = 4\n[activation_checkpointing]\nprofil = true\n";
    let ds = diags(src);
    let d = expect(
        &ds,
        Severity::Error,
        DiagnosticKind::UnknownKey,
        "steps_per_prnt",
        (2, 1),
        "unknown key",
    );
    assert_eq!(d.help.as_deref(), Some("did you mean `steps_per_print`?"));
    let d = expect(
        &ds,
        Severity::Error,
        DiagnosticKind::UnknownKey,
        "zero_optimization.offload_param.nvme_pth",
        (7, 1),
        "nvme_pth",
    );
    assert!(d.help.unwrap().contains("nvme_path"));
    expect(
        &ds,
        Severity::Error,
        DiagnosticKind::UnknownKey,
        "aio.queue_dept",
        (9, 1),
        "queue_dept",
    );
    expect(
        &ds,
        Severity::Error,
        DiagnosticKind::UnknownKey,
        "activation_checkpointing.profil",
        (11, 1),
        "profil",
    );
}

#[test]
fn unknown_key_far_from_any_lists_the_valid_ones() {
    let ds = diags("[comms]\nzzzzzzzzzz = 1\n");
    let d = expect(
        &ds,
        Severity::Error,
        DiagnosticKind::UnknownKey,
        "comms.zzzzzzzzzz",
        (2, 1),
        "unknown",
    );
    assert!(d.help.unwrap().contains("backend, reduction, timeout"));
}

#[test]
fn monitors_warn_and_result_changing_sections_are_refused() {
    // A section that turns nothing on asks for nothing: accepted silently.
    let off = format!("{BASE}[tensorboard]\nenabled = false\n[compression_training]\nx = 1\n");
    assert!(diags(&off).is_empty(), "{:#?}", diags(&off));
    let src = format!("{BASE}[wandb]\nenabled = true\n[compression_training.weight_quantization.shared_parameters]\nenabled = true\n");
    let ds = diags(&src);
    expect(
        &ds,
        Severity::Warning,
        DiagnosticKind::Unsupported,
        "wandb",
        (2, 2),
        "ignored",
    );
    expect(
        &ds,
        Severity::Error,
        DiagnosticKind::Unsupported,
        "compression_training",
        (4, 2),
        "not supported",
    );
}

#[test]
fn one_bit_optimizers_are_refused() {
    let ds = diags(&format!("{BASE}[optimizer]\ntype = \"OneBitAdam\"\n"));
    expect(
        &ds,
        Severity::Error,
        DiagnosticKind::Unsupported,
        "optimizer.type",
        (3, 8),
        "OneBitAdam",
    );
}

#[test]
fn deprecated_keys_map_with_a_warning() {
    let src = format!("{BASE}[zero_optimization]\nstage = 3\ncpu_offload = true\nstage3_gather_fp16_weights_on_model_save = true\n[aio]\nthread_count = 4\n");
    let loaded = parse(&src, Format::Toml, "t.toml").expect("valid with warnings");
    let ds = &loaded.warnings;
    expect(
        ds,
        Severity::Warning,
        DiagnosticKind::Deprecated,
        "zero_optimization.cpu_offload",
        (4, 1),
        "deprecated",
    );
    expect(
        ds,
        Severity::Warning,
        DiagnosticKind::Deprecated,
        "zero_optimization.stage3_gather_fp16_weights_on_model_save",
        (5, 1),
        "deprecated",
    );
    expect(
        ds,
        Severity::Warning,
        DiagnosticKind::Deprecated,
        "aio.thread_count",
        (7, 1),
        "deprecated",
    );
    let z = &loaded.config.zero_optimization;
    assert_eq!(
        z.offload_optimizer.as_ref().map(|o| o.device),
        Some(ferrozero_config::OffloadDevice::Cpu)
    );
    assert_eq!(
        z.stage3_gather_16bit_weights_on_model_save,
        ferrozero_config::AutoOr::Value(true)
    );
    assert_eq!(loaded.config.aio.intra_op_parallelism, 4);
}

#[test]
fn deprecated_key_next_to_its_replacement_is_an_error() {
    let src = format!("{BASE}[zero_optimization]\nstage = 3\ncpu_offload = true\noffload_optimizer = {{ device = \"cpu\" }}\n");
    expect(
        &diags(&src),
        Severity::Error,
        DiagnosticKind::Conflict,
        "zero_optimization.cpu_offload",
        (4, 1),
        "together",
    );
    let src = format!("{BASE}[aio]\nthread_count = 2\nintra_op_parallelism = 2\n");
    expect(
        &diags(&src),
        Severity::Error,
        DiagnosticKind::Conflict,
        "aio.thread_count",
        (3, 1),
        "together",
    );
}

#[test]
fn short_aliases_are_accepted_and_clash_with_the_long_name() {
    let src = format!("{BASE}[zero_optimization]\nstage = 3\nprefetch_bucket_size = 7\nparam_persistence_threshold = 8\nmax_live_parameters = 9\nmax_reuse_distance = 10\ngather_16bit_weights_on_model_save = true\n");
    let c = parse(&src, Format::Toml, "t")
        .unwrap()
        .config
        .zero_optimization;
    assert_eq!(
        c.stage3_prefetch_bucket_size,
        ferrozero_config::AutoOr::Value(7)
    );
    assert_eq!(
        c.stage3_param_persistence_threshold,
        ferrozero_config::AutoOr::Value(8)
    );
    assert_eq!(
        (c.stage3_max_live_parameters, c.stage3_max_reuse_distance),
        (9, 10)
    );
    assert_eq!(
        c.stage3_gather_16bit_weights_on_model_save,
        ferrozero_config::AutoOr::Value(true)
    );
    let src = format!("{BASE}[zero_optimization]\nstage = 3\nmax_live_parameters = 9\nstage3_max_live_parameters = 9\n");
    expect(
        &diags(&src),
        Severity::Error,
        DiagnosticKind::Conflict,
        "zero_optimization.stage3_max_live_parameters",
        (5, 1),
        "same setting",
    );
}

#[test]
fn bfloat16_alias_and_clash() {
    let c = parse(
        &format!("{BASE}[bfloat16]\nenabled = true\n"),
        Format::Toml,
        "t",
    )
    .unwrap()
    .config;
    assert_eq!(c.bf16.enabled, ferrozero_config::AutoOr::Value(true));
    let ds = json_diags(
        r#"{"train_batch_size": 8, "bf16": {"enabled": true}, "bfloat16": {"enabled": true}}"#,
    );
    expect(
        &ds,
        Severity::Error,
        DiagnosticKind::Conflict,
        "bfloat16",
        (1, 52),
        "same setting",
    );
}

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
fn fp16_and_bf16_together_point_at_both() {
    let src = format!("{BASE}[fp16]\nenabled = true\n[bf16]\nenabled = true\n");
    let d = expect(
        &diags(&src),
        Severity::Error,
        DiagnosticKind::Conflict,
        "bf16.enabled",
        (5, 11),
        "both",
    );
    assert_eq!(d.related[0].0.line, 3);
    assert!(d.notes[0].contains("fp16.enabled = true"));
}

#[test]
fn offload_param_below_stage_3() {
    let src = format!("{BASE}[zero_optimization]\nstage = 2\n[zero_optimization.offload_param]\ndevice = \"cpu\"\n");
    let d = expect(
        &diags(&src),
        Severity::Error,
        DiagnosticKind::Conflict,
        "zero_optimization.offload_param.device",
        (5, 10),
        "stage 3",
    );
    assert!(d.notes[0].contains("stage = 2"));
}

#[test]
fn partial_optimizer_offload_below_stage_3() {
    let src = format!("{BASE}[zero_optimization]\nstage = 2\noffload_optimizer = {{ device = \"cpu\", ratio = 0.3 }}\n");
    let d = expect(
        &diags(&src),
        Severity::Error,
        DiagnosticKind::Conflict,
        "zero_optimization.offload_optimizer.ratio",
        (4, 47),
        "ratio < 1",
    );
    assert!(d.notes[0].contains("ratio = 0.3"));
}

#[test]
fn nvme_without_path() {
    let src = format!("{BASE}[zero_optimization]\nstage = 3\n[zero_optimization.offload_optimizer]\ndevice = \"nvme\"\n");
    expect(
        &diags(&src),
        Severity::Error,
        DiagnosticKind::InvalidValue,
        "zero_optimization.offload_optimizer.device",
        (5, 10),
        "nvme_path",
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
fn syntax_errors_have_positions_in_both_formats() {
    let ds = diags("a = \n");
    assert_eq!(ds[0].kind, DiagnosticKind::Syntax);
    assert_eq!(ds[0].location.as_ref().unwrap().line, 1);
    let ds = json_diags("{\n  \"train_batch_size\": 8,\n}\n");
    let loc = ds[0].location.as_ref().unwrap();
    assert_eq!(
        (ds[0].kind, loc.line, loc.column),
        (DiagnosticKind::Syntax, 3, 1)
    );
}

#[test]
fn json_duplicate_keys_are_errors() {
    let ds = json_diags("{\"train_batch_size\": 8,\n \"train_batch_size\": 16}");
    expect(
        &ds,
        Severity::Error,
        DiagnosticKind::Conflict,
        "train_batch_size",
        (2, 2),
        "duplicate",
    );
}

#[test]
fn every_error_is_reported_not_only_the_first() {
    let src = "a = 1\nb = 2\nc = 3\n[zero_optimization]\nstage = 9\n[fp16]\nhysteresis = \"x\"\n";
    let err = parse(src, Format::Toml, "t.toml").unwrap_err();
    assert_eq!(err.errors().count(), 5, "{err}");
    let text = err.to_string();
    assert!(text.contains("--> t.toml:5:9"), "{text}");
    assert!(
        text.contains("t.toml: invalid (5 errors, 0 warnings)"),
        "{text}"
    );
}

#[test]
fn stage_specific_keys_at_the_wrong_stage_warn() {
    let src = format!("{BASE}[zero_optimization]\nstage = 1\nstage3_max_live_parameters = 5\n");
    expect(
        &diags(&src),
        Severity::Warning,
        DiagnosticKind::InvalidValue,
        "zero_optimization.stage3_max_live_parameters",
        (4, 30),
        "no effect",
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
fn keys_in_the_wrong_table_name_the_right_one() {
    let ds = diags("train_batch_size = 8\nstage = 3\n[zero_optimization]\nqueue_depth = 4\n");
    let d = expect(
        &ds,
        Severity::Error,
        DiagnosticKind::UnknownKey,
        "stage",
        (2, 1),
        "unknown key",
    );
    assert_eq!(
        d.help.as_deref(),
        Some("`stage` belongs in another table: `zero_optimization.stage`")
    );
    let d = expect(
        &ds,
        Severity::Error,
        DiagnosticKind::UnknownKey,
        "zero_optimization.queue_depth",
        (4, 1),
        "unknown key",
    );
    assert_eq!(
        d.help.as_deref(),
        Some("`queue_depth` belongs in another table: `aio.queue_depth`")
    );
}

#[test]
fn long_lines_render_the_exact_position_without_quoting_the_line() {
    let padding = format!("\"$schema\": \"{}\", ", "x".repeat(600));
    let src = format!("{{{padding}\"train_batch_size\": 8, \"stepz_per_print\": 1}}");
    let err = parse(&src, Format::Json, "min.json").unwrap_err();
    let col = src.find("\"stepz").unwrap() + 1;
    let text = err.to_string();
    assert!(text.contains(&format!("--> min.json:1:{col}")), "{text}");
    assert!(!text.contains("xxxxxxxxxx"), "{text}");
    assert!(text.contains("did you mean `steps_per_print`?"), "{text}");
}

#[test]
fn number_checkpoints_accepts_the_template_shapes() {
    let ok = json_diags(
        r#"{"train_batch_size": 8, "activation_checkpointing": {"number_checkpoints": null}}"#,
    );
    assert!(ok.is_empty(), "{ok:?}");
    let ds = json_diags(
        r#"{"train_batch_size": 8, "activation_checkpointing": {"number_checkpoints": false}}"#,
    );
    expect(
        &ds,
        Severity::Warning,
        DiagnosticKind::InvalidValue,
        "activation_checkpointing.number_checkpoints",
        (1, 76),
        "read as unset",
    );
    let ds = json_diags(
        r#"{"train_batch_size": 8, "activation_checkpointing": {"number_checkpoints": true}}"#,
    );
    expect(
        &ds,
        Severity::Error,
        DiagnosticKind::WrongType,
        "activation_checkpointing.number_checkpoints",
        (1, 76),
        "expected an integer",
    );
}

/// `device_memory_limit` (ferrozero's own key): bytes or a size string, both unit families,
/// resolved to bytes; zero, unknown units, negatives and wrong types are errors at the key.
#[test]
fn device_memory_limit_takes_bytes_or_sizes_and_refuses_nonsense() {
    let resolve = |src: &str| {
        parse(src, Format::Toml, "t.toml")
            .unwrap_or_else(|e| panic!("{e}"))
            .config
            .resolve(&ferrozero_config::ResolveContext::new(1))
            .unwrap_or_else(|e| panic!("{e}"))
            .device_memory_limit
    };
    let opt = "[optimizer]\ntype = \"AdamW\"\n";
    assert_eq!(resolve(&format!("{BASE}{opt}")), None);
    for (v, bytes) in [
        ("\"40GB\"", 40_000_000_000u64),
        ("\"40 GiB\"", 40 << 30),
        ("\"512MiB\"", 512 << 20),
        ("123456789", 123_456_789),
        ("4e10", 40_000_000_000),
    ] {
        let src = format!("{BASE}device_memory_limit = {v}\n{opt}");
        assert_eq!(resolve(&src), Some(bytes), "{v}");
    }
    let json = r#"{"train_micro_batch_size_per_gpu": 2, "device_memory_limit": "80GB"}"#;
    assert!(json_diags(json).is_empty());
    for (v, msg) in [
        ("0", "must be positive"),
        ("\"0GB\"", "must be positive"),
        ("\"40XB\"", "unknown size unit"),
        ("\"lots\"", "is not a size"),
        ("-1", "must not be negative"),
        ("true", "expected an integer"),
    ] {
        let ds = diags(&format!("{BASE}device_memory_limit = {v}\n"));
        let kind = if v == "true" {
            DiagnosticKind::WrongType
        } else {
            DiagnosticKind::InvalidValue
        };
        expect(
            &ds,
            Severity::Error,
            kind,
            "device_memory_limit",
            (2, 23),
            msg,
        );
    }
}

#[test]
fn bf16_optimizer_values_follow_deepspeeds_conditions() {
    let err = |src: String, pos: (usize, usize), path: &str, msg: &str| {
        let kind = DiagnosticKind::Conflict;
        expect(&diags(&src), Severity::Error, kind, path, pos, msg);
    };
    const MASTER: &str = "bf16.bf16_master_weights_and_grads";
    const STATES: &str = "bf16.bf16_optimizer_states";
    err(
        format!("{BASE}[bf16]\nbf16_master_weights_and_grads = true\n"),
        (3, 33),
        MASTER,
        "need bf16 training",
    );
    err(
        format!("{BASE}[bf16]\nenabled = true\nbf16_optimizer_states = true\n"),
        (4, 25),
        STATES,
        "requires bf16_master_weights_and_grads",
    );
    let master = "[bf16]\nenabled = true\nbf16_master_weights_and_grads = true\n";
    err(
        format!("{BASE}[zero_optimization]\nstage = 2\n{master}"),
        (6, 33),
        MASTER,
        "need the optimizer offloaded to the CPU",
    );
    err(
        format!(
            "{BASE}[zero_optimization]\nstage = 0\n[zero_optimization.offload_optimizer]\n\
             device = \"cpu\"\n{master}"
        ),
        (8, 33),
        MASTER,
        "stage 1, 2 or 3",
    );
    err(
        format!(
            "{BASE}[zero_optimization]\nstage = 3\n[zero_optimization.offload_optimizer]\n\
             device = \"nvme\"\nnvme_path = \"/x\"\n{master}"
        ),
        (9, 33),
        MASTER,
        "optimizer state on NVMe",
    );
    err(
        format!(
            "device = \"cuda\"\n{BASE}[zero_optimization]\nstage = 2\n{master}\
             bf16_optimizer_states = true\n"
        ),
        (8, 25),
        STATES,
        "on a GPU are not implemented",
    );
}

#[test]
fn bf16_optimizer_values_resolve_where_deepspeed_allows_them() {
    let resolve = |src: &str| {
        let ctx = ferrozero_config::ResolveContext {
            world_size: 1,
            hidden_size: None,
            micro_batch_hint: None,
        };
        parse(src, Format::Toml, "t.toml")
            .unwrap()
            .config
            .resolve(&ctx)
            .unwrap()
            .bf16_state
    };
    let base = format!(
        "{BASE}[optimizer]\ntype = \"AdamW\"\nparams.lr = 1e-4\n[zero_optimization]\nstage = 2\n\
         [zero_optimization.offload_optimizer]\ndevice = \"cpu\"\n[bf16]\nenabled = true\n"
    );
    let off = resolve(&base);
    assert!(!off.master_weights_and_grads && !off.optimizer_states);
    let master = resolve(&format!("{base}bf16_master_weights_and_grads = true\n"));
    assert!(master.master_weights_and_grads && !master.optimizer_states);
    let both = resolve(&format!(
        "{base}bf16_master_weights_and_grads = true\nbf16_optimizer_states = true\n"
    ));
    assert!(both.master_weights_and_grads && both.optimizer_states);
    // On the CPU device the bf16 moments may stay where the compute runs.
    let on_cpu = format!(
        "device = \"cpu\"\n{BASE}[optimizer]\ntype = \"AdamW\"\nparams.lr = 1e-4\n\
         [zero_optimization]\nstage = 1\n[bf16]\nenabled = true\n\
         bf16_master_weights_and_grads = true\nbf16_optimizer_states = true\n"
    );
    assert!(resolve(&on_cpu).optimizer_states);
}
