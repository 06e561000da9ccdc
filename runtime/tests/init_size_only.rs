//! `initialize`'s pre-flight on a model the estimate cannot run: a module computing with host
//! loops (the tests' toy) runs on the CPU backend only, so the size-only step the estimate
//! runs refuses it with [`Error::SizeOnly`] naming the unit. `initialize` then warns that
//! memory was not checked and builds the engine, which trains; any other failure of the
//! pre-flight (a run that does not fit) still refuses, and the estimate itself still errors.

mod common;

use std::io::Write;
use std::sync::{Arc, Mutex};

use common::{config, toy};
use ferrozero_config::resolved::{Precision, ZeroStage};
use ferrozero_runtime::engine::estimate::estimate;
use ferrozero_runtime::engine::EngineBuilder;
use ferrozero_runtime::Error;

const V: usize = 11;
const SEQ: usize = 5;

/// A CPU run with pinned offloaded state (the locked-memory check estimates) and a sequence
/// length (the pre-flight estimates).
const PINNED: &str = r#"
    device = "cpu"
    train_micro_batch_size_per_gpu = 2
    optimizer = { type = "AdamW", params = { lr = 1e-2 } }
    [zero_optimization]
    stage = 2
    [zero_optimization.offload_optimizer]
    device = "cpu"
    pin_memory = true
"#;

fn parse(src: &str) -> ferrozero_config::Config {
    ferrozero_config::parse(src, ferrozero_config::Format::Toml, "t.toml")
        .expect("a valid config")
        .config
}

/// What `f` logged at WARN and above on this thread.
fn warnings<R>(f: impl FnOnce() -> R) -> (R, String) {
    #[derive(Clone)]
    struct Sink(Arc<Mutex<Vec<u8>>>);
    impl Write for Sink {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let sink = Sink(Arc::new(Mutex::new(Vec::new())));
    let w = sink.clone();
    let sub = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::WARN)
        .with_ansi(false)
        .with_writer(move || w.clone())
        .finish();
    let r = tracing::subscriber::with_default(sub, f);
    let text = String::from_utf8(sink.0.lock().unwrap().clone()).unwrap();
    (r, text)
}

#[test]
fn a_host_loop_model_initialises_unchecked_and_trains() {
    for (what, src, seq) in [
        ("pinned memory", PINNED, None),
        ("pinned memory and a sequence length", PINNED, Some(SEQ)),
        (
            "a sequence length",
            "device = \"cpu\"\ntrain_micro_batch_size_per_gpu = 2\n\
             optimizer = { type = \"AdamW\", params = { lr = 1e-2 } }\n",
            Some(SEQ),
        ),
    ] {
        let (engine, warned) = warnings(|| {
            let b = EngineBuilder::new(toy::model(V, 6, SEQ, 2)).config(parse(src));
            match seq {
                Some(s) => b.sequence_length(s),
                None => b,
            }
            .build()
        });
        let mut engine = engine.unwrap_or_else(|e| panic!("{what}: refused: {e}"));
        assert!(warned.contains("memory not checked"), "{what}: {warned}");
        // The unit that stops the size-only run is named, once.
        assert!(warned.contains("unit `embed`"), "{what}: {warned}");
        assert_eq!(warned.matches("memory not checked").count(), 1, "{warned}");
        let first = engine.train_batch(&[toy::batch(V, SEQ, 0, 2)]).unwrap();
        let second = engine.train_batch(&[toy::batch(V, SEQ, 0, 2)]).unwrap();
        assert!(first.loss.is_finite(), "{what}: {first:?}");
        assert!(second.loss < first.loss, "{what}: the toy does not learn");
    }
}

/// A model the estimate runs is still refused when it does not fit: only a model the
/// size-only device cannot run goes on unchecked.
#[test]
fn a_run_that_does_not_fit_is_still_refused() {
    let src = "device = \"cpu\"\ndevice_memory_limit = \"2KB\"\n\
               train_micro_batch_size_per_gpu = 2\n\
               optimizer = { type = \"AdamW\", params = { lr = 1e-3 } }\n";
    let gpt2 = ferrozero_runtime::nn::gpt2::Gpt2Config::preset("tiny").unwrap();
    let (r, warned) = warnings(|| {
        EngineBuilder::new(ferrozero_runtime::nn::gpt2::build(&gpt2).unwrap())
            .config(parse(src))
            .sequence_length(SEQ)
            .build()
    });
    let err = r.err().expect("a 2 KB device cap refused");
    assert!(
        matches!(err, Error::DeviceMemory { .. }),
        "the cap's refusal: {err}"
    );
    assert!(!warned.contains("memory not checked"), "{warned}");
}

/// The estimate has no way to price such a model: it errors with the variant, naming the unit
/// and what the module asked for.
#[test]
fn the_estimate_of_a_host_loop_model_errors_naming_the_unit() {
    let cfg = config(ZeroStage::Stage2, 1, 2, 1, Precision::F32);
    let err = estimate(&toy::model(V, 6, SEQ, 2), &cfg, 2, SEQ)
        .expect_err("the size-only step refuses host loops");
    let Error::SizeOnly(why) = &err else {
        panic!("not the size-only variant: {err}")
    };
    assert!(why.starts_with("unit `embed`:"), "{why}");
    assert!(why.contains("host loops"), "{why}");
    assert!(
        err.to_string()
            .starts_with("cannot run on a size-only device: unit `embed`"),
        "{err}"
    );
}
