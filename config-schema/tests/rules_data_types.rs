//! `data_types`: gradients accumulate in the training precision or in fp32 (DeepSpeed's
//! spellings of the dtypes, in TOML and in DeepSpeed's JSON), `param_dtype` restates the
//! precision, `buffer_dtype` keeps buffers f32; each refusal names the key, its position and
//! the precision it meets. The old top-level `gradient_accumulation_dtype`, which DeepSpeed
//! does not read, is ignored with a warning that names the key that works.

mod rules_common;

use ferrozero_config::{parse, DiagnosticKind, Format, ResolveContext, Severity};
use rules_common::{diags, expect, json_diags, BASE};

const ADAM: &str = "[optimizer]\ntype = \"AdamW\"\nparams.lr = 1e-4\n";

fn grad_accum_f32(src: &str, format: Format) -> bool {
    parse(src, format, "t")
        .unwrap()
        .config
        .resolve(&ResolveContext::new(1))
        .unwrap()
        .grad_accum_f32
}

#[test]
fn fp32_accumulation_resolves_in_half_precision_runs_only() {
    let toml = |precision: &str, acc: &str| {
        format!("{BASE}{ADAM}{precision}[data_types]\ngrad_accum_dtype = \"{acc}\"\n")
    };
    for acc in ["fp32", "float32", "torch.float32", "float"] {
        assert!(grad_accum_f32(
            &toml("[bf16]\nenabled = true\n", acc),
            Format::Toml
        ));
        assert!(grad_accum_f32(
            &toml("[fp16]\nenabled = true\n", acc),
            Format::Toml
        ));
        // An f32 run accumulates in f32 already.
        assert!(!grad_accum_f32(&toml("", acc), Format::Toml));
    }
    assert!(!grad_accum_f32(
        &toml("[bf16]\nenabled = true\n", "bf16"),
        Format::Toml
    ));
    let json = r#"{"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": true},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "data_types": {"grad_accum_dtype": "fp32", "param_dtype": null}}"#;
    assert!(grad_accum_f32(json, Format::Json));
}

#[test]
fn other_dtypes_are_refused_by_key_with_the_precision() {
    let err = |src: String, pos: (usize, usize), path: &str, msg: &str| {
        expect(
            &diags(&src),
            Severity::Error,
            DiagnosticKind::Conflict,
            path,
            pos,
            msg,
        )
    };
    let d = err(
        format!("{BASE}[data_types]\ngrad_accum_dtype = \"bf16\"\n"),
        (3, 20),
        "data_types.grad_accum_dtype",
        "= \"bf16\" is not available",
    );
    assert_eq!(d.notes, ["training precision: fp32"]);
    err(
        format!("{BASE}[fp16]\nenabled = true\n[data_types]\ngrad_accum_dtype = \"bf16\"\n"),
        (5, 20),
        "data_types.grad_accum_dtype",
        "not available",
    );
    let d = err(
        format!("{BASE}[bf16]\nenabled = true\n[data_types]\nparam_dtype = \"fp16\"\n"),
        (5, 15),
        "data_types.param_dtype",
        "not available",
    );
    assert!(d.help.as_deref().unwrap().contains("\"bf16\""), "{d}");
    err(
        format!("{BASE}[data_types]\nbuffer_dtype = \"bf16\"\n"),
        (3, 16),
        "data_types.buffer_dtype",
        "not available",
    );
    let d = err(
        format!(
            "{BASE}[zero_optimization]\nstage = 1\n[zero_optimization.offload_optimizer]\n\
             device = \"cpu\"\n[bf16]\nenabled = true\nbf16_master_weights_and_grads = true\n\
             [data_types]\ngrad_accum_dtype = \"fp32\"\n"
        ),
        (10, 20),
        "data_types.grad_accum_dtype",
        "not available",
    );
    assert!(d
        .help
        .as_deref()
        .unwrap()
        .contains("bf16_master_weights_and_grads"));
    // A misspelt dtype gets the nearest spelling.
    let ds = json_diags(r#"{"data_types": {"grad_accum_dtype": "fp23"}}"#);
    let d = ds
        .iter()
        .find(|d| d.path == "data_types.grad_accum_dtype")
        .unwrap();
    assert!(
        d.is_error() && d.help.as_deref().unwrap().contains("fp32"),
        "{d}"
    );
}

#[test]
fn the_top_level_key_deepspeed_never_read_is_ignored_with_the_one_that_works() {
    let ds = json_diags(
        r#"{"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_dtype": "fp32"}"#,
    );
    let w = ds
        .iter()
        .find(|d| d.path == "gradient_accumulation_dtype")
        .unwrap();
    assert_eq!(w.severity, Severity::Warning, "{w}");
    assert!(w.to_string().contains("data_types.grad_accum_dtype"), "{w}");
}
