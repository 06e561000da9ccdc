//! `flops_profiler`: DeepSpeed's keys and defaults resolved into what the engine reads,
//! `peak_tflops` (ferrozero's own) read whether or not the profiler is on, and bad values
//! refused with the key's path.

use std::path::PathBuf;

use ferrozero_config::{parse, Format, ResolveContext};

const BASE: &str = r#""train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 0.001}}"#;

fn load(extra: &str) -> ferrozero_config::Loaded {
    let src = format!("{{{BASE}, {extra}}}");
    parse(&src, Format::Json, "t.json").unwrap_or_else(|e| panic!("{e}"))
}

fn resolved(extra: &str) -> ferrozero_config::ResolvedConfig {
    let loaded = load(extra);
    assert!(loaded.warnings.is_empty(), "{:#?}", loaded.warnings);
    loaded.config.resolve(&ResolveContext::new(1)).unwrap()
}

/// The one error of a config, as (path, message).
fn error(extra: &str) -> (String, String) {
    let src = format!("{{{BASE}, {extra}}}");
    let err = parse(&src, Format::Json, "t.json").unwrap_err();
    let d = &err.diagnostics()[0];
    (d.path.clone(), d.to_string())
}

#[test]
fn deepspeeds_defaults_when_only_enabled() {
    let p = resolved(r#""flops_profiler": {"enabled": true}"#)
        .monitor
        .flops_profiler
        .unwrap();
    assert_eq!(p.profile_step, 1);
    assert_eq!(p.module_depth, None);
    assert_eq!(p.top_modules, 1);
    assert!(p.detailed);
    assert_eq!(p.output_file, None);
}

#[test]
fn every_key_is_read() {
    let r = resolved(
        r#""flops_profiler": {"enabled": true, "profile_step": 5, "module_depth": 2,
           "top_modules": 3, "detailed": false, "output_file": "prof.txt",
           "recompute_fwd_factor": 0.0, "peak_tflops": 120.5}"#,
    );
    let p = r.monitor.flops_profiler.unwrap();
    assert_eq!(p.profile_step, 5);
    assert_eq!(p.module_depth, Some(2));
    assert_eq!(p.top_modules, 3);
    assert!(!p.detailed);
    assert_eq!(p.output_file, Some(PathBuf::from("prof.txt")));
    assert_eq!(r.monitor.peak_tflops, Some(120.5));
}

#[test]
fn a_disabled_profiler_is_none_but_its_peak_still_counts() {
    let r = resolved(r#""flops_profiler": {"enabled": false, "peak_tflops": 2.5}"#);
    assert!(r.monitor.flops_profiler.is_none());
    assert_eq!(r.monitor.peak_tflops, Some(2.5));
    let r = resolved(r#""flops_profiler": {"enabled": true, "output_file": null}"#);
    assert_eq!(r.monitor.flops_profiler.unwrap().output_file, None);
}

#[test]
fn bad_values_are_errors_naming_the_key() {
    let cases = [
        (
            r#"{"enabled": true, "profile_step": 0}"#,
            "flops_profiler.profile_step",
            "at least 1",
        ),
        (
            r#"{"enabled": true, "profile_step": "1"}"#,
            "flops_profiler.profile_step",
            "integer",
        ),
        (
            r#"{"enabled": true, "module_depth": -2}"#,
            "flops_profiler.module_depth",
            "-1 or more",
        ),
        (
            r#"{"enabled": true, "module_depth": 1.5}"#,
            "flops_profiler.module_depth",
            "integer",
        ),
        (
            r#"{"enabled": true, "top_modules": -1}"#,
            "flops_profiler.top_modules",
            "negative",
        ),
        (
            r#"{"enabled": true, "detailed": 1}"#,
            "flops_profiler.detailed",
            "boolean",
        ),
        (
            r#"{"enabled": true, "output_file": 3}"#,
            "flops_profiler.output_file",
            "string",
        ),
        (
            r#"{"peak_tflops": 0}"#,
            "flops_profiler.peak_tflops",
            "positive",
        ),
        (r#"{"enabled": "yes"}"#, "flops_profiler.enabled", "boolean"),
        (
            r#"{"enabled": true, "profile_stp": 2}"#,
            "flops_profiler.profile_stp",
            "profile_step",
        ),
        (r#"true"#, "flops_profiler", "table"),
    ];
    for (section, path, says) in cases {
        let (p, text) = error(&format!(r#""flops_profiler": {section}"#));
        assert_eq!(p, path, "{section}: {text}");
        assert!(text.contains(says), "{section}: {text}");
    }
}

#[test]
fn a_recompute_factor_is_ignored_with_a_warning_that_says_why() {
    let loaded = load(r#""flops_profiler": {"enabled": true, "recompute_fwd_factor": 1.0}"#);
    let w = &loaded.warnings[0];
    assert_eq!(w.path, "flops_profiler.recompute_fwd_factor");
    assert!(w.to_string().contains("recomputed forward"), "{w}");
}
