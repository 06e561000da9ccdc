//! `device_memory_limit` at `initialize`: a run whose estimated device peak exceeds the cap is
//! refused before anything is allocated, with the estimator's figures and the cheapest change
//! that fits, so a run that cannot fit fails at start and not at step 300.

use ferrozero_config::resolved::ResolvedConfig;

use super::{suggest, Budget, Estimate};
use crate::nn::Model;
use crate::{Error, Result};

/// Refuses `e` (the estimate for `cfg`) when its device peak exceeds the config's cap.
pub fn check_device_cap(
    model: &Model,
    cfg: &ResolvedConfig,
    seq: usize,
    e: &Estimate,
) -> Result<()> {
    let Some(limit) = cfg.device_memory_limit else {
        return Ok(());
    };
    if e.device.peak_bytes <= limit {
        return Ok(());
    }
    let mib = |b: u64| b as f64 / 1048576.0;
    let parts: Vec<String> = e
        .device
        .by_category
        .iter()
        .filter(|(_, b)| *b > 0)
        .map(|(c, b)| format!("{c:?} {:.1} MiB", mib(*b)))
        .collect();
    let mut detail = format!(
        "the estimator puts this rank's device peak at {:.1} MiB (category peaks: {}) for \
         micro-batch {} x {} tokens, over device_memory_limit ({:.1} MiB)",
        mib(e.device.peak_bytes),
        parts.join(", "),
        e.micro_batch,
        seq,
        mib(limit)
    );
    // Only the device is capped here; the host is the offload pre-flight's business.
    let budget = Budget {
        device_bytes: limit,
        host_bytes: u64::MAX,
    };
    match suggest(model, cfg, e.micro_batch, seq, budget) {
        Some(s) => {
            let changes: Vec<String> = s.changes.iter().map(|c| c.to_string()).collect();
            detail.push_str(&format!("; it fits if you {}", changes.join(", then ")));
        }
        None => detail.push_str("; no change of stage, offload, checkpointing or micro-batch fits"),
    }
    Err(Error::DeviceMemory {
        requested: e.device.peak_bytes,
        live: 0,
        peak: e.device.peak_bytes,
        limit,
        detail,
    })
}
