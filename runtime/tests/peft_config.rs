//! PEFT's `adapter_config.json` as ferrozero reads it, against what PEFT itself did with the
//! same file: the fixtures under `fixtures/peft/` were written by PEFT (`gen_peft_parity.py`),
//! so the layers PEFT adapted, their ranks and the modules it saved in full are in its
//! `adapter_model.safetensors`, and ferrozero's matching must find exactly those.

mod peft_common;

use std::collections::BTreeMap;
use std::path::Path;

use ferrozero_runtime::nn::peft::{LinearSite, LoraConfig, LoraInit, TargetModules};
use peft_common::{fixtures, read, shapes, sites, written};

#[test]
fn the_layers_ferrozero_adapts_are_the_ones_peft_adapted() {
    for arch in ["gpt2", "llama"] {
        let cfg = read(arch);
        let adapters = cfg.adapters(&sites(arch), arch).unwrap();
        let ours: BTreeMap<String, usize> = adapters
            .iter()
            .map(|a| (a.site.name.clone(), a.r))
            .collect();
        let (peft, _) = written(arch);
        assert_eq!(ours, peft, "{arch}");
    }
}

#[test]
fn ranks_alphas_and_scales_follow_the_patterns() {
    let cfg = read("llama");
    assert_eq!((cfg.r, cfg.alpha, cfg.init), (4, 8.0, LoraInit::Kaiming));
    let adapters = cfg.adapters(&sites("llama"), "llama").unwrap();
    for a in &adapters {
        let (r, alpha) = match a.site.name.rsplit('.').next().unwrap() {
            "down_proj" => (2, 8.0),
            "o_proj" => (4, 16.0),
            _ => (4, 8.0),
        };
        assert_eq!(
            (a.r, a.alpha, a.scaling),
            (r, alpha, alpha / r as f32),
            "{}",
            a.site.name
        );
    }
}

#[test]
fn modules_to_save_names_what_peft_saved_in_full() {
    let cfg = read("llama");
    let base = shapes(&fixtures().join("hf/llama/parity.safetensors"));
    let ours: Vec<String> = base.keys().filter(|n| cfg.saves(n)).cloned().collect();
    let (_, mut peft) = written("llama");
    peft.sort();
    assert_eq!(ours, peft);
    assert!(!read("gpt2").saves("transformer.h.1.ln_1.weight"));
}

fn llama_json(extra: &str) -> String {
    format!(
        r#"{{"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": "all-linear"{extra}}}"#
    )
}

#[test]
fn all_linear_leaves_the_head_alone_and_exclusions_apply() {
    let mut s = sites("llama");
    s.push(LinearSite {
        name: "lm_head".into(),
        in_features: 32,
        out_features: 61,
        output_head: true,
    });
    let cfg = LoraConfig::from_json(&llama_json(""), "a.json").unwrap();
    assert_eq!(cfg.targets, TargetModules::AllLinear);
    assert_eq!(cfg.adapters(&s, "llama").unwrap().len(), 14);
    let cfg = LoraConfig::from_json(
        &llama_json(r#", "exclude_modules": ["o_proj"], "use_rslora": true"#),
        "a.json",
    )
    .unwrap();
    let a = cfg.adapters(&s, "llama").unwrap();
    assert_eq!(a.len(), 12);
    assert_eq!(a[0].scaling, 16.0 / 8f32.sqrt());
    let cfg = LoraConfig::from_json(
        r#"{"target_modules": ".*\\.(q|v)_proj", "init_lora_weights": "gaussian"}"#,
        "a.json",
    )
    .unwrap();
    assert_eq!(cfg.init, LoraInit::Gaussian);
    assert_eq!(cfg.adapters(&s, "llama").unwrap().len(), 4);
}

/// Each bad file fails with the file, the key and what is supported.
#[test]
fn what_ferrozero_does_not_implement_is_refused_by_key() {
    let cases: &[(&str, &[&str])] = &[
        (
            r#", "use_dora": true"#,
            &["a.json", "`use_dora`", "supported: false"],
        ),
        (
            r#", "init_lora_weights": "pissa""#,
            &["`init_lora_weights`", "\"gaussian\""],
        ),
        (r#", "bias": "all""#, &["`bias`", "\"none\""]),
        (
            r#", "peft_type": "PREFIX_TUNING""#,
            &["`peft_type`", "only LoRA"],
        ),
        (
            r#", "lora_alhpa": 32"#,
            &["`lora_alhpa`", "did you mean `lora_alpha`"],
        ),
        (
            r#", "lora_dropout": 1.5"#,
            &["`lora_dropout`", "probability"],
        ),
        (r#", "r": 0"#, &["`r`", "positive integer"]),
        (
            r#", "loftq_config": {"loftq_bits": 4}"#,
            &["`loftq_config`"],
        ),
        (
            r#", "rank_pattern": {"q_proj": "x"}"#,
            &["`rank_pattern`", "q_proj"],
        ),
        (r#", "task_type": "SEQ_CLS""#, &["`task_type`", "CAUSAL_LM"]),
    ];
    for (extra, want) in cases {
        let e = LoraConfig::from_json(&llama_json(extra), "a.json")
            .unwrap_err()
            .to_string();
        for w in *want {
            assert!(e.contains(w), "{extra}: {e} lacks {w}");
        }
    }
    let e = LoraConfig::from_json(r#"{"target_modules": ["query"]}"#, "a.json")
        .unwrap()
        .adapters(&sites("llama"), "LlamaForCausalLM")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("a.json")
            && e.contains("`target_modules`")
            && e.contains("matches no linear layer of this LlamaForCausalLM"),
        "{e}"
    );
    let e = LoraConfig::from_file(Path::new("/nonexistent/adapter_config.json"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("/nonexistent/adapter_config.json"), "{e}");
}
