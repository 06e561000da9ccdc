//! Property tests over the loader: random bytes, random TOML/JSON-ish token soup, and mutations
//! of real configs must produce a config or diagnostics, never a panic.

use ferrozero_config::{parse, Format, ResolveContext};
use proptest::prelude::*;

const SEED_TOML: &str = include_str!("../../configs/zero3_offload_nvme.toml");
const SEED_JSON: &str = r#"{"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
 "fp16": {"enabled": true, "loss_scale": 0, "initial_scale_power": 16, "hysteresis": 2},
 "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/n"}, "stage3_prefetch_bucket_size": 5e7},
 "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.999]}},
 "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 100, "warmup_num_steps": 10}},
 "tensorboard": {"enabled": true}}"#;

/// Loads and, when valid, resolves: both paths must stay panic-free.
fn exercise(src: &str, format: Format) {
    match parse(src, format, "fuzz") {
        Ok(l) => {
            for world in [1, 3] {
                let ctx = ResolveContext {
                    world_size: world,
                    hidden_size: Some(64),
                    micro_batch_hint: Some(2),
                };
                let _ = l.config.resolve(&ctx);
            }
        }
        Err(e) => {
            // Rendering walks every location: it must hold for any input too.
            let _ = e.to_string();
            assert!(e.errors().count() > 0);
        }
    }
}

fn mutate(seed: &str, edits: &[(usize, u8, u8)]) -> String {
    let mut bytes = seed.as_bytes().to_vec();
    for &(pos, op, byte) in edits {
        if bytes.is_empty() {
            break;
        }
        let i = pos % bytes.len();
        match op % 3 {
            0 => bytes[i] = byte,
            1 => {
                bytes.remove(i);
            }
            _ => bytes.insert(i, byte),
        }
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn random_text_never_panics(s in "\\PC{0,200}") {
        exercise(&s, Format::Toml);
        exercise(&s, Format::Json);
    }

    #[test]
    fn token_soup_never_panics(tokens in proptest::collection::vec(prop_oneof![
        Just("{"), Just("}"), Just("["), Just("]"), Just(","), Just(":"), Just("="), Just("\n"),
        Just("\"stage\""), Just("stage"), Just("\"auto\""), Just("5e8"), Just("-1"), Just("true"),
        Just("[zero_optimization]"), Just("\"\\u12"), Just("1.5"), Just("null"), Just("é")
    ], 0..60)) {
        let s: String = tokens.concat();
        exercise(&s, Format::Json);
        exercise(&s, Format::Toml);
    }

    #[test]
    fn mutated_configs_never_panic(edits in proptest::collection::vec((any::<usize>(), any::<u8>(), any::<u8>()), 1..8)) {
        exercise(&mutate(SEED_TOML, &edits), Format::Toml);
        exercise(&mutate(SEED_JSON, &edits), Format::Json);
    }
}
