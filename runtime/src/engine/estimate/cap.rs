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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::estimate::{estimate, shape::preset};
    use ferrozero_config::Device;

    /// The run on a 20 GB cap: Llama 7B, bf16, stage 3, AdamW on the CPU (and the
    /// gradient accumulator with it), checkpointing, 4096 tokens (about 17.4 GB on a GPU,
    /// 22.3 GB priced as the CPU).
    fn offload_7b(device: Device) -> ResolvedConfig {
        let src = "device_memory_limit = \"20GB\"\ntrain_micro_batch_size_per_gpu = 1\n\
                   [bf16]\nenabled = true\n\
                   [optimizer]\ntype = \"AdamW\"\nparams.lr = 1e-4\n\
                   [activation_checkpointing]\ncpu_checkpointing = false\n\
                   [zero_optimization]\nstage = 3\n\
                   [zero_optimization.offload_optimizer]\ndevice = \"cpu\"\n";
        let mut cfg = crate::engine::test_config(src, Some(4096));
        cfg.device = device;
        cfg
    }

    /// Priced with the CPU's figures (T x T probabilities, f32 activations and working copies)
    /// the 7B run is refused at a 20 GB cap; with the GPU's own figures, which the GPU run
    /// will have, it fits.
    #[test]
    fn the_cap_check_prices_a_gpu_run_with_the_gpus_figures() {
        let m = preset("llama-7b").unwrap().model;
        let seq = 4096;
        let gpu = offload_7b(Device::Cuda(None));
        let e = estimate(&m, &gpu, 1, seq).unwrap();
        assert!(
            e.device.peak_bytes < 20_000_000_000,
            "{}",
            e.device.peak_bytes
        );
        check_device_cap(&m, &gpu, seq, &e).unwrap();
        let cpu = offload_7b(Device::Cpu);
        let e = estimate(&m, &cpu, 1, seq).unwrap();
        match check_device_cap(&m, &cpu, seq, &e) {
            Err(Error::DeviceMemory { detail, .. }) => {
                assert!(detail.contains("device_memory_limit"), "{detail}")
            }
            other => panic!("CPU figures should refuse: {other:?}"),
        }
    }
}
