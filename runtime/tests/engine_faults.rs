//! Swap faults during training: a flipped byte or a truncated swap file (parameter shards or
//! optimizer state on NVMe) and a full swap disk each stop training with an error naming the
//! file, never garbage or a panic, and the last checkpoint stays loadable: a fresh engine
//! resumes from it and trains exactly as if nothing had happened.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::scratch::Scratch;
use common::{config, toy};
use ferrozero_config::resolved::{OffloadTarget, Precision, ResolvedConfig, ZeroStage};
use ferrozero_runtime::engine::checkpoint::Tag;
use ferrozero_runtime::engine::Engine;

const V: usize = 11;

/// Stage 3, bf16, parameters and optimizer state on NVMe under `swap`.
fn nvme_config(swap: &Path) -> ResolvedConfig {
    let mut cfg = config(ZeroStage::Stage3, 1, 2, 1, Precision::Bf16);
    cfg.zero.offload_param.target = OffloadTarget::Nvme(swap.to_path_buf());
    cfg.zero.offload_optimizer.target = OffloadTarget::Nvme(swap.to_path_buf());
    cfg
}

fn engine(cfg: &ResolvedConfig) -> ferrozero_runtime::Result<Engine> {
    let comm =
        ferrozero_runtime::comm::local::LocalComm::group(1, Duration::from_secs(30)).remove(0);
    Engine::new(toy::model(V, 6, 5, 2), cfg.clone(), Box::new(comm))
}

fn step(e: &mut Engine, s: usize) -> ferrozero_runtime::Result<()> {
    e.train_batch(&[toy::batch(V, 5, s * 2, 2)]).map(|_| ())
}

fn bits(e: &Engine) -> Vec<u32> {
    let p = e.parameters().unwrap();
    p.iter()
        .flat_map(|t| t.data.iter().map(|x| x.to_bits()))
        .collect()
}

/// The parameters after 4 steps without any fault (in memory).
fn reference() -> Vec<u32> {
    let mut e = engine(&config(ZeroStage::Stage3, 1, 2, 1, Precision::Bf16)).unwrap();
    (0..4).for_each(|s| step(&mut e, s).unwrap());
    bits(&e)
}

/// Trains 2 steps and checkpoints, damages a swap file, checks the next step fails naming
/// it, then resumes from the checkpoint in a fresh engine and finishes 4 steps.
fn fault_then_resume(target: &str, damage: impl Fn(&Path), expect: &str) {
    let root = Scratch::new();
    let (swap, ckpt) = (root.dir(), root.dir());
    let cfg = nvme_config(&swap);
    let mut e = engine(&cfg).unwrap();
    (0..2).for_each(|s| step(&mut e, s).unwrap());
    e.save_checkpoint(&ckpt, "good", 2).unwrap();
    let file = find_swap_file(&swap, target);
    damage(&file);
    let err = step(&mut e, 2).expect_err("training went on over a damaged swap file");
    let msg = err.to_string();
    eprintln!("{target}: {msg}");
    let name = file.file_name().unwrap().to_str().unwrap();
    assert!(
        msg.contains(name) && msg.contains(expect),
        "{target}: error should name {name} and say {expect:?}: {msg}"
    );
    drop(e);
    let mut fresh = engine(&nvme_config(&root.dir())).unwrap();
    let l = fresh.load_checkpoint(&ckpt, &Tag::Latest).unwrap();
    assert_eq!((l.step, l.data_position), (2, 2));
    (2..4).for_each(|s| step(&mut fresh, s).unwrap());
    assert!(bits(&fresh) == reference(), "{target}: resumed run differs");
    let _ = std::fs::remove_dir_all(&ckpt);
}

/// The swap file of tensor `key` (`t-<key>.swp`) anywhere under `dir`.
fn find_swap_file(dir: &Path, key: &str) -> PathBuf {
    let want = format!("t-{key}.swp");
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap().flatten() {
            let p = entry.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.file_name().is_some_and(|n| n == want.as_str()) {
                return p;
            }
        }
    }
    panic!("no swap file {want} under {}", dir.display());
}

fn flip_byte(path: &Path) {
    let mut b = std::fs::read(path).unwrap();
    b[7] ^= 0x40;
    std::fs::write(path, b).unwrap();
}

fn truncate(path: &Path) {
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.set_len(100).unwrap();
}

#[test]
fn a_flipped_byte_in_a_parameter_shard_stops_training_and_the_checkpoint_resumes() {
    fault_then_resume("p0", flip_byte, "checksum");
}

#[test]
fn a_truncated_optimizer_state_file_stops_training_and_the_checkpoint_resumes() {
    fault_then_resume("g1.0", truncate, "short read");
}

#[test]
fn a_full_swap_disk_is_refused_at_start_naming_the_file_and_the_checkpoint_resumes() {
    let Some(fs) = SmallFs::mount() else {
        eprintln!("SKIPPED: cannot mount a small tmpfs here (needs root)");
        return;
    };
    let root = Scratch::new();
    let ckpt = root.dir();
    let mut good = engine(&config(ZeroStage::Stage3, 1, 2, 1, Precision::Bf16)).unwrap();
    (0..2).for_each(|s| step(&mut good, s).unwrap());
    good.save_checkpoint(&ckpt, "good", 2).unwrap();
    // Fill the disk, leaving less than one block for the swap files.
    let _ = std::fs::write(fs.0.join("junk"), vec![1u8; 1 << 20]);
    let err = match engine(&nvme_config(&fs.0.join("swap"))) {
        Ok(_) => panic!("an engine was built on a full disk"),
        Err(e) => e.to_string(),
    };
    eprintln!("full disk: {err}");
    assert!(
        err.contains(".swp") && err.contains("No space left"),
        "the error should name the swap file and ENOSPC: {err}"
    );
    let mut fresh = engine(&nvme_config(&root.dir())).unwrap();
    fresh.load_checkpoint(&ckpt, &Tag::Latest).unwrap();
    (2..4).for_each(|s| step(&mut fresh, s).unwrap());
    assert!(bits(&fresh) == reference(), "resumed run differs");
    let _ = std::fs::remove_dir_all(&ckpt);
}

/// A 1 MiB tmpfs, unmounted on drop.
struct SmallFs(PathBuf);

impl SmallFs {
    fn mount() -> Option<SmallFs> {
        let dir = std::env::temp_dir().join(format!("fz-faults-tmpfs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).ok()?;
        let c = |s: &str| std::ffi::CString::new(s).unwrap();
        let target = c(dir.to_str()?);
        // SAFETY: valid C strings; mount has no other preconditions.
        let rc = unsafe {
            libc::mount(
                c("tmpfs").as_ptr(),
                target.as_ptr(),
                c("tmpfs").as_ptr(),
                0,
                c("size=1m").as_ptr().cast(),
            )
        };
        (rc == 0).then_some(SmallFs(dir))
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let target = std::ffi::CString::new(self.0.to_str().unwrap()).unwrap();
        // SAFETY: unmounting what we mounted.
        unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn a_save_over_a_damaged_swap_file_fails_and_latest_still_points_at_the_good_checkpoint() {
    let root = Scratch::new();
    let (swap, ckpt) = (root.dir(), root.dir());
    let mut e = engine(&nvme_config(&swap)).unwrap();
    (0..2).for_each(|s| step(&mut e, s).unwrap());
    e.save_checkpoint(&ckpt, "good", 2).unwrap();
    flip_byte(&find_swap_file(&swap, "g2.0"));
    let err = e
        .save_checkpoint(&ckpt, "bad", 2)
        .expect_err("saved a checkpoint from a corrupt swap file")
        .to_string();
    assert!(
        err.contains("t-g2.0.swp") && err.contains("checksum"),
        "{err}"
    );
    assert_eq!(
        std::fs::read_to_string(ckpt.join("latest")).unwrap(),
        "good"
    );
    assert!(!ckpt.join("bad").exists(), "a failed save was published");
    drop(e);
    let mut fresh = engine(&nvme_config(&root.dir())).unwrap();
    fresh.load_checkpoint(&ckpt, &Tag::Latest).unwrap();
    (2..4).for_each(|s| step(&mut fresh, s).unwrap());
    assert!(bits(&fresh) == reference(), "resumed run differs");
    let _ = std::fs::remove_dir_all(&ckpt);
}
