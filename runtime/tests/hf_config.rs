//! Reading Hugging Face `config.json`s: each architecture's keys and forms, and a clear error
//! naming the key and what is supported for everything the models do not implement.

use ferrozero_runtime::backend::{Rope, RopeScaling};
use ferrozero_runtime::nn::hf::{Architecture, HfModel, ModelConfig};
use ferrozero_runtime::nn::llama::LlamaConfig;
use ferrozero_runtime::nn::weights::Naming;
use ferrozero_runtime::nn::{Batch, BatchIds, Ctx, Params};
use ferrozero_runtime::tensor::{Tensor, View};
use serde_json::{json, Value};

fn llama(extra: Value) -> Value {
    let mut v = json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32,
        "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 61, "max_position_embeddings": 64,
        "torch_dtype": "bfloat16", "transformers_version": "4.45.0", "bos_token_id": 1,
        "eos_token_id": [2, 3], "use_cache": true, "hidden_act": "silu"
    });
    v.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    v
}

fn read(v: &Value) -> ferrozero_runtime::Result<HfModel> {
    HfModel::from_json(&v.to_string(), "model/config.json")
}

fn err(v: &Value) -> String {
    read(v).unwrap_err().to_string()
}

fn llama_cfg(m: &HfModel) -> &LlamaConfig {
    match &m.config {
        ModelConfig::Llama(c) => c,
        other => panic!("not Llama-family: {other:?}"),
    }
}

#[test]
fn both_rope_forms_read_the_same_llama3_scaling() {
    let scaling = json!({"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192});
    let mut old = scaling.clone();
    old["rope_type"] = json!("llama3");
    let v4 = read(&llama(json!({"rope_theta": 500000.0, "rope_scaling": old}))).unwrap();
    let mut params = scaling;
    params["rope_type"] = json!("llama3");
    params["rope_theta"] = json!(500000.0);
    let v5 = read(&llama(json!({ "rope_parameters": params }))).unwrap();
    assert_eq!(v4, v5);
    let want = Rope {
        theta: 500000.0,
        scaling: RopeScaling::Llama3 {
            factor: 32.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        },
    };
    assert_eq!(llama_cfg(&v4).rope, want);
    // The older `type` spelling of linear scaling.
    let lin = read(&llama(
        json!({"rope_scaling": {"type": "linear", "factor": 2.0}}),
    ))
    .unwrap();
    assert_eq!(
        llama_cfg(&lin).rope.scaling,
        RopeScaling::Linear { factor: 2.0 }
    );
}

#[test]
fn llama3_frequencies_follow_the_three_bands() {
    let rope = Rope {
        theta: 10000.0,
        scaling: RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 256,
        },
    };
    let plain = Rope::plain(10000.0).inv_freq(16);
    let scaled = rope.inv_freq(16);
    // Wavelengths 6.3, 20, 63 stay (below 256/4); 199 is smoothed; 628 and longer are / 8.
    for i in 0..3 {
        assert_eq!(scaled[i], plain[i]);
    }
    let wavelen = 2.0 * std::f64::consts::PI / plain[3];
    let smooth = (256.0 / wavelen - 1.0) / 3.0;
    assert!((scaled[3] - ((1.0 - smooth) * plain[3] / 8.0 + smooth * plain[3])).abs() < 1e-15);
    for i in 4..8 {
        assert!((scaled[i] - plain[i] / 8.0).abs() < 1e-18);
    }
}

#[test]
fn each_architecture_is_named_and_built_with_its_naming() {
    let tied = read(&llama(json!({"tie_word_embeddings": true, "head_dim": 16}))).unwrap();
    assert_eq!(tied.architecture, Architecture::Llama);
    assert_eq!((tied.vocab(), tied.hidden(), tied.max_seq()), (61, 32, 64));
    assert_eq!(tied.naming(), Naming::Exact);
    let names: Vec<String> = tied
        .build()
        .unwrap()
        .shared
        .iter()
        .map(|p| p.name.clone())
        .collect();
    assert_eq!(names, ["model.embed_tokens.weight"]);
    let mut q = llama(json!({"model_type": "qwen2"}));
    q["architectures"] = json!(["Qwen2ForCausalLM"]);
    let qwen = read(&q).unwrap();
    assert!(llama_cfg(&qwen).qkv_bias);
    let specs = qwen.build().unwrap().units[1].module.param_specs();
    assert!(specs
        .iter()
        .any(|p| p.name == "model.layers.0.self_attn.k_proj.bias" && p.shape == [16]));
    let gpt2 = read(
        &json!({"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 8,
        "vocab_size": 10, "n_positions": 16, "attn_pdrop": 0.0}),
    )
    .unwrap();
    assert_eq!(
        (gpt2.architecture, gpt2.naming()),
        (Architecture::Gpt2, Naming::Gpt2)
    );
}

#[test]
fn unsupported_architectures_and_values_are_named_with_what_is_supported() {
    let mut v = llama(json!({}));
    v["architectures"] = json!(["FalconForCausalLM"]);
    let e = err(&v);
    assert!(
        e.contains("model/config.json") && e.contains("`FalconForCausalLM`"),
        "{e}"
    );
    assert!(e.contains("GPT2LMHeadModel (gpt2), LlamaForCausalLM (llama), MistralForCausalLM (mistral), Qwen2ForCausalLM (qwen2)"), "{e}");
    let e = err(&llama(json!({"hidden_act": "gelu"})));
    assert!(
        e.contains("`hidden_act` = \"gelu\"") && e.contains("supported: silu, swish"),
        "{e}"
    );
    let e = err(&llama(
        json!({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}),
    ));
    assert!(
        e.contains("\"yarn\"") && e.contains("supported: default, linear, llama3"),
        "{e}"
    );
    let e = err(&llama(
        json!({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}),
    ));
    assert!(
        e.contains("`rope_parameters` lacks `low_freq_factor`"),
        "{e}"
    );
    let e = err(&llama(json!({"attention_bias": true})));
    assert!(
        e.contains("LlamaForCausalLM config: key `attention_bias` = true"),
        "{e}"
    );
    let e = err(&llama(json!({"mlp_bias": true})));
    assert!(e.contains("`mlp_bias` = true"), "{e}");
    let m = read(&llama(json!({"attention_dropout": 0.1}))).unwrap();
    assert_eq!(llama_cfg(&m).attention_dropout, 0.1);
    let e = err(&llama(json!({"attention_dropout": 1.0})));
    assert!(e.contains("attention_dropout = 1 is outside [0, 1)"), "{e}");
    let e = err(&llama(json!({"quantization_config": {"bits": 4}})));
    assert!(
        e.contains("key `quantization_config` is not supported"),
        "{e}"
    );
    let e = err(&llama(json!({"hidden_size": "big"})));
    assert!(e.contains("`hidden_size` = \"big\""), "{e}");
    let mut q = llama(json!({"layer_types": ["full_attention", "chunked_attention"]}));
    q["architectures"] = json!(["Qwen2ForCausalLM"]);
    assert!(err(&q).contains("chunked_attention"), "{}", err(&q));
    // transformers' defaults (every dropout 0.1) train as shipped; only a rate of 1 is refused.
    let gpt2 = json!({"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 8,
        "vocab_size": 10, "n_positions": 16});
    match read(&gpt2).unwrap().config {
        ModelConfig::Gpt2(c) => assert_eq!(c.attn_pdrop, 0.1),
        other => panic!("not GPT-2: {other:?}"),
    }
    let mut sure = gpt2.clone();
    sure["attn_pdrop"] = json!(1.0);
    assert!(
        err(&sure).contains("attn_pdrop = 1 is outside [0, 1)"),
        "{}",
        err(&sure)
    );
    let e = err(
        &json!({"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 8,
        "vocab_size": 10, "n_positions": 16, "attn_pdrop": 0.0, "n_inner": 20}),
    );
    assert!(e.contains("`n_inner` = 20"), "{e}");
}

#[test]
fn mistral_refuses_a_sequence_longer_than_its_window() {
    let mut v = llama(json!({"model_type": "mistral", "sliding_window": 8}));
    v["architectures"] = json!(["MistralForCausalLM"]);
    let m = read(&v).unwrap();
    assert_eq!(m.max_seq(), 8);
    let model = m.build().unwrap();
    let be = ferrozero_runtime::backend::cpu();
    let w = vec![0.01f32; 61 * 32];
    let run = |seq: usize| {
        let b = Batch {
            batch: 1,
            seq,
            tokens: vec![1; seq],
            targets: vec![2; seq],
        };
        let ids = BatchIds::new(&*be, &b).unwrap();
        let mut saved = None;
        let mut ctx = Ctx {
            be: &*be,
            batch: &b,
            ids: &ids,
            training: false,
            rng_seed: 0,
            rng_row: 0,
            saved: &mut saved,
        };
        let p = Params::new(vec![View::from(&w[..])]);
        model.units[0]
            .module
            .forward(&mut ctx, &p, &Tensor::default())
            .map(|_| ())
    };
    run(8).expect("within the window");
    let e = run(9).unwrap_err().to_string();
    assert!(
        e.contains("sequence length 9 exceeds the model's sliding_window 8"),
        "{e}"
    );
    // `null`: no window.
    let mut v = v.clone();
    v["sliding_window"] = Value::Null;
    assert_eq!(read(&v).unwrap().max_seq(), 64);
}
