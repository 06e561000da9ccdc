//! PEFT adapter directories in and out: the weights PEFT wrote read back under the base
//! model's names, merged into the base as PEFT's `merge_and_unload()` merged them (its result
//! is in the fixture), written again as PEFT names them, and every kind of mismatch refused
//! with the file and the tensor.

mod peft_common;

use std::path::Path;

use ferrozero_runtime::nn::peft::{merge_into, AdapterWeights, PeftSource, ADAPTER_WEIGHTS_FILE};
use ferrozero_runtime::tensor::DType;
use peft_common::{fixtures, read, saved_params, sites, tensors};

fn adapter_dir(arch: &str, which: &str) -> std::path::PathBuf {
    fixtures().join(format!("peft/{arch}/{which}"))
}

fn open(
    arch: &str,
    which: &str,
) -> (
    PeftSource,
    Vec<ferrozero_runtime::nn::peft::Adapter>,
    AdapterWeights,
) {
    let src = PeftSource::open(&adapter_dir(arch, which)).unwrap();
    let adapters = src.config.adapters(&sites(arch), arch).unwrap();
    let saved = saved_params(arch, &src.config);
    let saved: Vec<(&str, &[usize])> = saved
        .iter()
        .map(|(n, s)| (n.as_str(), s.as_slice()))
        .collect();
    let w = AdapterWeights::read(src.weights.as_ref().unwrap(), &adapters, &saved).unwrap();
    (src, adapters, w)
}

#[test]
fn merging_the_trained_adapter_gives_peft_merged_weights() {
    for arch in ["gpt2", "llama"] {
        let (_, adapters, w) = open(arch, "trained");
        let mut base = tensors(&fixtures().join(format!("hf/{arch}/parity.safetensors")));
        for ad in &adapters {
            let weight = base.get_mut(&format!("{}.weight", ad.site.name)).unwrap();
            merge_into(weight, arch == "gpt2", ad, &w.lora[&ad.site.name]);
        }
        for (name, t) in &w.saved {
            base.insert(name.clone(), t.data.clone());
        }
        let want = tensors(&fixtures().join(format!("peft/{arch}/parity.safetensors")));
        let mut worst = 0.0f32;
        for (name, v) in want.iter().filter(|(n, _)| *n != "losses") {
            for (x, y) in base[name].iter().zip(v) {
                worst = worst.max((x - y).abs());
            }
        }
        assert!(
            worst < 1e-6,
            "{arch}: merged weights differ from PEFT's by {worst}"
        );
        assert_eq!(want.len() - 1, adapters.len() + w.saved.len(), "{arch}");
    }
}

#[test]
fn an_adapter_written_back_reads_the_same() {
    for arch in ["gpt2", "llama"] {
        let (src, adapters, w) = open(arch, "trained");
        let dir =
            std::env::temp_dir().join(format!("ferrozero-peft-{arch}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        src.config.write(&dir, arch == "gpt2").unwrap();
        w.write(&dir, &adapters, DType::F32).unwrap();
        let again = PeftSource::open(&dir).unwrap();
        let mut cfg = again.config.clone();
        cfg.origin = src.config.origin.clone();
        assert_eq!(cfg, src.config, "{arch}");
        let adapters2 = cfg.adapters(&sites(arch), arch).unwrap();
        assert_eq!(adapters2, adapters);
        let saved = saved_params(arch, &cfg);
        let saved: Vec<(&str, &[usize])> = saved
            .iter()
            .map(|(n, s)| (n.as_str(), s.as_slice()))
            .collect();
        let w2 = AdapterWeights::read(again.weights.as_ref().unwrap(), &adapters2, &saved).unwrap();
        assert_eq!(w2, w, "{arch}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

fn refusal(arch: &str, cfg_json: Option<&str>, weights_of: &str) -> String {
    let src = PeftSource::open(&adapter_dir(weights_of, "start")).unwrap();
    let cfg = match cfg_json {
        Some(j) => ferrozero_runtime::nn::peft::LoraConfig::from_json(j, "x.json").unwrap(),
        None => read(arch),
    };
    let adapters = cfg.adapters(&sites(arch), arch).unwrap();
    AdapterWeights::read(src.weights.as_ref().unwrap(), &adapters, &[])
        .unwrap_err()
        .to_string()
}

#[test]
fn mismatched_adapters_are_refused_by_file_and_tensor() {
    let file = format!("peft/gpt2/start/{ADAPTER_WEIGHTS_FILE}");
    // Another rank than the file's.
    let e = refusal(
        "gpt2",
        Some(r#"{"r": 8, "target_modules": ["c_attn"], "layers_to_transform": 1}"#),
        "gpt2",
    );
    assert!(
        e.contains(&file)
            && e.contains("transformer.h.1.attn.c_attn.lora_A.weight")
            && e.contains("[4, 32]")
            && e.contains("[8, 32]"),
        "{e}"
    );
    // Fewer adapters than the file holds.
    let e = refusal(
        "gpt2",
        Some(r#"{"r": 4, "target_modules": ["c_attn"], "layers_to_transform": 1}"#),
        "gpt2",
    );
    assert!(
        e.contains("c_proj.lora_A.weight` is not an adapter of this base model"),
        "{e}"
    );
    // An adapter made for another architecture.
    let e = refusal("llama", None, "gpt2");
    assert!(
        e.contains(&file) && e.contains("has no tensor `base_model.model.model.layers.0"),
        "{e}"
    );
    // A directory without its weights.
    let dir = std::env::temp_dir().join(format!("ferrozero-peft-empty-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(
        adapter_dir("gpt2", "start").join("adapter_config.json"),
        dir.join("adapter_config.json"),
    )
    .unwrap();
    let e = PeftSource::open(&dir).unwrap_err().to_string();
    assert!(
        e.contains(ADAPTER_WEIGHTS_FILE) && e.contains("missing"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(PeftSource::open(Path::new("/nonexistent/dir/adapter_config.json")).is_err());
}
