//! "A training step on a device waits for it once", as a test of the text: the CUDA
//! operation families a step runs never copy synchronously or wait for the device. Small
//! uploads go through the device's asynchronous ring (`upload_async`) and the step's values
//! come back in one download (`backend/cuda/status.rs`); `device_step_syncs.rs` counts the
//! syncs of real steps. A new wait in these files fails here with its path and line, unless
//! listed in [`ALLOWED`] with its reason.

use std::path::Path;

/// The files of the operations a training step launches.
const FAMILIES: &[&str] = &[
    "attention.rs",
    "elementwise.rs",
    "lamb.rs",
    "matmul.rs",
    "norm/mod.rs",
    "norm/launch.rs",
    "optim.rs",
    "rope.rs",
    "token.rs",
];

/// Calls that make the host wait for the device.
const WAITS: &[&str] = &[
    "copy_from_host(",
    "copy_to_host(",
    "copy_htod(",
    "copy_dtoh(",
    ".download(",
    "to_host(",
    "to_vec_f32(",
    "synchronize(",
];

/// (file, text the line contains, why it may wait).
const ALLOWED: &[(&str, &str, &str)] = &[
    (
        "token.rs",
        "out.copy_to_host(bytemuck::cast_slice_mut(&mut host), STREAM)?;",
        "argmax_rows returns the chosen ids to the host: generation, not a training step",
    ),
    (
        "lamb.rs",
        "out.as_view().download(BufMut::F32(&mut host))?;",
        "LAMB's first pass returns each run's partial norms to the host, which combines a \
         tensor's runs across ranks before the second pass: one wait per run, LAMB's price",
    ),
];

#[test]
fn step_operations_never_wait_for_the_device() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/backend/cuda");
    let mut found = Vec::new();
    for f in FAMILIES {
        let text = std::fs::read_to_string(dir.join(f)).expect("the family's file reads");
        for (i, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or_default();
            let allowed = ALLOWED.iter().any(|(af, t, _)| af == f && line.contains(t));
            if let Some(w) = WAITS.iter().find(|w| code.contains(*w)) {
                if !allowed {
                    found.push(format!(
                        "backend/cuda/{f}:{}: {w} in `{}`",
                        i + 1,
                        line.trim()
                    ));
                }
            }
        }
    }
    assert!(
        found.is_empty(),
        "a step's operation waits for the device (use `upload_async`, or read the value \
         through `OptimizerOps::step_status`):\n{}",
        found.join("\n")
    );
}

#[test]
fn every_allowance_still_matches_a_line() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/backend/cuda");
    for (f, t, why) in ALLOWED {
        let text = std::fs::read_to_string(dir.join(f)).expect("the family's file reads");
        assert!(
            text.contains(t),
            "backend/cuda/{f} no longer has `{t}` ({why}): drop the allowance"
        );
    }
}
