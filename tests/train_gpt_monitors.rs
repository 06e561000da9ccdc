//! A DeepSpeed config with `tensorboard`, `csv_monitor` and `comms_logger` enabled runs
//! through the main job unchanged and produces all three: an event file and the CSV files
//! under `output_path/job_name`, one row per step, and DeepSpeed's communication summary.

mod train_common;
use train_common::{run_output, train_gpt};

use std::process::Command;

#[test]
fn train_gpt_writes_tensorboard_csv_and_the_comms_summary() {
    let dir = std::env::temp_dir().join(format!("fz-monitors-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let d = dir.display().to_string();
    let config = serde_json::json!({
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 2,
        "zero_optimization": {"stage": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
        "tensorboard": {"enabled": true, "output_path": format!("{d}/tb"), "job_name": "gpt"},
        "csv_monitor": {"enabled": true, "output_path": format!("{d}/csv"), "job_name": "gpt"},
        "comms_logger": {"enabled": true}
    });
    let path = dir.join("ds_config.json");
    std::fs::write(&path, serde_json::to_string_pretty(&config).unwrap()).unwrap();
    let (ok, text) = run_output(
        Command::new(train_gpt())
            .args(["--config", path.to_str().unwrap()])
            .args([
                "--steps",
                "4",
                "--digits",
                "2",
                "--eval-rows",
                "16",
                "--no-progress",
            ])
            .args(["--ranks", "2", "--device", "cpu"])
            .current_dir(env!("CARGO_MANIFEST_DIR")),
    );
    assert!(ok, "{text}");
    assert!(!text.contains("not supported"), "{text}");

    let events: Vec<_> = std::fs::read_dir(dir.join("tb/gpt"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert!(
        events.len() == 1 && events[0].starts_with("events.out.tfevents."),
        "{events:?}"
    );
    let loss = std::fs::read_to_string(dir.join("csv/gpt/Train_Samples_train_loss.csv")).unwrap();
    let rows: Vec<&str> = loss.lines().collect();
    assert_eq!(rows.len(), 5, "{loss}");
    assert_eq!(rows[0], "step,train_loss");
    // Indexed by samples: 4 per rank per step, 2 ranks.
    assert!(rows[4].starts_with("32,"), "{loss}");

    // The summary every steps_per_print steps and at the end, with DeepSpeed's columns.
    assert!(text.matches("Comm. Op").count() >= 3, "{text}");
    for col in [
        "Message Size",
        "Count",
        "Total Latency(ms)",
        "busbw_avg (Gbps)",
    ] {
        assert!(text.contains(col), "{text}");
    }
    assert!(text.contains("all_gather_into_tensor"), "{text}");
    assert!(text.contains("reduce_scatter_tensor"), "{text}");
    std::fs::remove_dir_all(&dir).ok();
}

/// Ctrl-C mid-run: the writer flushes what it holds, then the signal ends the process as it
/// would have; the CSV files hold every step written so far, each row whole.
#[test]
fn ctrl_c_flushes_the_monitor_files_before_the_process_ends() {
    use std::os::unix::process::ExitStatusExt;
    let dir = std::env::temp_dir().join(format!("fz-monitors-int-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = serde_json::json!({
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": 1_000_000,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
        "csv_monitor": {"enabled": true, "output_path": dir.display().to_string(), "job_name": "j"}
    });
    let path = dir.join("ds_config.json");
    std::fs::write(&path, config.to_string()).unwrap();
    let mut child = Command::new(train_gpt())
        .args(["--config", path.to_str().unwrap()])
        .args(["--steps", "1000000", "--digits", "2", "--no-progress"])
        .args(["--ranks", "1", "--device", "cpu"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let csv = dir.join("j/Train_Samples_train_loss.csv");
    let start = std::time::Instant::now();
    while !csv.exists() && start.elapsed() < std::time::Duration::from_secs(120) {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(csv.exists(), "no step was written within two minutes");
    std::thread::sleep(std::time::Duration::from_millis(500));
    // Nothing is flushed before steps_per_print (short of a full 8 KiB buffer): the rows
    // must come from the flush the signal triggers.
    let pid = i32::try_from(child.id()).unwrap();
    // SAFETY: plain syscall on our own child, not yet reaped.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGINT) }, 0);
    let status = child.wait().unwrap();
    assert_eq!(status.signal(), Some(libc::SIGINT), "{status:?}");
    let text = std::fs::read_to_string(&csv).unwrap();
    let rows: Vec<&str> = text.lines().collect();
    assert_eq!(rows[0], "step,train_loss");
    assert!(rows.len() >= 2, "{text}");
    assert!(text.ends_with('\n'), "a row was cut: {text:?}");
    for (i, r) in rows[1..].iter().enumerate() {
        assert!(r.starts_with(&format!("{},", (i + 1) * 4)), "{text}");
    }
    std::fs::remove_dir_all(&dir).ok();
}
