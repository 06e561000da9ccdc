//! `tensorboard`, `csv_monitor` and `comms_logger`: DeepSpeed's keys and defaults, resolved
//! into what the engine reads; `wandb` and `comet` stay ignored with a warning that points at
//! the file monitors.

use std::path::PathBuf;

use ferrozero_config::{parse, Format, ResolveContext};

const BASE: &str = r#""train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 0.001}}"#;

fn resolved(extra: &str) -> ferrozero_config::ResolvedConfig {
    let src = format!("{{{BASE}, {extra}}}");
    let loaded = parse(&src, Format::Json, "t.json").unwrap_or_else(|e| panic!("{e}"));
    assert!(loaded.warnings.is_empty(), "{:#?}", loaded.warnings);
    loaded.config.resolve(&ResolveContext::new(1)).unwrap()
}

#[test]
fn monitors_resolve_to_output_path_and_job_name_with_deepspeeds_defaults() {
    let r = resolved(
        r#""tensorboard": {"enabled": true, "output_path": "logs/", "job_name": "run"},
           "csv_monitor": {"enabled": true}"#,
    );
    let tb = r.monitor.tensorboard.unwrap();
    assert_eq!(tb.dir, PathBuf::from("logs/run"));
    assert!(!tb.all_ranks);
    // DeepSpeed's defaults: output_path "" (the working directory), job_name DeepSpeedJobName.
    assert_eq!(
        r.monitor.csv_monitor.unwrap().dir,
        PathBuf::from("DeepSpeedJobName")
    );
    assert!(r.monitor.comms_logger.is_none());
}

#[test]
fn disabled_monitors_resolve_to_none() {
    let r = resolved(r#""tensorboard": {"enabled": false, "output_path": "x"}"#);
    assert_eq!(r.monitor, Default::default());
}

#[test]
fn comms_logger_keys_and_defaults() {
    let on = resolved(r#""comms_logger": {"enabled": true}"#)
        .monitor
        .comms_logger
        .unwrap();
    assert!(on.prof_all && !on.verbose && !on.debug && on.prof_ops.is_empty());
    let some = resolved(
        r#""comms_logger": {"enabled": true, "verbose": true, "debug": true, "prof_all": false,
           "prof_ops": ["all_reduce", "all_gather_into_tensor"]}"#,
    )
    .monitor
    .comms_logger
    .unwrap();
    assert!(some.verbose && some.debug && !some.prof_all);
    assert_eq!(some.prof_ops, ["all_reduce", "all_gather_into_tensor"]);
}

#[test]
fn an_unknown_collective_in_prof_ops_is_an_error_naming_it() {
    let src =
        format!(r#"{{{BASE}, "comms_logger": {{"enabled": true, "prof_ops": ["all_reduse"]}}}}"#);
    let err = parse(&src, Format::Json, "t.json").unwrap_err();
    let d = &err.diagnostics()[0];
    assert_eq!(d.path, "comms_logger.prof_ops[0]");
    assert!(d.message.contains("all_reduse"), "{d}");
    assert!(d.to_string().contains("all_reduce"), "{d}");
}

#[test]
fn an_unknown_monitor_key_is_an_error() {
    let src = format!(r#"{{{BASE}, "tensorboard": {{"enabled": true, "outputpath": "x"}}}}"#);
    let err = parse(&src, Format::Json, "t.json").unwrap_err();
    assert_eq!(err.diagnostics()[0].path, "tensorboard.outputpath");
}

#[test]
fn wandb_and_comet_warn_and_point_at_the_file_monitors() {
    for key in ["wandb", "comet"] {
        let src = format!(r#"{{{BASE}, "{key}": {{"enabled": true}}}}"#);
        let loaded = parse(&src, Format::Json, "t.json").unwrap();
        let w = loaded.warnings.iter().find(|d| d.path == key).unwrap();
        let text = w.to_string();
        assert!(text.contains("network service"), "{text}");
        assert!(
            text.contains("tensorboard") && text.contains("csv_monitor"),
            "{text}"
        );
    }
}
