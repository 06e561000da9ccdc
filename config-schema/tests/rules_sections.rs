//! One breaking config per validation rule (see `rules`): rules between keys and sections
//! (fp16 with bf16, offload below stage 3, NVMe without a path, the bf16 optimizer's
//! conditions) and the shapes of `number_checkpoints` and `device_memory_limit`.

mod rules_common;

use ferrozero_config::{parse, DiagnosticKind, Format, Severity};
use rules_common::{diags, expect, json_diags, BASE};

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
    // bf16 moments do not lift the NVMe refusal: that optimizer keeps f32 state.
    err(
        format!(
            "device = \"cuda\"\n{BASE}[zero_optimization]\nstage = 3\n\
             [zero_optimization.offload_optimizer]\ndevice = \"nvme\"\nnvme_path = \"/x\"\n\
             {master}bf16_optimizer_states = true\n"
        ),
        (10, 33),
        MASTER,
        "NVMe optimizer keeps f32 master weights and moments",
    );
    // Nor do they lift DeepSpeed's stage rule on a GPU.
    err(
        format!(
            "device = \"cuda\"\n{BASE}[zero_optimization]\nstage = 0\n{master}\
             bf16_optimizer_states = true\n"
        ),
        (7, 33),
        MASTER,
        "stage 1, 2 or 3",
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
    // On a GPU without offload, as DeepSpeed allows: the device step keeps bf16 moments.
    for stage in 1..=3 {
        let on_gpu = format!(
            "device = \"cuda\"\n{BASE}[optimizer]\ntype = \"AdamW\"\nparams.lr = 1e-4\n\
             [zero_optimization]\nstage = {stage}\n[bf16]\nenabled = true\n\
             bf16_master_weights_and_grads = true\nbf16_optimizer_states = true\n"
        );
        assert!(
            diags(&on_gpu).is_empty(),
            "stage {stage}: {:?}",
            diags(&on_gpu)
        );
        let r = resolve(&on_gpu);
        assert!(
            r.master_weights_and_grads && r.optimizer_states,
            "stage {stage}"
        );
    }
}

/// A ZenFlow section runs: each key is checked as DeepSpeed checks it, and one warning on the
/// section says that ferrozero's exact overlapped offload runs instead.
#[test]
fn zenflow_is_checked_then_answered_with_what_runs_instead() {
    let ok = json_diags(
        r#"{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2,
            "offload_optimizer": {"device": "cpu"},
            "zenflow": {"topk_ratio": 0.1, "select_strategy": "auto", "update_interval": 4, "overlap_step": true}}}"#,
    );
    assert_eq!(ok.len(), 1, "{ok:?}");
    assert_eq!(
        (ok[0].severity, ok[0].kind),
        (Severity::Warning, DiagnosticKind::Unsupported)
    );
    assert_eq!(ok[0].path, "zero_optimization.zenflow");
    assert!(
        ok[0]
            .help
            .as_deref()
            .unwrap()
            .contains("exact overlapped offload"),
        "{:?}",
        ok[0]
    );
    let bad = json_diags(
        r#"{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2,
            "zenflow": {"topk_ratio": 1.5, "select_strategy": "often", "update_intervl": 4}}}"#,
    );
    let errors: Vec<(&str, DiagnosticKind)> = bad
        .iter()
        .filter(|d| d.severity == Severity::Error)
        .map(|d| (d.path.as_str(), d.kind))
        .collect();
    assert_eq!(
        errors,
        [
            (
                "zero_optimization.zenflow.topk_ratio",
                DiagnosticKind::InvalidValue
            ),
            (
                "zero_optimization.zenflow.select_strategy",
                DiagnosticKind::InvalidValue
            ),
            (
                "zero_optimization.zenflow.update_intervl",
                DiagnosticKind::UnknownKey
            ),
        ]
    );
    let typo = bad
        .iter()
        .find(|d| d.kind == DiagnosticKind::UnknownKey)
        .unwrap();
    assert!(
        typo.help.as_deref().unwrap().contains("update_interval"),
        "{typo:?}"
    );
}
