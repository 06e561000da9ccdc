//! Measurement helpers behind `ferrozero bench adam` and `ferrozero bench swap`, kept here so
//! the CLI stays a thin argument parser and the timed code is the crate's own.

use std::time::Instant;

use half::bf16;

use crate::huge::filled_vec;
use crate::optim::{self, AdamHyper, LowPrecision, WeightDecay};
use crate::{Error, Result};

/// Untimed steps before measuring (page faults, frequency ramp).
const WARMUP: u64 = 3;

/// Which parameter copy the Adam benchmark writes besides the f32 master.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdamDtype {
    /// f32 master only: 28 bytes per parameter moved (read p, g, m, v; write p, m, v).
    F32,
    /// f32 master plus a fused bf16 copy: 30 bytes per parameter.
    Bf16,
}

/// One Adam benchmark result.
#[derive(Debug, Clone, PartialEq)]
pub struct AdamBench {
    /// Parameters per step.
    pub params: usize,
    /// Rayon threads.
    pub threads: usize,
    /// Timed steps.
    pub steps: u32,
    /// Median step's throughput (parameters per second), comparable with the baselines'.
    pub params_per_s: f64,
    /// Best step's throughput.
    pub best_params_per_s: f64,
    /// Bytes moved per parameter, for the roofline comparison.
    pub bytes_per_param: u32,
}

/// Times `steps` AdamW steps (after three warm-up steps, as the baselines do) over `params` parameters on a pool of
/// `threads` threads.
pub fn adam(params: usize, threads: usize, dtype: AdamDtype, steps: u32) -> Result<AdamBench> {
    if params == 0 || threads == 0 || steps == 0 {
        return Err(Error::Invalid {
            op: "bench adam",
            detail: format!(
                "params ({params}), threads ({threads}) and steps ({steps}) must be positive"
            ),
        });
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .map_err(|e| Error::Resource(format!("cannot start {threads} threads: {e}")))?;
    let hp = AdamHyper {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
        decay: WeightDecay::Decoupled,
        bias_correction: true,
    };
    // Allocated as the engine allocates its state (`FlatBuf::zeros`: huge pages advised).
    let filled = |f: &dyn Fn(usize) -> f32| {
        let mut b = filled_vec(params, 0.0f32);
        b.iter_mut().enumerate().for_each(|(i, x)| *x = f(i));
        b
    };
    let mut p = filled(&|i| (i % 1000) as f32 * 1e-3 - 0.5);
    let g = filled(&|i| (i % 997) as f32 * 1e-4 - 0.05);
    let (mut m, mut v) = (filled_vec(params, 0.0f32), filled_vec(params, 0.0f32));
    let mut lp = match dtype {
        AdamDtype::F32 => Vec::new(),
        AdamDtype::Bf16 => filled_vec(params, bf16::ZERO),
    };
    let mut times = Vec::with_capacity(steps as usize);
    pool.install(|| -> Result<()> {
        for step in 0..u64::from(steps) + WARMUP {
            let out = match dtype {
                AdamDtype::F32 => LowPrecision::None,
                AdamDtype::Bf16 => LowPrecision::Bf16(&mut lp),
            };
            let t0 = Instant::now();
            optim::adam_step(&hp, step + 1, 1.0, &mut p, &g, &mut m, &mut v, out)?;
            if step >= WARMUP {
                times.push(t0.elapsed().as_secs_f64());
            }
        }
        Ok(())
    })?;
    times.sort_by(f64::total_cmp);
    let rate = |t: f64| params as f64 / t;
    Ok(AdamBench {
        params,
        threads,
        steps,
        params_per_s: rate(times[times.len() / 2]),
        best_params_per_s: rate(times[0]),
        bytes_per_param: match dtype {
            AdamDtype::F32 => 28,
            AdamDtype::Bf16 => 30,
        },
    })
}

/// Direction of a swap benchmark result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SwapOp {
    /// Memory to file.
    Write,
    /// File to memory (checksums verified).
    Read,
}

impl SwapOp {
    /// `read` or `write`.
    pub fn name(self) -> &'static str {
        match self {
            SwapOp::Write => "write",
            SwapOp::Read => "read",
        }
    }
}

/// One swap benchmark result.
#[derive(Debug, Clone, PartialEq)]
pub struct SwapBench {
    /// Direction.
    pub op: SwapOp,
    /// Bytes per operation.
    pub bytes: usize,
    /// Median over the loops, in GB/s (10^9 bytes per second).
    pub gbps: f64,
    /// Best loop, in GB/s.
    pub best_gbps: f64,
    /// The untimed warm-up round, in GB/s (for writes: a first write to new blocks).
    pub warmup_gbps: f64,
    /// The engine that ran.
    pub engine: crate::store::Engine,
    /// Whether the I/O bypassed the page cache.
    pub direct: bool,
}

/// Writes then reads one tensor of `bytes` bytes `loops` times through an [`NvmeStore`] in a
/// scratch directory under `path` (removed afterwards), from page-aligned host memory.
///
/// An untimed warm-up round comes first (reported as `warmup_gbps`): it lays the file out, as
/// fio does before it measures, and faults the buffers in. So the timed writes are
/// overwrites, the steady state of a training run that rewrites its optimizer state every
/// step, and a first write's block allocation shows only in the warm-up figure.
///
/// [`NvmeStore`]: crate::store::NvmeStore
pub fn swap(
    path: &std::path::Path,
    bytes: usize,
    settings: &crate::store::AioSettings,
    loops: u32,
) -> Result<Vec<SwapBench>> {
    use crate::pool::{HostBuffer, Pinning};
    if bytes == 0 || loops == 0 {
        return Err(Error::Invalid {
            op: "bench swap",
            detail: format!("bytes ({bytes}) and loops ({loops}) must be positive"),
        });
    }
    let dir = path.join(format!("ferrozero-bench-swap-{}", std::process::id()));
    let store = crate::store::NvmeStore::open(&dir, settings)?;
    let mut src = HostBuffer::new(bytes, Pinning::Pageable)?;
    for (i, b) in src.iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(131) ^ (i >> 12) as u8;
    }
    let mut dst = HostBuffer::new(bytes, Pinning::Pageable)?;
    let (mut w, mut r) = (Vec::new(), Vec::new());
    for _ in 0..=loops {
        let t0 = Instant::now();
        store.write("bench", &src[..bytes])?;
        w.push(bytes as f64 / t0.elapsed().as_secs_f64() / 1e9);
        let t0 = Instant::now();
        store.read("bench", &mut dst[..bytes])?;
        r.push(bytes as f64 / t0.elapsed().as_secs_f64() / 1e9);
    }
    if src[..bytes] != dst[..bytes] {
        return Err(Error::Resource(
            "bench swap read back different bytes".into(),
        ));
    }
    let result = |op, mut v: Vec<f64>| {
        let warmup_gbps = v.remove(0);
        v.sort_by(f64::total_cmp);
        SwapBench {
            op,
            bytes,
            gbps: v[v.len() / 2],
            best_gbps: v[v.len() - 1],
            warmup_gbps,
            engine: store.engine(),
            direct: store.is_direct(),
        }
    };
    let out = vec![result(SwapOp::Write, w), result(SwapOp::Read, r)];
    drop(store);
    let _ = std::fs::remove_dir(&dir);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{AioSettings, EngineChoice};

    #[test]
    fn adam_bench_measures_and_refuses_nonsense() {
        let r = adam(100_000, 2, AdamDtype::Bf16, 2).unwrap();
        assert_eq!((r.params, r.threads, r.bytes_per_param), (100_000, 2, 30));
        assert!(r.params_per_s > 0.0 && r.best_params_per_s >= r.params_per_s);
        assert!(adam(0, 1, AdamDtype::F32, 1).is_err());
        assert!(adam(10, 0, AdamDtype::F32, 1).is_err());
    }

    #[test]
    fn swap_bench_reports_both_directions_and_cleans_up() {
        let tmp = tempfile::tempdir().unwrap();
        let s = AioSettings {
            block_size: 64 << 10,
            engine: EngineChoice::Threads,
            ..AioSettings::default()
        };
        let r = swap(tmp.path(), 1 << 20, &s, 2).unwrap();
        assert_eq!(r.len(), 2);
        assert_eq!((r[0].op, r[1].op), (SwapOp::Write, SwapOp::Read));
        assert!(r.iter().all(|x| x.gbps > 0.0
            && x.best_gbps >= x.gbps
            && x.warmup_gbps > 0.0
            && x.engine.name() == "threads"));
        assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0);
        assert!(swap(tmp.path(), 0, &s, 1).is_err());
    }
}
