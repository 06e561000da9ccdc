//! Deterministic init and execution, configs, and error paths.

mod nn_common;

use ferrozero_runtime::backend::{self, Device};
use ferrozero_runtime::nn::gpt2::{self, Gpt2Config};
use ferrozero_runtime::nn::llama::{self, LlamaConfig};
use ferrozero_runtime::nn::{init, BatchIds, Ctx, Init, Params, Saved};
use ferrozero_runtime::tensor::Tensor;
use ferrozero_runtime::Error;
use nn_common::{batch, step, Weights};

/// A rayon pool of `threads` threads.
fn pool(threads: usize) -> rayon::ThreadPool {
    let b = rayon::ThreadPoolBuilder::new().num_threads(threads);
    b.build().unwrap()
}

#[test]
fn init_is_deterministic_thread_independent_and_has_the_right_moments() {
    let mut a = vec![0.0f32; 200_001];
    let mut b = a.clone();
    let (one, two) = (pool(1), pool(2));
    one.install(|| init::fill(&Init::Normal { std: 0.02 }, 42, &mut a));
    two.install(|| init::fill(&Init::Normal { std: 0.02 }, 42, &mut b));
    assert_eq!(a, b);
    let mean = a.iter().map(|&v| f64::from(v)).sum::<f64>() / a.len() as f64;
    let std = (a
        .iter()
        .map(|&v| (f64::from(v) - mean).powi(2))
        .sum::<f64>()
        / a.len() as f64)
        .sqrt();
    assert!(
        mean.abs() < 2e-4 && (std - 0.02).abs() < 2e-4,
        "mean {mean} std {std}"
    );
    init::fill(&Init::Uniform { bound: 0.5 }, 42, &mut a);
    assert!(a.iter().all(|v| v.abs() <= 0.5) && a.iter().any(|&v| v < -0.45));
    init::fill(&Init::Normal { std: 0.02 }, 43, &mut b);
    assert_ne!(a, b);
    assert_ne!(
        init::param_seed(1, "a.weight"),
        init::param_seed(1, "b.weight")
    );
}

#[test]
fn forward_and_backward_are_bitwise_identical_across_thread_counts() {
    // Large enough that gemm takes its multi-threaded path (m·n·k above 2^18).
    let mut cfg = Gpt2Config::preset("tiny").unwrap();
    (cfg.n_embd, cfg.n_head, cfg.vocab_size, cfg.n_positions) = (64, 4, 256, 64);
    let model = gpt2::build(&cfg).unwrap();
    let w = Weights::init(&model, 3);
    let b = batch(4, 45, 256, 2);
    let (one, two) = (pool(1), pool(2));
    let s1 = one.install(|| step(&model, &w, &b, 9, 0.5).unwrap());
    let s2 = two.install(|| step(&model, &w, &b, 9, 0.5).unwrap());
    assert_eq!(s1.loss.to_bits(), s2.loss.to_bits());
    assert_eq!(s1.grads, s2.grads);
    let again = two.install(|| step(&model, &w, &b, 9, 0.5).unwrap());
    assert_eq!(
        s2.grads, again.grads,
        "recomputation (activation checkpointing) must reproduce"
    );
}

#[test]
fn configs_load_from_hugging_face_json_and_reject_bad_values() {
    let l = LlamaConfig::from_json(
        r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 11008,
            "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
            "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "vocab_size": 32000,
            "max_position_embeddings": 4096, "tie_word_embeddings": false, "torch_dtype": "float16"}"#,
    )
    .unwrap();
    assert_eq!(l, LlamaConfig::preset("llama-7b").unwrap());
    assert_eq!(llama::build(&l).unwrap().num_params(), 6_738_415_616);
    let e = LlamaConfig::from_json(
        r#"{"hidden_size": 30, "intermediate_size": 8, "num_attention_heads": 4,
        "num_hidden_layers": 1, "vocab_size": 8, "max_position_embeddings": 8}"#,
    )
    .unwrap_err();
    assert!(matches!(e, Error::Config(_)), "{e}");
    let e = Gpt2Config::from_json(
        r#"{"n_layer": 1, "n_head": 5, "n_embd": 16, "vocab_size": 8, "n_positions": 8}"#,
    )
    .unwrap_err();
    assert!(e.to_string().contains("multiple of n_head"), "{e}");
    assert!(Gpt2Config::from_json("{").is_err());
    assert!(Gpt2Config::preset("gpt5").is_err());
    let bench = Gpt2Config::preset("bench-15m").unwrap();
    assert_eq!(
        (bench.n_layer, bench.n_embd, bench.n_head, bench.vocab_size),
        (6, 384, 6, 4096)
    );
}

#[test]
fn bad_inputs_are_errors_not_panics() {
    let model = gpt2::build(&Gpt2Config::preset("tiny").unwrap()).unwrap();
    let w = Weights::init(&model, 1);
    let mut b = batch(1, 4, 64, 1);
    b.tokens[2] = 64;
    assert!(step(&model, &w, &b, 0, 1.0)
        .unwrap_err()
        .to_string()
        .contains("token id 64"));
    let mut b = batch(1, 4, 64, 1);
    b.targets[1] = 99;
    assert!(step(&model, &w, &b, 0, 1.0).is_err());
    let b = batch(1, 33, 64, 1);
    assert!(step(&model, &w, &b, 0, 1.0)
        .unwrap_err()
        .to_string()
        .contains("exceeds"));
    let mut b = batch(1, 4, 64, 1);
    b.targets.pop();
    assert!(step(&model, &w, &b, 0, 1.0).is_err());
    // Backward without forward, and a block fed the wrong width.
    let b = batch(1, 4, 64, 1);
    let block = &model.units[1];
    let p: Vec<Vec<f32>> = w.units[1].clone();
    let params = Params::new(p.iter().map(|v| v.as_slice().into()).collect());
    let be = backend::cpu();
    let ids = BatchIds::new(&*be, &b).unwrap();
    let mut saved: Saved = None;
    let mut ctx = Ctx {
        be: &*be,
        batch: &b,
        ids: &ids,
        training: true,
        rng_seed: 0,
        rng_row: 0,
        saved: &mut saved,
    };
    let mut g: Vec<Vec<f32>> = p.iter().map(|v| vec![0.0; v.len()]).collect();
    let mut grads =
        ferrozero_runtime::nn::Grads::new(g.iter_mut().map(|v| v.as_mut_slice().into()).collect());
    let e = block
        .module
        .backward(
            &mut ctx,
            &params,
            &mut grads,
            &Tensor::zeros(vec![1, 4, 16]),
        )
        .unwrap_err();
    assert!(
        e.to_string().contains("without a training-mode forward"),
        "{e}"
    );
    assert!(block
        .module
        .forward(&mut ctx, &params, &Tensor::zeros(vec![1, 4, 15]))
        .is_err());
}

#[test]
fn cuda_is_reported_unavailable_with_a_reason() {
    use ferrozero_runtime::tensor::DType;
    assert_eq!(
        backend::open(Device::Cpu, DType::Bf16, 0).unwrap().name(),
        "cpu"
    );
    let gpus = backend::cuda::device_count().unwrap_or(0);
    match backend::open(Device::Cuda(None), DType::Bf16, 0) {
        Ok(b) if gpus > 0 => assert!(b.name().starts_with("cuda:"), "{}", b.name()),
        Err(Error::Unavailable { what, why }) if gpus == 0 => {
            assert!(what.starts_with("CUDA"), "{what}");
            assert!(why.to_lowercase().contains("cuda"), "{why}");
        }
        other => panic!(
            "{gpus} GPUs, yet opening CUDA gave {:?}",
            other.map(|b| b.name())
        ),
    }
    // `auto` takes the GPU when there is one; without a usable GPU it is the CPU, not an error.
    let auto = backend::open(Device::Auto, DType::F32, 1).unwrap().name();
    if gpus > 0 {
        assert!(
            auto.starts_with("cuda:"),
            "{gpus} GPUs, yet auto opened {auto}"
        );
    } else {
        assert_eq!(auto, "cpu");
    }
}
