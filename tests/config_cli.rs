//! The config subcommands end to end: exit codes, the JSON report, `schema`, `config show`
//! and `config convert` (a converted config must load back to the same config).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn ferrozero(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ferrozero"))
        .args(args)
        .output()
        .expect("run ferrozero")
}

fn repo(path: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(path)
        .display()
        .to_string()
}

fn scratch(name: &str, text: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("config_cli");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn exit_codes_valid_invalid_unreadable() {
    let valid = repo("configs/zero2.toml");
    let invalid = repo("tests/fixtures/configs/invalid/typo_top_level.json");
    assert_eq!(ferrozero(&["validate", &valid]).status.code(), Some(0));
    let out = ferrozero(&["validate", &valid, &invalid]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("typo_top_level.json:3:3"), "{stderr}");
    assert!(
        stderr.contains("help: did you mean `gradient_clipping`?"),
        "{stderr}"
    );
    assert_eq!(
        ferrozero(&["validate", &valid, "/nonexistent/ds.json"])
            .status
            .code(),
        Some(2)
    );
    let yaml = scratch("ds.yaml", "stage: 3\n");
    let out = ferrozero(&["validate", yaml.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("expected a `.toml` or `.json` file"));
}

#[test]
fn json_report_has_positions() {
    let invalid = repo("tests/fixtures/configs/invalid/fp16_and_bf16.json");
    let out = ferrozero(&["validate", "--format", "json", &invalid]);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let d = &report[0]["diagnostics"][0];
    assert_eq!(report[0]["status"], "invalid");
    assert_eq!(
        (d["path"].as_str(), d["line"].as_u64(), d["column"].as_u64()),
        (Some("bf16.enabled"), Some(7), Some(16))
    );
    assert_eq!(d["kind"], "conflict");
}

#[test]
fn schema_subcommand_prints_the_committed_schema() {
    let out = ferrozero(&["schema"]);
    assert!(out.status.success());
    let printed = String::from_utf8(out.stdout).unwrap();
    let committed = std::fs::read_to_string(repo("configs/ferrozero.schema.json")).unwrap();
    assert!(printed == committed, "configs/ferrozero.schema.json is stale: run `cargo run -- schema > configs/ferrozero.schema.json`");
}

#[test]
fn convert_json_to_toml_round_trips() {
    let src = repo("tests/fixtures/configs/valid/hf_zero3_auto.json");
    let out = ferrozero(&["config", "convert", &src, "--to", "toml"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let toml_text = String::from_utf8(out.stdout).unwrap();
    let converted =
        ferrozero_config::parse(&toml_text, ferrozero_config::Format::Toml, "converted.toml")
            .unwrap();
    let original = ferrozero_config::load(Path::new(&src)).unwrap();
    assert_eq!(
        converted.config.zero_optimization,
        original.config.zero_optimization
    );
    assert_eq!(converted.config.optimizer, original.config.optimizer);
    assert_eq!(
        converted.config.train_batch_size,
        original.config.train_batch_size
    );
    let back = ferrozero(&[
        "config",
        "convert",
        scratch("c.toml", &toml_text).to_str().unwrap(),
        "--to",
        "json",
    ]);
    assert!(back.status.success());
    let json = ferrozero_config::parse(
        &String::from_utf8(back.stdout).unwrap(),
        ferrozero_config::Format::Json,
        "c.json",
    )
    .unwrap();
    assert_eq!(json.config, original.config);
}

#[test]
fn show_resolved_lists_decisions() {
    let src = repo("tests/fixtures/configs/valid/native_zero3.toml");
    let out = ferrozero(&[
        "config",
        "show",
        &src,
        "--resolved",
        "--world-size",
        "2",
        "--hidden-size",
        "100",
        "--format",
        "json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let resolved: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(resolved["zero"]["prefetch_bucket_size"], 9000);
    assert_eq!(resolved["train_batch_size"], 4);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("resolved zero_optimization.stage3_prefetch_bucket_size = 9000"),
        "{stderr}"
    );
    let missing = ferrozero(&["config", "show", &src, "--resolved", "--world-size", "2"]);
    assert_eq!(missing.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("hidden size is not known"));
}

#[test]
fn presets_validate_and_point_to_the_schema() {
    let presets = [
        "default",
        "zero1",
        "zero2",
        "zero3",
        "zero3_offload_cpu",
        "zero3_offload_nvme",
        "fp16_dynamic_scale",
        "llama7b_40gb",
        "llama13b_40gb_nvme",
    ];
    for name in presets {
        let path = repo(&format!("configs/{name}.toml"));
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(
            text.lines().next(),
            Some("#:schema ./ferrozero.schema.json"),
            "{name}"
        );
        let loaded = ferrozero_config::load(Path::new(&path)).unwrap_or_else(|e| panic!("{e}"));
        assert!(loaded.warnings.is_empty(), "{name}: {:?}", loaded.warnings);
        loaded
            .config
            .resolve(&ferrozero_config::ResolveContext::new(2))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

#[test]
fn default_preset_is_the_examples_default() {
    use ferrozero_config::resolved::*;
    let c = ferrozero_config::load(Path::new(&repo("configs/default.toml")))
        .unwrap()
        .config;
    assert_eq!(c.train_batch_size, None);
    let r = c
        .resolve(&ferrozero_config::ResolveContext::new(2))
        .unwrap();
    assert_eq!(
        (
            r.zero.stage,
            r.train_micro_batch_size_per_gpu,
            r.gradient_accumulation_steps,
            r.train_batch_size
        ),
        (ZeroStage::Stage2, 32, 1, 64)
    );
    assert_eq!(r.precision, Precision::F32);
    assert!(
        matches!(r.optimizer, OptimizerConfig::Adam { lr, adam_w_mode: true, .. } if lr == 3e-3)
    );
    assert!(matches!(
        r.scheduler,
        Some(SchedulerConfig::WarmupLR { .. })
    ));
}

#[test]
fn every_valid_config_round_trips_through_toml_and_json() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files: Vec<_> = std::fs::read_dir(dir.join("tests/fixtures/configs/valid"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.extend(
        std::fs::read_dir(dir.join("tests/fixtures/configs/warn"))
            .unwrap()
            .map(|e| e.unwrap().path()),
    );
    for f in files {
        let original = ferrozero_config::load(&f).unwrap().config;
        let as_toml = toml::to_string_pretty(&original).unwrap();
        let as_json = serde_json::to_string(&original).unwrap();
        let from_toml = ferrozero_config::parse(&as_toml, ferrozero_config::Format::Toml, "t")
            .unwrap_or_else(|e| panic!("{}: {e}\n{as_toml}", f.display()));
        let from_json = ferrozero_config::parse(&as_json, ferrozero_config::Format::Json, "j")
            .unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        assert_eq!(from_toml.config, original, "{}", f.display());
        assert_eq!(from_json.config, original, "{}", f.display());
    }
}

#[test]
fn converted_configs_load_without_warnings() {
    let src = repo("configs/zero2.toml");
    let out = ferrozero(&["config", "convert", &src, "--to", "json"]);
    let json = String::from_utf8(out.stdout).unwrap();
    let loaded = ferrozero_config::parse(&json, ferrozero_config::Format::Json, "c.json").unwrap();
    assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);
}

#[test]
fn show_resolved_encodes_every_preset_in_both_formats() {
    for name in ["default", "zero3_offload_nvme", "fp16_dynamic_scale"] {
        let path = repo(&format!("configs/{name}.toml"));
        for format in ["toml", "json"] {
            let out = ferrozero(&[
                "config",
                "show",
                &path,
                "--resolved",
                "--world-size",
                "2",
                "--format",
                format,
            ]);
            assert!(
                out.status.success(),
                "{name} {format}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(
                String::from_utf8_lossy(&out.stdout).contains("world_size"),
                "{name} {format}"
            );
        }
    }
}
