//! `pin_memory = true` against a small `RLIMIT_MEMLOCK` (containers often have 64 KiB),
//! decided at `initialize`, before step 1, for what is mlocked (the NVMe optimizer's swap
//! buffers; optimizer state in host memory locks nothing against the limit): refused with the exact lines that fix it; continued with pageable buffers
//! when the config says `pin_memory_fallback = true`; and when only the soft limit is too
//! low, raised to the hard limit without bothering anyone. `train_gpt` runs under util-linux
//! `prlimit` (and, as root, `setpriv` dropping CAP_IPC_LOCK, which would lift the limit).

mod train_common;
use train_common::{run_output, train_gpt};

use std::path::{Path, PathBuf};
use std::process::Command;

fn tool(name: &str) -> Option<PathBuf> {
    ["/usr/bin", "/bin", "/usr/sbin", "/sbin"]
        .iter()
        .map(|d| Path::new(d).join(name))
        .find(|p| p.exists())
}

fn dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("fz-pinned-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Optimizer state on NVMe with `pin_memory`: the swap pool's host buffers are mlocked, the
/// only memory the engine locks that way (charged against RLIMIT_MEMLOCK).
fn config(fallback: bool) -> PathBuf {
    let dir = dir();
    let p = dir.join(format!("pinned_{fallback}.toml"));
    std::fs::write(
        &p,
        format!(
            "train_micro_batch_size_per_gpu = 4\n[bf16]\nenabled = true\n\
             [zero_optimization]\nstage = 2\n\
             [zero_optimization.offload_optimizer]\ndevice = \"nvme\"\npin_memory = true\n\
             nvme_path = \"{}\"\npin_memory_fallback = {fallback}\n\
             [optimizer]\ntype = \"AdamW\"\nparams = {{ lr = 1e-3 }}\n",
            dir.join(format!("swap_{fallback}")).display()
        ),
    )
    .unwrap();
    p
}

/// Optimizer state in host memory with `pin_memory`: ordinary host buffers (a GPU's driver
/// registers them, which is not charged against RLIMIT_MEMLOCK), nothing mlocked.
fn cpu_config() -> PathBuf {
    let p = dir().join("pinned_cpu.toml");
    std::fs::write(
        &p,
        "train_micro_batch_size_per_gpu = 4\n\
         [zero_optimization]\nstage = 2\n\
         [zero_optimization.offload_optimizer]\ndevice = \"cpu\"\npin_memory = true\n\
         [optimizer]\ntype = \"AdamW\"\nparams = { lr = 1e-3 }\n",
    )
    .unwrap();
    p
}

/// Runs train_gpt for one step under `memlock` (prlimit's SOFT:HARD); `None` without the tools.
fn run(memlock: &str, fallback: bool) -> Option<(bool, String)> {
    run_with(memlock, config(fallback))
}

fn run_with(memlock: &str, config: PathBuf) -> Option<(bool, String)> {
    let prlimit = tool("prlimit")?;
    let mut cmd = Command::new(prlimit);
    cmd.arg(format!("--memlock={memlock}"));
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        cmd.arg(tool("setpriv")?)
            .args(["--bounding-set=-ipc_lock", "--inh-caps=-ipc_lock"]);
    }
    let ran = run_output(
        cmd.arg(train_gpt())
            .args(["--config"])
            .arg(config)
            .args([
                "--ranks",
                "1",
                "--steps",
                "1",
                "--digits",
                "2",
                "--eval-rows",
                "8",
            ])
            .arg("--no-progress")
            .env("NO_COLOR", "1"),
    );
    Some(ran)
}

#[test]
fn a_limit_too_small_for_pinned_buffers_is_refused_with_the_fix() {
    let Some((ok, text)) = run("4096:4096", false) else {
        eprintln!("SKIPPED: util-linux prlimit/setpriv not found");
        return;
    };
    assert!(!ok, "ran despite a 4 KiB locked-memory limit:\n{text}");
    for want in [
        "locked memory: pin_memory = true needs",
        "RLIMIT_MEMLOCK is 4.0 KiB (4096 bytes) soft / 4.0 KiB (4096 bytes) hard",
        "ulimit -l ",
        "needs the hard limit raised first",
        " soft memlock ",
        " hard memlock ",
        "LimitMEMLOCK=",
        "--ulimit memlock=",
        "pin_memory_fallback = true",
    ] {
        assert!(text.contains(want), "missing {want:?} in:\n{text}");
    }
    // Refused before training started.
    assert!(!text.contains("trained 1 steps"), "{text}");
}

#[test]
fn the_config_can_allow_falling_back_to_pageable_buffers() {
    let Some((ok, text)) = run("4096:4096", true) else {
        eprintln!("SKIPPED: util-linux prlimit/setpriv not found");
        return;
    };
    assert!(ok, "{text}");
    assert!(
        text.contains("pin_memory_fallback = true: continuing with pageable buffers"),
        "{text}"
    );
    assert!(text.contains("trained 1 steps"), "{text}");
}

/// Nothing is mlocked for optimizer state in host memory: a 4 KiB limit does not stop it.
#[test]
fn host_offload_locks_nothing_against_the_limit() {
    let Some((ok, text)) = run_with("4096:4096", cpu_config()) else {
        eprintln!("SKIPPED: util-linux prlimit/setpriv not found");
        return;
    };
    assert!(ok, "{text}");
    assert!(!text.contains("locked memory"), "{text}");
    assert!(text.contains("trained 1 steps"), "{text}");
}

/// This process's hard `RLIMIT_MEMLOCK` as prlimit writes it (a child may lower it, or keep
/// it, but raising it needs CAP_SYS_RESOURCE, which containers often drop).
fn hard_memlock() -> String {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit struct that we own.
    assert_eq!(
        unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) },
        0
    );
    if lim.rlim_max == libc::RLIM_INFINITY {
        "unlimited".into()
    } else {
        lim.rlim_max.to_string()
    }
}

#[test]
fn a_soft_limit_below_the_hard_one_is_raised() {
    let hard = hard_memlock();
    let Some((ok, text)) = run(&format!("4096:{hard}"), false) else {
        eprintln!("SKIPPED: util-linux prlimit/setpriv not found");
        return;
    };
    if !ok && text.contains("needs the hard limit raised first") {
        // The machine's hard limit itself is too small for the pinned buffers: the refusal
        // is the right outcome, and the first test covers it.
        eprintln!("SKIPPED: the hard RLIMIT_MEMLOCK ({hard}) cannot hold the pinned buffers");
        return;
    }
    assert!(ok, "{text}");
    let want = if hard == "unlimited" {
        "raised the soft RLIMIT_MEMLOCK from 4096 bytes to unlimited".to_string()
    } else {
        format!("raised the soft RLIMIT_MEMLOCK from 4096 bytes to {hard} bytes")
    };
    assert!(text.contains(&want), "missing {want:?} in:\n{text}");
    assert!(text.contains("trained 1 steps"), "{text}");
}
