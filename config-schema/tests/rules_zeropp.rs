//! ZeRO++'s quantized communication keys (DeepSpeed's meaning): they validate and resolve in a
//! stage-3 config, TOML and DeepSpeed JSON alike; below stage 3 (where DeepSpeed ignores them)
//! they warn by key and resolve off; qgZ with MiCS and LoCo's error feedback are refused by key.

mod rules_common;

use ferrozero_config::resolved::ResolvedConfig;
use ferrozero_config::{parse, DiagnosticKind, Format, ResolveContext, Severity};
use rules_common::{diags, expect, json_diags, BASE};

/// The resolved config of `src` with an optimizer added (TOML's table or JSON's key).
fn resolved(src: &str, format: Format) -> ResolvedConfig {
    let src = match format {
        Format::Json => src.replacen(
            '{',
            r#"{"optimizer": {"type": "AdamW", "params": {"lr": 0.01}}, "#,
            1,
        ),
        _ => format!("{src}[optimizer]\ntype = \"AdamW\"\nparams = {{ lr = 0.01 }}\n"),
    };
    let c = parse(&src, format, "t")
        .unwrap_or_else(|e| panic!("{e}"))
        .config;
    let ctx = ResolveContext {
        world_size: 2,
        hidden_size: None,
        micro_batch_hint: None,
    };
    c.resolve_explained(&ctx)
        .unwrap_or_else(|e| panic!("{e}"))
        .config
}

#[test]
fn stage3_accepts_the_keys_in_toml_and_json() {
    let toml = format!(
        "{BASE}[zero_optimization]\nstage = 3\nzero_quantized_weights = true\n\
         zero_quantized_gradients = true\nzero_quantized_nontrainable_weights = true\n\
         zero_hpz_partition_size = 1\n"
    );
    assert!(diags(&toml).is_empty(), "{:#?}", diags(&toml));
    let json = r#"{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3,
        "zero_quantized_weights": true, "zero_quantized_gradients": true,
        "zero_quantized_nontrainable_weights": false}}"#;
    assert!(json_diags(json).is_empty(), "{:#?}", json_diags(json));
    let z = resolved(&toml, Format::Toml).zero;
    let both = (
        z.quantized_weights,
        z.quantized_gradients,
        z.quantized_nontrainable_weights,
    );
    assert_eq!(both, (true, true, true));
    let z = resolved(json, Format::Json).zero;
    let both = (
        z.quantized_weights,
        z.quantized_gradients,
        z.quantized_nontrainable_weights,
    );
    assert_eq!(both, (true, true, false));
}

#[test]
fn below_stage_3_they_warn_by_key_and_resolve_off() {
    let src = format!(
        "{BASE}[zero_optimization]\nstage = 2\nzero_quantized_weights = true\n\
         zero_quantized_gradients = true\nzero_quantized_nontrainable_weights = true\n"
    );
    let ds = diags(&src);
    for (key, line) in [
        ("zero_quantized_weights", 4),
        ("zero_quantized_gradients", 5),
        ("zero_quantized_nontrainable_weights", 6),
    ] {
        expect(
            &ds,
            Severity::Warning,
            DiagnosticKind::InvalidValue,
            &format!("zero_optimization.{key}"),
            (line, key.len() + 4),
            "no effect at ZeRO stage 2",
        );
    }
    let z = resolved(&src, Format::Toml).zero;
    assert!(!z.quantized_weights && !z.quantized_gradients && !z.quantized_nontrainable_weights);
}

#[test]
fn a_non_boolean_value_is_an_error_naming_the_key() {
    let src = format!("{BASE}[zero_optimization]\nstage = 3\nzero_quantized_weights = 1\n");
    let d = diags(&src);
    assert!(
        d.iter().any(|d| d.severity == Severity::Error
            && d.path == "zero_optimization.zero_quantized_weights"),
        "{d:#?}"
    );
}

#[test]
fn quantized_gradients_with_mics_are_refused_by_key() {
    let src = format!(
        "{BASE}[zero_optimization]\nstage = 3\nzero_quantized_gradients = true\nmics_shard_size = 2\n"
    );
    let d = expect(
        &diags(&src),
        Severity::Error,
        DiagnosticKind::Conflict,
        "zero_optimization.zero_quantized_gradients",
        (4, 28),
        "MiCS",
    );
    assert!(d.notes[0].contains("mics_shard_size = 2"));
}

#[test]
fn loco_error_feedback_is_refused_by_key() {
    let src = r#"{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3,
        "zero_quantized_gradients": true, "zeropp_loco_param": {"err_beta": 0.8, "reset_T": 1024}}}"#;
    let ds = json_diags(src);
    assert!(
        ds.iter().any(|d| d.severity == Severity::Error
            && d.path == "zero_optimization.zeropp_loco_param"
            && d.help.as_deref().is_some_and(|h| h.contains("LoCo"))),
        "{ds:#?}"
    );
    // Without qgZ DeepSpeed never reads LoCo's settings: a warning, not an error.
    let src = r#"{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3,
        "zeropp_loco_param": {"err_beta": 0.8, "reset_T": 1024}}}"#;
    let ds = json_diags(src);
    let d = ds
        .iter()
        .find(|d| d.path == "zero_optimization.zeropp_loco_param")
        .unwrap_or_else(|| panic!("{ds:#?}"));
    assert_eq!(d.severity, Severity::Warning, "{d}");
    assert!(
        d.help
            .as_deref()
            .unwrap()
            .contains("zero_quantized_gradients"),
        "{d}"
    );
}
