//! DeepSpeed's communication logger (`comms_logger`) as a decorator over any
//! [`Communicator`]: every collective is timed and recorded by kind and message size (count,
//! bytes, latency, algorithm and bus bandwidth), and [`CommStats::summary`] renders
//! DeepSpeed's summary table (`deepspeed/utils/comms_logging.py`).
//!
//! Message sizes follow DeepSpeed's: the buffer of an all-reduce or broadcast, the per-rank
//! input of an all-gather, nothing for a barrier. For a reduce-scatter it is the per-rank
//! output (DeepSpeed records the whole input, then multiplies by the world size again in its
//! bandwidth formula); with the per-rank size its formula gives nccl-tests' bandwidths for
//! both all-gather and reduce-scatter.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use ferrozero_config::resolved::CommsLoggerConfig;

use super::{BufMut, BufRef, CommBackend, Communicator, ReduceOp};
use crate::tensor::{View, ViewMut};
use crate::Result;

/// One (record, message size) row's raw measurements.
#[derive(Debug, Clone, Default)]
struct Row {
    latencies_ms: Vec<f64>,
    algbw: Vec<f64>,
    busbw: Vec<f64>,
}

/// One row of the summary: a collective kind at one message size.
#[derive(Debug, Clone, PartialEq)]
pub struct OpSummary {
    /// DeepSpeed's name of the collective (with the caller under `debug`).
    pub op: String,
    /// Bytes per call (see the module documentation).
    pub msg_size: u64,
    /// Calls.
    pub count: u64,
    /// `count * msg_size`.
    pub bytes: u64,
    /// Sum of the calls' latencies, in milliseconds.
    pub total_ms: f64,
    /// Mean latency with 10% trimmed from each end, in milliseconds.
    pub avg_ms: f64,
    /// Trimmed mean algorithm bandwidth, in Gbps.
    pub algbw_gbps: f64,
    /// Trimmed mean bus bandwidth, in Gbps.
    pub busbw_gbps: f64,
}

/// What the logger recorded, shared by a communicator and every one duplicated or split from
/// it (the engine's communication worker and hybrid-sharding groups count too).
#[derive(Debug)]
pub struct CommStats {
    cfg: CommsLoggerConfig,
    rank: usize,
    /// Record names in first-seen order (DeepSpeed prints them so), each by message size.
    rows: Mutex<Vec<(String, BTreeMap<u64, Row>)>>,
}

impl CommStats {
    /// Empty statistics for this rank.
    pub fn new(cfg: CommsLoggerConfig, rank: usize) -> Self {
        CommStats {
            cfg,
            rank,
            rows: Mutex::new(Vec::new()),
        }
    }

    fn records(&self, op: &str) -> bool {
        self.cfg.prof_all || self.cfg.prof_ops.iter().any(|o| o == op)
    }

    fn append(&self, op: &'static str, world: usize, msg_size: u64, latency_ms: f64) {
        let (algbw, busbw) = bandwidth(op, world, msg_size, latency_ms);
        let name = if self.cfg.debug {
            let t = std::thread::current();
            format!("{op} | [Caller Func: {}]", t.name().unwrap_or("unnamed"))
        } else {
            op.to_string()
        };
        if self.cfg.verbose && self.rank == 0 {
            tracing::info!(
                "comm op: {name} | time (ms): {latency_ms:.2} | msg size: {} | algbw (Gbps): \
                 {algbw:.2} | busbw (Gbps): {busbw:.2}",
                convert_size(msg_size)
            );
        }
        let mut rows = self.rows.lock().unwrap_or_else(|e| e.into_inner());
        let i = match rows.iter().position(|(n, _)| *n == name) {
            Some(i) => i,
            None => {
                rows.push((name, BTreeMap::new()));
                rows.len() - 1
            }
        };
        let row = rows[i].1.entry(msg_size).or_default();
        row.latencies_ms.push(latency_ms);
        row.algbw.push(algbw);
        row.busbw.push(busbw);
    }

    /// Every row so far, records in first-seen order, message sizes ascending.
    pub fn snapshot(&self) -> Vec<OpSummary> {
        let rows = self.rows.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = Vec::new();
        for (op, sizes) in rows.iter() {
            for (&msg_size, r) in sizes {
                let count = r.latencies_ms.len() as u64;
                out.push(OpSummary {
                    op: op.clone(),
                    msg_size,
                    count,
                    bytes: count * msg_size,
                    total_ms: r.latencies_ms.iter().sum(),
                    avg_ms: trim_mean(&r.latencies_ms, 0.1),
                    algbw_gbps: trim_mean(&r.algbw, 0.1),
                    busbw_gbps: trim_mean(&r.busbw, 0.1),
                });
            }
        }
        out
    }

    /// Bytes recorded for one collective kind, all message sizes together.
    pub fn bytes(&self, op: &str) -> u64 {
        let prefix = |o: &str| o == op || o.starts_with(&format!("{op} |"));
        self.snapshot()
            .iter()
            .filter(|s| prefix(&s.op))
            .map(|s| s.bytes)
            .sum()
    }

    /// DeepSpeed's summary table (`log_all`): a header, then each record's name on its own
    /// line followed by one line per message size, in 20-character columns.
    pub fn summary(&self) -> String {
        let mut s = format!(
            "{:<20}{:<20}{:<20}{:<20}{:<20}{:<20}{:<20}\n",
            "Comm. Op",
            "Message Size",
            "Count",
            "Total Latency(ms)",
            "Avg Latency(ms)",
            "tput_avg (Gbps)",
            "busbw_avg (Gbps)"
        );
        let mut last = None;
        for r in self.snapshot() {
            if last.as_deref() != Some(r.op.as_str()) {
                s.push_str(&r.op);
                s.push('\n');
                last = Some(r.op.clone());
            }
            s.push_str(&format!(
                "{:<20}{:<20}{:<20}{:<20.2}{:<20.2}{:<20.2}{:<20.2}\n",
                " ",
                convert_size(r.msg_size),
                r.count,
                r.total_ms,
                r.avg_ms,
                r.algbw_gbps,
                r.busbw_gbps
            ));
        }
        s
    }

    /// Logs [`CommStats::summary`] on rank 0.
    pub fn log_summary(&self) {
        if self.rank == 0 {
            tracing::info!("communication summary\n{}", self.summary());
        }
    }
}

/// DeepSpeed's `calc_bw_log`: algorithm and bus bandwidth in Gbps for `size` bytes in
/// `ms` milliseconds over `n` ranks (0 for an instantaneous call).
pub fn bandwidth(op: &str, n: usize, size: u64, ms: f64) -> (f64, f64) {
    if ms <= 0.0 {
        return (0.0, 0.0);
    }
    let (n, size) = (n as f64, size as f64);
    let (alg, bus) = match op {
        "all_gather_into_tensor" | "reduce_scatter_tensor" => {
            let size = size * n;
            (size / ms, size / ms * ((n - 1.0) / n))
        }
        "all_reduce" => (size * 2.0 / ms, size / ms * (2.0 * (n - 1.0) / n)),
        "all_to_all_single" => (size / ms, size / ms * ((n - 1.0) / n)),
        _ => (size / ms, size / ms),
    };
    // bytes per millisecond to gigabits per second
    (alg * 8.0 / 1e6, bus * 8.0 / 1e6)
}

/// DeepSpeed's `trim_mean`: the mean after dropping `round(n * trim)` values from each end.
pub fn trim_mean(data: &[f64], trim: f64) -> f64 {
    if data.is_empty() {
        return 0.0;
    }
    let mut d = data.to_vec();
    d.sort_by(f64::total_cmp);
    let k = (d.len() as f64 * trim).round() as usize;
    let kept = &d[k..d.len() - k];
    if kept.is_empty() {
        return 0.0;
    }
    kept.iter().sum::<f64>() / kept.len() as f64
}

/// DeepSpeed's `convert_size`: `"0B"`, else the value in the largest 1024-power unit with at
/// most two decimals (`"1.5 KB"`, `"4.0 MB"`).
pub fn convert_size(bytes: u64) -> String {
    if bytes == 0 {
        return "0B".into();
    }
    const UNITS: [&str; 7] = ["B", "KB", "MB", "GB", "TB", "PB", "EB"];
    let i = ((bytes as f64).ln() / 1024f64.ln()).floor() as usize;
    let i = i.min(UNITS.len() - 1);
    let v = ((bytes as f64 / 1024f64.powi(i as i32)) * 100.0).round() / 100.0;
    // Python prints a float with at least one decimal.
    if v.fract() == 0.0 {
        format!("{v:.1} {}", UNITS[i])
    } else {
        format!("{v} {}", UNITS[i])
    }
}

/// A communicator that records every collective of the one it wraps.
pub struct CommsLogger {
    inner: Box<dyn Communicator>,
    stats: Arc<CommStats>,
}

impl CommsLogger {
    /// Wraps `inner`, recording into `stats`.
    pub fn new(inner: Box<dyn Communicator>, stats: Arc<CommStats>) -> Self {
        CommsLogger { inner, stats }
    }

    /// The shared statistics.
    pub fn stats(&self) -> &Arc<CommStats> {
        &self.stats
    }

    fn timed<T>(&self, op: &'static str, bytes: usize, f: impl FnOnce() -> Result<T>) -> Result<T> {
        if !self.stats.records(op) {
            return f();
        }
        let t = Instant::now();
        let r = f()?;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        self.stats
            .append(op, self.inner.world_size(), bytes as u64, ms);
        Ok(r)
    }

    fn wrap(&self, c: Box<dyn Communicator>) -> Box<dyn Communicator> {
        Box::new(CommsLogger::new(c, self.stats.clone()))
    }
}

const ALL_REDUCE: &str = "all_reduce";
const REDUCE_SCATTER: &str = "reduce_scatter_tensor";
const ALL_GATHER: &str = "all_gather_into_tensor";
const BROADCAST: &str = "broadcast";
/// DeepSpeed's name and size for an all-to-all: the whole input's bytes.
const ALL_TO_ALL: &str = "all_to_all_single";
const BARRIER: &str = "barrier";

fn host_bytes(len: usize, dtype: crate::tensor::DType) -> usize {
    len * dtype.size()
}

impl Communicator for CommsLogger {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn backend(&self) -> CommBackend {
        self.inner.backend()
    }
    fn deterministic(&self) -> bool {
        self.inner.deterministic()
    }
    fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        let b = host_bytes(buf.len(), buf.dtype());
        self.timed(ALL_REDUCE, b, || self.inner.all_reduce(buf, op))
    }
    fn reduce_scatter(&self, input: BufRef<'_>, output: BufMut<'_>, op: ReduceOp) -> Result<()> {
        let b = host_bytes(output.len(), output.dtype());
        self.timed(REDUCE_SCATTER, b, || {
            self.inner.reduce_scatter(input, output, op)
        })
    }
    fn all_gather(&self, input: BufRef<'_>, output: BufMut<'_>) -> Result<()> {
        let b = host_bytes(input.len(), input.dtype());
        self.timed(ALL_GATHER, b, || self.inner.all_gather(input, output))
    }
    fn all_to_all(&self, input: BufRef<'_>, output: BufMut<'_>) -> Result<()> {
        let b = host_bytes(input.len(), input.dtype());
        self.timed(ALL_TO_ALL, b, || self.inner.all_to_all(input, output))
    }
    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<()> {
        let b = host_bytes(buf.len(), buf.dtype());
        self.timed(BROADCAST, b, || self.inner.broadcast(buf, root))
    }
    fn barrier(&self) -> Result<()> {
        self.timed(BARRIER, 0, || self.inner.barrier())
    }
    fn all_reduce_view(&self, buf: ViewMut<'_>, op: ReduceOp) -> Result<()> {
        let b = host_bytes(buf.len(), buf.dtype());
        self.timed(ALL_REDUCE, b, || self.inner.all_reduce_view(buf, op))
    }
    fn reduce_scatter_view(
        &self,
        input: View<'_>,
        output: ViewMut<'_>,
        op: ReduceOp,
    ) -> Result<()> {
        let b = host_bytes(output.len(), output.dtype());
        self.timed(REDUCE_SCATTER, b, || {
            self.inner.reduce_scatter_view(input, output, op)
        })
    }
    fn all_gather_view(&self, input: View<'_>, output: ViewMut<'_>) -> Result<()> {
        let b = host_bytes(input.len(), input.dtype());
        self.timed(ALL_GATHER, b, || self.inner.all_gather_view(input, output))
    }
    fn all_to_all_view(&self, input: View<'_>, output: ViewMut<'_>) -> Result<()> {
        let b = host_bytes(input.len(), input.dtype());
        self.timed(ALL_TO_ALL, b, || self.inner.all_to_all_view(input, output))
    }
    fn broadcast_view(&self, buf: ViewMut<'_>, root: usize) -> Result<()> {
        let b = host_bytes(buf.len(), buf.dtype());
        self.timed(BROADCAST, b, || self.inner.broadcast_view(buf, root))
    }
    fn fence(&self) -> Result<()> {
        self.inner.fence()
    }
    fn duplicate(&self) -> Result<Box<dyn Communicator>> {
        Ok(self.wrap(self.inner.duplicate()?))
    }
    fn split(&self, color: usize, key: usize) -> Result<Box<dyn Communicator>> {
        Ok(self.wrap(self.inner.split(color, key)?))
    }
    fn split_blocks(&self, g: usize) -> Result<Box<dyn Communicator>> {
        Ok(self.wrap(self.inner.split_blocks(g)?))
    }
    fn split_strided(&self, g: usize) -> Result<Box<dyn Communicator>> {
        Ok(self.wrap(self.inner.split_strided(g)?))
    }
}
