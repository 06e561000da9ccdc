//! LoRA training against PEFT's own: transformers' GPT-2 (Conv1D layers, adapters on one
//! block) and Llama (GQA, tied head, every linear layer, per-pattern ranks and alphas, the
//! norms trained in full) built from their `config.json` with the adapters PEFT wrote
//! (`fixtures/peft/<arch>/start`), every base weight frozen, trained 20 f32 AdamW steps
//! with clipping over the trainable parameters: every step's loss within 2e-5 of PEFT's
//! training (fixtures and script: `tests/fixtures/gen_peft_parity.py`), at stage 0 on one
//! rank and at stage 3 on two; the frozen base weights do not move.

mod common;
mod peft_common;

use std::time::Duration;

use common::parity_config;
use ferrozero_config::resolved::ZeroStage;
use ferrozero_runtime::comm::local::run_ranks;
use ferrozero_runtime::engine::{Engine, NamedTensor};
use ferrozero_runtime::nn::hf::HfModel;
use ferrozero_runtime::nn::peft::{AdapterWeights, PeftRun, PeftSource};
use ferrozero_runtime::nn::weights::{self, Naming};
use ferrozero_runtime::nn::Batch;
use peft_common::{fixtures, saved_params, sites, tensors};

const STEPS: usize = 20;
const TOLERANCE: f64 = 2e-5;

/// The base weights and the starting adapter under the model's names, the batches, and
/// PEFT's losses.
struct Fixture {
    hf: HfModel,
    init: Vec<NamedTensor>,
    batches: Vec<Batch>,
    want: Vec<f64>,
}

fn fixture(arch: &str) -> Fixture {
    let hf_dir = fixtures().join(format!("hf/{arch}"));
    let hf = HfModel::from_file(&hf_dir.join("config.json")).unwrap();
    let src = PeftSource::open(&fixtures().join(format!("peft/{arch}/start"))).unwrap();
    let adapters = src.config.adapters(&sites(arch), arch).unwrap();
    let saved = saved_params(arch, &src.config);
    let saved: Vec<(&str, &[usize])> = (saved.iter())
        .map(|(n, s)| (n.as_str(), s.as_slice()))
        .collect();
    let w = AdapterWeights::read(src.weights.as_ref().unwrap(), &adapters, &saved).unwrap();
    let file = weights::load(&hf_dir.join("parity.safetensors"), Naming::Exact).unwrap();
    let take = |n: &str| file.iter().find(|t| t.name == n).unwrap();
    let model = hf.build_lora(&src.config).unwrap();
    let names = model.param_names();
    let mut init: Vec<NamedTensor> = (file.iter())
        .filter(|t| !t.name.starts_with("batch.") && t.name != "losses")
        .map(|t| NamedTensor {
            name: hf.naming().canonical(&t.name),
            ..t.clone()
        })
        .filter(|t| names.contains(&t.name) && !src.config.saves(&t.name))
        .collect();
    init.extend(w.named(&adapters));
    assert_eq!(
        init.len(),
        names.len(),
        "{arch}: every parameter has a value"
    );
    let (tokens, targets) = (take("batch.tokens"), take("batch.targets"));
    let [steps, rows, seq] = tokens.shape[..] else {
        panic!("batch.tokens shape {:?}", tokens.shape)
    };
    assert_eq!(steps, STEPS);
    let batches = (0..steps)
        .map(|s| Batch {
            batch: rows,
            seq,
            tokens: tokens.data[s * rows * seq..(s + 1) * rows * seq]
                .iter()
                .map(|&t| t as u32)
                .collect(),
            targets: targets.data[s * rows * seq..(s + 1) * rows * seq]
                .iter()
                .map(|&t| t as i32)
                .collect(),
        })
        .collect();
    let want = tensors(&fixtures().join(format!("peft/{arch}/parity.safetensors")))["losses"]
        .iter()
        .map(|&l| l as f64)
        .collect();
    Fixture {
        hf,
        init,
        batches,
        want,
    }
}

/// `rows` of `b` from `first`.
fn rows_of(b: &Batch, first: usize, rows: usize) -> Batch {
    let span = first * b.seq..(first + rows) * b.seq;
    Batch {
        batch: rows,
        seq: b.seq,
        tokens: b.tokens[span.clone()].to_vec(),
        targets: b.targets[span].to_vec(),
    }
}

/// Each step's loss, and the parameters before and after, on `world` ranks at `stage`.
fn train(
    arch: &str,
    f: &Fixture,
    stage: ZeroStage,
    world: usize,
) -> (Vec<f64>, Vec<NamedTensor>, Vec<NamedTensor>) {
    let rows = f.batches[0].batch / world;
    let cfg = parity_config(stage, world, rows);
    let lora = PeftSource::open(&fixtures().join(format!("peft/{arch}/start")))
        .unwrap()
        .config;
    let out = run_ranks(world, Duration::from_secs(300), |comm| {
        let r = comm.rank();
        let mut e = Engine::new(f.hf.build_lora(&lora)?, cfg.clone(), comm)?;
        e.set_parameters(&f.init)?;
        let before = e.parameters()?;
        let mut losses = Vec::new();
        for b in &f.batches {
            losses.push(e.train_batch(&[rows_of(b, r * rows, rows)])?.loss);
        }
        Ok((losses, before, e.parameters()?))
    })
    .expect("training runs");
    out.into_iter().next().unwrap()
}

fn check(arch: &str) {
    let f = fixture(arch);
    let model =
        f.hf.build_lora(
            &PeftSource::open(&fixtures().join(format!("peft/{arch}/start")))
                .unwrap()
                .config,
        )
        .unwrap();
    for (stage, world) in [(ZeroStage::Stage0, 1), (ZeroStage::Stage3, 2)] {
        let (got, before, after) = train(arch, &f, stage, world);
        for (s, (g, w)) in got.iter().zip(&f.want).enumerate() {
            assert!(
                (g - w).abs() <= TOLERANCE,
                "{arch} {stage:?} world {world} step {s}: loss {g} vs PEFT's {w}\n got {got:?}\nwant {:?}",
                f.want
            );
        }
        let worst = (got.iter().zip(&f.want)).fold(0.0f64, |m, (g, w)| m.max((g - w).abs()));
        eprintln!("{arch} {stage:?} world {world}: worst loss difference from PEFT {worst:.2e}");
        for (b, a) in before.iter().zip(&after) {
            let same = b
                .data
                .iter()
                .zip(&a.data)
                .all(|(x, y)| x.to_bits() == y.to_bits());
            assert_eq!(
                same,
                model.is_frozen(&b.name),
                "{arch}: {} moved: {}",
                b.name,
                !same
            );
        }
        check_exports(arch, &after);
    }
    assert_ne!(f.want[0], f.want[STEPS - 1]);
}

/// The trained adapter against PEFT's trained adapter (`peft/<arch>/trained`), and the merged
/// model against PEFT's `merge_and_unload()` (`peft/<arch>/parity.safetensors`): within 1e-4.
fn check_exports(arch: &str, after: &[NamedTensor]) {
    let hf = HfModel::from_file(&fixtures().join(format!("hf/{arch}/config.json"))).unwrap();
    let run = PeftRun::open(&fixtures().join(format!("peft/{arch}/trained")), &hf).unwrap();
    let want = run.start.as_ref().unwrap();
    let got = run.weights_of(after).unwrap();
    let mut worst = 0.0f32;
    for (m, f) in &want.lora {
        let g = &got.lora[m];
        for (x, y) in f.a.iter().zip(&g.a).chain(f.b.iter().zip(&g.b)) {
            worst = worst.max((x - y).abs());
        }
    }
    for (n, t) in &want.saved {
        for (x, y) in t.data.iter().zip(&got.saved[n].data) {
            worst = worst.max((x - y).abs());
        }
    }
    assert!(
        worst <= 1e-4,
        "{arch}: the trained adapter is {worst:e} from PEFT's"
    );
    let merged = run.merged(after.to_vec()).unwrap();
    let peft = tensors(&fixtures().join(format!("peft/{arch}/parity.safetensors")));
    let mut worst_merged = 0.0f32;
    for (name, v) in peft.iter().filter(|(n, _)| *n != "losses") {
        let ours = &merged
            .iter()
            .find(|t| t.name == hf.naming().canonical(name))
            .unwrap()
            .data;
        for (x, y) in ours.iter().zip(v) {
            worst_merged = worst_merged.max((x - y).abs());
        }
    }
    assert!(
        worst_merged <= 1e-4,
        "{arch}: merged {worst_merged:e} from PEFT's merge"
    );
    eprintln!("{arch}: adapter within {worst:.1e} of PEFT's, merged within {worst_merged:.1e}");
}

#[test]
fn gpt2_lora_trains_as_peft_does() {
    check("gpt2");
}

#[test]
fn llama_lora_with_patterns_and_saved_norms_trains_as_peft_does() {
    check("llama");
}
