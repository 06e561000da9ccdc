//! The event files are read back by TensorBoard's own reader (the `tensorboard` PyPI
//! package's `event_accumulator`, installed by `.ci/setup.d/tensorboard.sh`): every scalar
//! the CSV monitor wrote is there, at every step, with the same value. Under CI (`CI` set)
//! a missing package fails the test; elsewhere it is skipped with a message.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::{config, toy};
use ferrozero_config::resolved::{MonitorOutput, Precision, ZeroStage};
use ferrozero_runtime::comm::local::run_ranks;
use ferrozero_runtime::engine::Engine;

const STEPS: usize = 5;

/// Tag -> (step, value as written) from the CSV monitor's files.
fn csv_scalars(dir: &Path) -> BTreeMap<String, Vec<(u64, String)>> {
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let path = e.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        let name = path.file_stem().unwrap().to_str().unwrap();
        let tag = name.replacen("Train_Samples_", "Train/Samples/", 1);
        let rows = text
            .lines()
            .skip(1)
            .map(|l| {
                let (s, v) = l.split_once(',').unwrap();
                (s.parse().unwrap(), v.to_string())
            })
            .collect();
        out.insert(tag, rows);
    }
    out
}

#[test]
fn tensorboard_reads_every_scalar_at_every_step() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(
        ZeroStage::Stage3,
        2,
        2,
        1,
        Precision::Fp16(common::dynamic_scaling(8, 2, 1)),
    );
    cfg.monitor.tensorboard = Some(MonitorOutput {
        dir: dir.path().join("job"),
        all_ranks: false,
    });
    cfg.monitor.csv_monitor = Some(MonitorOutput {
        dir: dir.path().join("csv"),
        all_ranks: false,
    });
    run_ranks(2, Duration::from_secs(30), |comm| {
        let rank = comm.rank();
        let mut e = Engine::new(toy::model(11, 6, 5, 2), cfg.clone(), comm)?;
        for s in 0..STEPS {
            e.train_batch(&[toy::batch(11, 5, (s * 2 + rank) * 2, 2)])?;
        }
        Ok(())
    })
    .expect("training failed");

    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/read_tfevents.py");
    let out = Command::new("python3")
        .arg(&script)
        .arg(dir.path().join("job"))
        .output()
        .expect("python3 runs");
    if out.status.code() == Some(3) {
        let why = String::from_utf8_lossy(&out.stderr);
        assert!(
            std::env::var_os("CI").is_none(),
            "CI must install tensorboard (.ci/setup.d/tensorboard.sh): {why}"
        );
        eprintln!("skipped: {why}");
        return;
    }
    assert!(
        out.status.success(),
        "TensorBoard rejected the event file: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let tb: BTreeMap<String, Vec<(u64, serde_json::Value)>> =
        serde_json::from_slice(&out.stdout).unwrap();
    let csv = csv_scalars(&dir.path().join("csv"));
    assert!(
        csv.contains_key("Train/Samples/loss_scale"),
        "{:?}",
        csv.keys()
    );
    assert_eq!(
        tb.keys().collect::<Vec<_>>(),
        csv.keys().collect::<Vec<_>>(),
        "the same tags in both monitors"
    );
    let samples = cfg.train_batch_size as u64;
    for (tag, rows) in &csv {
        let read = &tb[tag];
        assert_eq!(read.len(), STEPS, "{tag}");
        for (i, ((step, v), (tb_step, tb_v))) in rows.iter().zip(read).enumerate() {
            assert_eq!(*step, (i as u64 + 1) * samples, "{tag}");
            assert_eq!(tb_step, step, "{tag}");
            let want = v.parse::<f64>().unwrap() as f32;
            match tb_v.as_f64() {
                Some(got) => assert_eq!(got as f32, want, "{tag} at {step}"),
                None => assert!(want.is_nan() || want.is_infinite(), "{tag}: {tb_v}"),
            }
        }
    }
}
