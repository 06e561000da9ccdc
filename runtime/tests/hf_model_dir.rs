//! Hugging Face model directories: loading (single file, index + shards, lone files; f32, bf16,
//! f16) straight into the engine at every stage, one error per kind of bad directory, and
//! writing directories (`write_model_dir`, checkpoint consolidation) that load back bit for bit.

mod common;

use std::path::Path;
use std::time::Duration;

use common::config;
use ferrozero_config::resolved::{Precision, ZeroStage};
use ferrozero_runtime::comm::local::run_ranks;
use ferrozero_runtime::engine::checkpoint::{consolidate_dir, OutputDType, Tag};
use ferrozero_runtime::engine::{Engine, NamedTensor};
use ferrozero_runtime::nn::llama::{self, LlamaConfig};
use ferrozero_runtime::nn::weights::{self, write_model_dir, ModelFiles, ModelWeights, Naming};
use ferrozero_runtime::nn::{init, Model};
use ferrozero_runtime::tensor::DType;

fn cfg(layers: usize) -> LlamaConfig {
    LlamaConfig {
        num_hidden_layers: layers,
        ..LlamaConfig::preset("tiny").unwrap()
    }
}

/// The model's parameters drawn with a seed unlike the engine's, so loading is visible.
fn pretrained(c: &LlamaConfig) -> Vec<NamedTensor> {
    let m: Model = llama::build(c).unwrap();
    let specs = m.units.iter().flat_map(|u| u.module.param_specs());
    specs
        .chain(m.shared.iter().cloned())
        .map(|s| {
            let mut data = vec![0.0; s.numel()];
            init::fill(&s.init, init::param_seed(77, &s.name), &mut data);
            NamedTensor {
                name: s.name,
                shape: s.shape,
                data,
            }
        })
        .collect()
}

fn config_json(c: &LlamaConfig) -> Vec<u8> {
    let v = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "vocab_size": c.vocab_size,
        "max_position_embeddings": c.max_position_embeddings, "rms_norm_eps": c.rms_norm_eps,
    });
    serde_json::to_vec(&v).unwrap()
}

/// Writes `t` as a model directory with `config.json`, sharded when `max_shard` is small.
fn write_dir(dir: &Path, c: &LlamaConfig, t: &[NamedTensor], dtype: DType, max_shard: u64) {
    let files = ModelFiles {
        files: vec![("config.json".into(), config_json(c))],
        ..Default::default()
    };
    let list: Vec<(String, Vec<usize>)> = t
        .iter()
        .map(|x| (x.name.clone(), x.shape.clone()))
        .collect();
    let mut read = |i: usize| Ok(t[i].data.clone());
    write_model_dir(dir, &files, &list, dtype, max_shard, &mut read).unwrap();
}

fn sorted(mut v: Vec<NamedTensor>) -> Vec<NamedTensor> {
    v.sort_by(|a, b| a.name.cmp(&b.name));
    v
}

fn rounded(t: &[NamedTensor], dtype: DType) -> Vec<NamedTensor> {
    let round = |x: f32| match dtype {
        DType::F32 => x,
        DType::Bf16 => half::bf16::from_f32(x).to_f32(),
        DType::F16 => half::f16::from_f32(x).to_f32(),
    };
    let each = t.iter().map(|x| NamedTensor {
        data: x.data.iter().map(|&v| round(v)).collect(),
        ..x.clone()
    });
    sorted(each.collect())
}

/// Loads `path` into engines of `world` ranks at `stage` and returns rank 0's parameters.
fn load_into_engine(
    path: &Path,
    c: &LlamaConfig,
    stage: ZeroStage,
    world: usize,
) -> Vec<NamedTensor> {
    let zc = config(stage, world, 1, 1, Precision::Bf16);
    let src = ModelWeights::open(path, Naming::Exact).unwrap();
    let out = run_ranks(world, Duration::from_secs(60), |comm| {
        let mut e = Engine::new(llama::build(c)?, zc.clone(), comm)?;
        e.load_parameters(&src)?;
        e.parameters()
    });
    sorted(out.unwrap().remove(0))
}

#[test]
fn every_stage_and_world_size_loads_single_file_and_shards_alike() {
    let c = cfg(2);
    let t = pretrained(&c);
    let tmp = tempfile::tempdir().unwrap();
    for dtype in [DType::F32, DType::Bf16, DType::F16] {
        let (one, many) = (tmp.path().join("one"), tmp.path().join("many"));
        write_dir(&one, &c, &t, dtype, u64::MAX);
        write_dir(&many, &c, &t, dtype, 20_000);
        assert!(one.join("model.safetensors").is_file());
        assert!(many.join("model.safetensors.index.json").is_file());
        let want = rounded(&t, dtype);
        for (stage, world) in [
            (ZeroStage::Stage0, 1),
            (ZeroStage::Stage2, 2),
            (ZeroStage::Stage3, 2),
        ] {
            assert_eq!(
                load_into_engine(&one, &c, stage, world),
                want,
                "{dtype:?} {stage:?}"
            );
            let idx = many.join("model.safetensors.index.json");
            assert_eq!(
                load_into_engine(&idx, &c, stage, world),
                want,
                "{dtype:?} {stage:?}"
            );
        }
        // The directory form and the lone single file give the same tensors.
        let lone = weights::load(&one.join("model.safetensors"), Naming::Exact).unwrap();
        assert_eq!(lone, weights::load(&many, Naming::Exact).unwrap());
    }
}

#[test]
fn gpt2_names_gain_the_transformer_prefix() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path().join("gpt2.safetensors");
    let v = [1.0f32, 2.0];
    weights::save(
        &p,
        &[
            ("h.0.ln_1.weight", &[2], &v),
            ("lm_head.weight", &[1, 2], &v),
        ],
        DType::F32,
    )
    .unwrap();
    let m = ModelWeights::open(&p, Naming::Gpt2).unwrap();
    let names: Vec<&str> = m.names().collect();
    assert_eq!(names, ["lm_head.weight", "transformer.h.0.ln_1.weight"]);
}

fn load_err(path: &Path, c: &LlamaConfig) -> String {
    let src = match ModelWeights::open(path, Naming::Exact) {
        Ok(s) => s,
        Err(e) => return e.to_string(),
    };
    let zc = config(ZeroStage::Stage3, 1, 1, 1, Precision::F32);
    let r = run_ranks(1, Duration::from_secs(60), |comm| {
        let mut e = Engine::new(llama::build(c)?, zc.clone(), comm)?;
        e.load_parameters(&src)
    });
    r.expect_err("a bad model directory must not load")
        .to_string()
}

fn sharded(tmp: &Path, name: &str) -> (std::path::PathBuf, LlamaConfig) {
    let c = cfg(2);
    let dir = tmp.join(name);
    write_dir(&dir, &c, &pretrained(&c), DType::Bf16, 20_000);
    (dir, c)
}

#[test]
fn a_bad_model_directory_is_one_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();

    let (dir, c) = sharded(tmp, "missing");
    let shard = dir.join("model-00002-of-00003.safetensors");
    std::fs::remove_file(&shard).unwrap();
    let e = load_err(&dir, &c);
    assert!(
        e.starts_with(&format!("{}: missing shard: ", shard.display())),
        "{e}"
    );
    assert!(e.contains("model.safetensors.index.json maps"), "{e}");

    let (dir, c) = sharded(tmp, "lacking");
    let idx = dir.join("model.safetensors.index.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&idx).unwrap()).unwrap();
    v["weight_map"]["model.extra.weight"] = "model-00001-of-00003.safetensors".into();
    std::fs::write(&idx, serde_json::to_vec(&v).unwrap()).unwrap();
    let e = load_err(&dir, &c);
    assert!(
        e.contains("model-00001-of-00003.safetensors: lacks tensor `model.extra.weight`, which"),
        "{e}"
    );

    let (dir, c) = sharded(tmp, "truncated");
    let f = dir.join("model-00003-of-00003.safetensors");
    let len = std::fs::metadata(&f).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&f)
        .unwrap()
        .set_len(len - 10)
        .unwrap();
    let e = load_err(&dir, &c);
    assert!(
        e.starts_with(&format!(
            "{}: truncated or not safetensors: tensor `",
            f.display()
        )),
        "{e}"
    );
    assert!(e.contains(&format!("the file has {}", len - 10)), "{e}");

    // A dtype nothing here loads: the header names it.
    let f = tmp.join("q4.safetensors");
    let header = br#"{"w":{"dtype":"Q4","shape":[2],"data_offsets":[0,1]}}   "#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend(header);
    bytes.push(0);
    std::fs::write(&f, bytes).unwrap();
    let e = load_err(&f, &c);
    assert_eq!(
        e,
        format!(
            "{}: tensor `w` has dtype Q4; only F32, BF16 and F16 load",
            f.display()
        )
    );

    // A tensor whose shape differs from what config.json describes.
    let dir = tmp.join("shape");
    let mut t = pretrained(&c);
    let norm = t
        .iter_mut()
        .find(|x| x.name == "model.norm.weight")
        .unwrap();
    norm.shape = vec![2, 16];
    write_dir(&dir, &c, &t, DType::F32, u64::MAX);
    let e = load_err(&dir, &c);
    let want = format!(
        "{}: tensor `model.norm.weight` has shape [2, 16]; the model {} describes needs [32]",
        dir.join("model.safetensors").display(),
        dir.join("config.json").display()
    );
    assert_eq!(e, want);

    // config.json says 3 layers, the weights have 2: the missing tensors are listed.
    let dir = tmp.join("fewer");
    write_dir(&dir, &cfg(3), &pretrained(&c), DType::F32, u64::MAX);
    let e = load_err(&dir, &cfg(3));
    assert!(
        e.contains("model.safetensors: lacks 9 tensors of the model"),
        "{e}"
    );
    assert!(e.contains("model.layers.2.self_attn.q_proj.weight"), "{e}");

    // config.json says 1 layer, the weights have 2: the first extra tensor is named.
    let dir = tmp.join("more");
    write_dir(&dir, &cfg(1), &pretrained(&c), DType::F32, u64::MAX);
    let e = load_err(&dir, &cfg(1));
    assert!(e.contains("tensor `model.layers.1."), "{e}");
    assert!(e.contains("is not a parameter of the model"), "{e}");

    let e = load_err(&tmp.join("nothing-here"), &c);
    assert!(
        e.starts_with(&format!("{}: ", tmp.join("nothing-here").display())),
        "{e}"
    );
    let empty = tmp.join("empty");
    std::fs::create_dir(&empty).unwrap();
    let e = load_err(&empty, &c);
    assert!(e.ends_with("a model directory needs model.safetensors or model.safetensors.index.json; it has neither"), "{e}");
}

#[test]
fn a_consolidated_model_directory_loads_back_bit_for_bit() {
    let c = cfg(2);
    let tmp = tempfile::tempdir().unwrap();
    let (src, ckpt) = (tmp.path().join("src"), tmp.path().join("ckpt"));
    write_dir(&src, &c, &pretrained(&c), DType::Bf16, u64::MAX);
    std::fs::write(src.join("tokenizer.json"), b"{\"model\":{}}").unwrap();
    let zc = config(ZeroStage::Stage3, 2, 1, 1, Precision::Bf16);
    let model = ModelWeights::open(&src, Naming::Exact).unwrap();
    let live = run_ranks(2, Duration::from_secs(60), |comm| {
        let mut e = Engine::new(llama::build(&c)?, zc.clone(), comm)?;
        e.load_parameters(&model)?;
        e.set_model_files(ModelFiles::from_dir(&src)?);
        let b = ferrozero_runtime::nn::Batch {
            tokens: vec![1, 2, 3, 4],
            targets: vec![2, 3, 4, 5],
            batch: 1,
            seq: 4,
        };
        e.train_batch(&[b])?;
        e.save_checkpoint(&ckpt, "s1", 1)?;
        e.parameters()
    });
    let live = sorted(live.unwrap().remove(0));

    let (one, many) = (tmp.path().join("one"), tmp.path().join("many"));
    let r1 = consolidate_dir(&ckpt, &Tag::Latest, &one, OutputDType::F32, u64::MAX).unwrap();
    let rn = consolidate_dir(&ckpt, &Tag::Latest, &many, OutputDType::F32, 30_000).unwrap();
    assert_eq!(r1.weight_files, ["model.safetensors"]);
    assert!(rn.weight_files.len() > 1, "{:?}", rn.weight_files);
    assert_eq!(r1.other_files, ["config.json", "tokenizer.json"]);
    assert_eq!(
        std::fs::read(many.join("config.json")).unwrap(),
        config_json(&c)
    );
    assert_eq!(
        std::fs::read(many.join("tokenizer.json")).unwrap(),
        b"{\"model\":{}}"
    );

    // HF's index: total_size is the data bytes, weight_map names every tensor's shard.
    let idx: serde_json::Value =
        serde_json::from_slice(&std::fs::read(many.join("model.safetensors.index.json")).unwrap())
            .unwrap();
    let elems: usize = live.iter().map(|t| t.data.len()).sum();
    assert_eq!(idx["metadata"]["total_size"], serde_json::json!(elems * 4));
    assert_eq!(idx["weight_map"].as_object().unwrap().len(), live.len());
    for f in &rn.weight_files {
        assert!(
            std::fs::metadata(many.join(f)).unwrap().len() < 30_000 + 4096,
            "{f}"
        );
    }

    assert_eq!(load_into_engine(&one, &c, ZeroStage::Stage3, 2), live);
    assert_eq!(load_into_engine(&many, &c, ZeroStage::Stage1, 1), live);
    let bf = tmp.path().join("bf16");
    consolidate_dir(&ckpt, &Tag::Latest, &bf, OutputDType::Bf16, 30_000).unwrap();
    assert_eq!(
        load_into_engine(&bf, &c, ZeroStage::Stage0, 1),
        rounded(&live, DType::Bf16)
    );
}
