//! One breaking config per validation rule, each asserting the key path, the position and the
//! message of the diagnostic it must produce. This file: key names (unknown, deprecated,
//! aliased, refused, in the wrong table or stage) and syntax; `rules_values` has types and
//! ranges, `rules_sections` the rules between keys and sections.

mod rules_common;

use ferrozero_config::{parse, DiagnosticKind, Format, Severity};
use rules_common::{diags, expect, json_diags, BASE};

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
    // The refusal says why, not only that: a user must know the update itself would differ.
    let d = ds.iter().find(|d| d.path == "optimizer.type").unwrap();
    assert!(
        d.message.contains("a different update from Adam's"),
        "{d:?}"
    );
    let ds = diags(&format!("{BASE}[fp8]\nenabled = true\n"));
    let d = ds.iter().find(|d| d.path == "fp8").unwrap();
    assert_eq!(d.severity, Severity::Error);
    assert!(d.help.as_deref().unwrap().contains("fp8 matmuls"), "{d:?}");
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
