//! The engine's observers: the communication logger counts exactly the bytes the engine's
//! schedule moves (2 ranks, stage 3), the monitors write one row per step under DeepSpeed's
//! names and layout, and neither changes a bit of training.

mod common;

use std::path::Path;
use std::time::Duration;

use common::runs::{train_logged, Logged as Run, D, LAYERS, T, V};
use common::{comms_logger as logger, config, toy};
use ferrozero_config::resolved::{
    CommsLoggerConfig, MonitorConfig, MonitorOutput, Precision, ResolvedConfig, ZeroStage,
};
use ferrozero_runtime::comm::local::run_ranks;
use ferrozero_runtime::comm::logger::OpSummary;
use ferrozero_runtime::engine::partition::GroupLayout;
use ferrozero_runtime::engine::Engine;
use ferrozero_runtime::nn::Model;

const STEPS: usize = 4;

fn monitors(dir: &Path) -> MonitorConfig {
    let out = |name: &str| {
        Some(MonitorOutput {
            dir: dir.join(name),
            all_ranks: false,
        })
    };
    MonitorConfig {
        tensorboard: out("tb"),
        csv_monitor: out("csv"),
        comms_logger: Some(logger()),
        ..MonitorConfig::default()
    }
}

/// Trains `STEPS` steps on every rank; rank 0's losses, parameters and comm records.
fn train(cfg: &ResolvedConfig) -> Run {
    train_logged(cfg, || toy::model(V, D, T, LAYERS), V, STEPS)
}

fn bits(r: &Run) -> (Vec<u64>, Vec<Vec<u32>>) {
    (
        r.losses.iter().map(|l| l.to_bits()).collect(),
        r.params
            .iter()
            .map(|t| t.data.iter().map(|x| x.to_bits()).collect())
            .collect(),
    )
}

/// Bytes per collective kind of one stage-3 run, from the engine's own layouts and schedule:
/// each unit's group (and the tied group with the units that read it) is all-gathered when
/// a unit needs it and it is not gathered yet, released after backward and after forward
/// unless reused within `max_reuse_distance`; each group is reduce-scattered once per
/// micro-step; a step all-reduces five f32 scalars pairs (targets, loss, tokens: two f32
/// each; overflow and norm: one each).
fn expected_stage3_bytes(model: &Model, cfg: &ResolvedConfig) -> (u64, u64, u64) {
    let world = cfg.world_size;
    let mut layouts: Vec<GroupLayout> = model
        .units
        .iter()
        .map(|u| GroupLayout::new(&u.module.param_specs(), world))
        .collect();
    layouts.push(GroupLayout::new(&model.shared, world));
    let n = model.units.len();
    let shared = n;
    let shard_bytes = |g: usize| (layouts[g].shard_len * 4) as u64;
    let groups_of = |u: usize| {
        let mut g = vec![u];
        if !model.units[u].uses_shared.is_empty() {
            g.push(shared);
        }
        g
    };
    let mut gathered = vec![false; n + 1];
    let mut gather_bytes = 0;
    let mut gather = |u: usize, gathered: &mut Vec<bool>| {
        for g in groups_of(u) {
            if !gathered[g] {
                gathered[g] = true;
                gather_bytes += shard_bytes(g);
            }
        }
    };
    let release = |u: usize, gathered: &mut Vec<bool>| {
        for g in groups_of(u) {
            gathered[g] = false;
        }
    };
    let micro_steps = STEPS * cfg.gradient_accumulation_steps;
    for _ in 0..micro_steps {
        for u in 0..n {
            gather(u, &mut gathered);
            let later: usize = layouts[u + 1..n].iter().map(|l| l.padded()).sum();
            if 2 * later > cfg.zero.max_reuse_distance {
                release(u, &mut gathered);
            }
        }
        for u in (0..n).rev() {
            gather(u, &mut gathered);
            release(u, &mut gathered);
        }
    }
    let reduce: u64 = (0..=n).map(shard_bytes).sum::<u64>() * micro_steps as u64;
    let scalars = (STEPS * (2 + 2 + 2 + 1 + 1) * 4) as u64;
    (gather_bytes, reduce, scalars)
}

fn bytes_of(rows: &[OpSummary], op: &str) -> u64 {
    rows.iter().filter(|r| r.op == op).map(|r| r.bytes).sum()
}

#[test]
fn comms_logger_bytes_equal_the_engines_schedule_two_rank_stage3() {
    for reuse in [0, 1_000_000] {
        let mut cfg = config(ZeroStage::Stage3, 2, 2, 2, Precision::F32);
        cfg.zero.max_reuse_distance = reuse;
        cfg.monitor.comms_logger = Some(logger());
        let run = train(&cfg);
        let rows = run.comms.expect("the logger is enabled");
        let (gather, reduce, scalars) = expected_stage3_bytes(&toy::model(V, D, T, LAYERS), &cfg);
        assert!(gather > 0 && reduce > 0);
        assert_eq!(
            bytes_of(&rows, "all_gather_into_tensor"),
            gather,
            "reuse {reuse}"
        );
        assert_eq!(
            bytes_of(&rows, "reduce_scatter_tensor"),
            reduce,
            "reuse {reuse}"
        );
        assert_eq!(bytes_of(&rows, "all_reduce"), scalars, "reuse {reuse}");
        let kinds: Vec<&str> = rows.iter().map(|r| r.op.as_str()).collect();
        assert!(
            kinds.iter().all(|k| [
                "all_gather_into_tensor",
                "reduce_scatter_tensor",
                "all_reduce"
            ]
            .contains(k)),
            "unexpected collectives: {kinds:?}"
        );
        for r in &rows {
            assert_eq!(r.bytes, r.count * r.msg_size);
            assert!(r.total_ms >= 0.0 && r.busbw_gbps >= 0.0);
        }
    }
}

#[test]
fn comms_logger_records_only_prof_ops_when_prof_all_is_off() {
    let mut cfg = config(ZeroStage::Stage3, 2, 2, 1, Precision::F32);
    cfg.monitor.comms_logger = Some(CommsLoggerConfig {
        prof_all: false,
        prof_ops: vec!["reduce_scatter_tensor".into()],
        ..logger()
    });
    let rows = train(&cfg).comms.unwrap();
    assert!(!rows.is_empty());
    assert!(
        rows.iter().all(|r| r.op == "reduce_scatter_tensor"),
        "{rows:?}"
    );
}

fn csv_rows(path: &Path) -> Vec<Vec<String>> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.lines()
        .map(|l| l.split(',').map(str::to_string).collect())
        .collect()
}

#[test]
fn monitors_leave_cpu_training_bitwise_unchanged_and_write_every_step() {
    let dir = tempfile::tempdir().unwrap();
    for stage in [ZeroStage::Stage0, ZeroStage::Stage3] {
        let plain = config(stage, 2, 2, 2, Precision::F32);
        let mut watched = plain.clone();
        watched.monitor = monitors(&dir.path().join(format!("{stage:?}")));
        let (a, b) = (train(&plain), train(&watched));
        assert!(
            bits(&a) == bits(&b),
            "monitors changed training at {stage:?}"
        );

        // The engine is gone, so its writer has flushed: one row per step, indexed by samples.
        let csv = dir.path().join(format!("{stage:?}")).join("csv");
        let loss = csv_rows(&csv.join("Train_Samples_train_loss.csv"));
        assert_eq!(loss[0], ["step", "train_loss"]);
        assert_eq!(loss.len(), STEPS + 1);
        for (i, row) in loss[1..].iter().enumerate() {
            let samples = (i + 1) * watched.train_batch_size;
            assert_eq!(row[0], samples.to_string());
            assert_eq!(row[1].parse::<f64>().unwrap(), b.losses[i]);
        }
        for name in ["lr", "grad_norm", "peak_device_parameters_bytes"] {
            let rows = csv_rows(&csv.join(format!("Train_Samples_{name}.csv")));
            assert_eq!(rows[0], ["step", name]);
            assert_eq!(rows.len(), STEPS + 1, "{name}");
        }
        // fp16 only, as in DeepSpeed.
        assert!(!csv.join("Train_Samples_loss_scale.csv").exists());
        let tb: Vec<_> = std::fs::read_dir(dir.path().join(format!("{stage:?}")).join("tb"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(tb.len(), 1);
        assert!(tb[0].starts_with("events.out.tfevents."), "{tb:?}");
    }
}

#[test]
fn only_rank_zero_writes_unless_all_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(ZeroStage::Stage2, 2, 1, 1, Precision::F32);
    cfg.monitor.csv_monitor = Some(MonitorOutput {
        dir: dir.path().join("one"),
        all_ranks: false,
    });
    cfg.monitor.tensorboard = Some(MonitorOutput {
        dir: dir.path().join("every"),
        all_ranks: true,
    });
    train(&cfg);
    assert!(dir.path().join("one/Train_Samples_lr.csv").exists());
    assert!(!dir.path().join("one/rank1").exists());
    for r in 0..2 {
        let d = dir.path().join(format!("every/rank{r}"));
        assert_eq!(std::fs::read_dir(&d).unwrap().count(), 1, "{}", d.display());
    }
}

#[test]
fn an_unwritable_monitor_directory_is_an_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let blocker = dir.path().join("file");
    std::fs::write(&blocker, b"x").unwrap();
    let mut cfg = config(ZeroStage::Stage0, 1, 1, 1, Precision::F32);
    cfg.monitor.csv_monitor = Some(MonitorOutput {
        dir: blocker.join("job"),
        all_ranks: false,
    });
    let err = run_ranks(1, Duration::from_secs(30), |comm| {
        Engine::new(toy::model(V, D, T, LAYERS), cfg.clone(), comm).map(|_| ())
    })
    .unwrap_err()
    .to_string();
    assert!(
        err.contains(&blocker.join("job").display().to_string()),
        "{err}"
    );
}
