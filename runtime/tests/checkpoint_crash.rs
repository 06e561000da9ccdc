//! Crash consistency: a child process trains and saves checkpoints in a loop (resuming from
//! `latest` each time it starts) and is killed with SIGKILL at random moments. After every
//! kill, `latest` must name a checkpoint that verifies and loads, and it never goes back.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{config, toy};
use ferrozero_config::resolved::{Precision, ZeroStage};
use ferrozero_runtime::comm::local::run_ranks;
use ferrozero_runtime::engine::checkpoint::{CheckpointReader, Tag};
use ferrozero_runtime::engine::Engine;

const V: usize = 11;
const SEQ: usize = 4;
const ENV: &str = "FERROZERO_CKPT_CRASH_DIR";
const READY: &str = "FERROZERO_CKPT_CRASH_READY";
const TRIALS: usize = 60;

fn new_engine(comm: Box<dyn ferrozero_runtime::comm::Communicator>) -> Engine {
    let cfg = config(ZeroStage::Stage3, 2, 1, 1, Precision::Bf16);
    Engine::new(toy::model(V, 16, SEQ, 2), cfg, comm).unwrap()
}

/// The child's work: resume if possible, then train and save forever. Without the
/// environment variable (a normal test run) it has nothing to do.
#[test]
fn crash_child_saves_forever() {
    let Some(dir) = std::env::var_os(ENV) else {
        return;
    };
    let dir = Path::new(&dir);
    run_ranks::<(), _>(2, Duration::from_secs(600), |comm| {
        let rank = comm.rank();
        let mut e = new_engine(comm);
        if dir.join("latest").exists() {
            e.load_checkpoint(dir, &Tag::Latest)?;
        }
        if rank == 0 {
            if let Some(ready) = std::env::var_os(READY) {
                std::fs::write(ready, b"1").unwrap();
            }
        }
        loop {
            let s = e.global_steps() as usize;
            e.train_batch(&[toy::batch(V, SEQ, 2 * s + rank, 1)])?;
            e.save_checkpoint(dir, &format!("step-{}", e.global_steps()), s as u64 + 1)?;
        }
    })
    .unwrap();
}

/// Verifies and loads `latest`; returns its step (None when nothing was published yet).
fn check_latest(dir: &Path) -> Option<u64> {
    if !dir.join("latest").exists() {
        return None;
    }
    let r = CheckpointReader::open(dir, &Tag::Latest).expect("latest opens");
    r.verify_all().expect("latest verifies");
    let step = r.meta().step;
    let loaded = run_ranks(2, Duration::from_secs(30), |comm| {
        let mut e = new_engine(comm);
        let l = e.load_checkpoint(dir, &Tag::Latest)?;
        Ok((l.step, e.global_steps()))
    })
    .expect("latest loads");
    assert!(loaded.iter().all(|&l| l == (step, step)));
    Some(step)
}

#[test]
fn kill_9_at_random_points_never_breaks_latest() {
    let dir = tempfile::tempdir().unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut rng = fastrand::Rng::with_seed(7);
    let ready = tempfile::tempdir().unwrap();
    let ready = ready.path().join("ready");
    let (mut last, mut published, mut mid_save) = (0u64, 0usize, 0usize);
    let t0 = Instant::now();
    for trial in 0..TRIALS {
        let _ = std::fs::remove_file(&ready);
        let mut child = Command::new(&exe)
            .args(["crash_child_saves_forever", "--exact", "--test-threads=1"])
            .env(ENV, dir.path())
            .env(READY, &ready)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        // Kill inside the train-and-save loop, not during process start-up.
        let wait = Instant::now();
        while !ready.exists() && wait.elapsed() < Duration::from_secs(30) {
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(Duration::from_micros(rng.u64(0..150_000)));
        child.kill().unwrap();
        child.wait().unwrap();
        mid_save += usize::from(has_temp_dir(dir.path()));
        if let Some(step) = check_latest(dir.path()) {
            assert!(
                step >= last,
                "trial {trial}: latest went back from {last} to {step}"
            );
            last = step;
            published += 1;
        }
    }
    // Enough trials ran with a published checkpoint for the assertion above to mean something.
    assert!(
        published >= TRIALS / 2,
        "only {published} trials had a checkpoint"
    );
    assert!(last > 0);
    assert!(mid_save > 0, "no kill landed inside a save");
    eprintln!(
        "{TRIALS} kills in {:?} ({mid_save} inside a save); latest reached step {last}",
        t0.elapsed()
    );
}

/// Whether a save was interrupted: its temporary directory is still there.
/// At most one can exist: each save clears those of crashed ones.
fn has_temp_dir(dir: &Path) -> bool {
    let temps = std::fs::read_dir(dir)
        .unwrap()
        .filter(|e| {
            let name = e.as_ref().unwrap().file_name();
            name.to_string_lossy().starts_with(".tmp-")
        })
        .count();
    assert!(temps <= 1, "{temps} temporary directories left behind");
    temps == 1
}
