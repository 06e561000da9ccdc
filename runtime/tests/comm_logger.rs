//! The communication logger over the local communicator: DeepSpeed's message sizes, size
//! strings, bandwidth formulas and summary table; duplicated communicators share the record;
//! results are the wrapped communicator's.

use std::sync::Arc;
use std::time::Duration;

use ferrozero_config::resolved::CommsLoggerConfig;
use ferrozero_runtime::comm::local::run_ranks;
use ferrozero_runtime::comm::logger::{bandwidth, convert_size, trim_mean, CommStats, CommsLogger};
use ferrozero_runtime::comm::{BufMut, BufRef, Communicator, ReduceOp};

fn cfg() -> CommsLoggerConfig {
    CommsLoggerConfig {
        verbose: true,
        prof_all: true,
        prof_ops: vec![],
        debug: false,
    }
}

#[test]
fn sizes_print_as_deepspeeds_convert_size() {
    // Python: convert_size(n) for these n.
    assert_eq!(convert_size(0), "0B");
    assert_eq!(convert_size(4), "4.0 B");
    assert_eq!(convert_size(1024), "1.0 KB");
    assert_eq!(convert_size(1536), "1.5 KB");
    assert_eq!(convert_size(1_000_000), "976.56 KB");
    assert_eq!(convert_size(711_832_207), "678.86 MB");
    assert_eq!(convert_size(3 << 30), "3.0 GB");
}

#[test]
fn bandwidths_follow_deepspeeds_calc_bw_log() {
    // 1e6 bytes in 1 ms = 8 Gbps.
    let (alg, bus) = bandwidth("all_reduce", 4, 1_000_000, 1.0);
    assert!(
        (alg - 16.0).abs() < 1e-9 && (bus - 12.0).abs() < 1e-9,
        "{alg} {bus}"
    );
    let (alg, bus) = bandwidth("all_gather_into_tensor", 4, 1_000_000, 1.0);
    assert!(
        (alg - 32.0).abs() < 1e-9 && (bus - 24.0).abs() < 1e-9,
        "{alg} {bus}"
    );
    let (alg, bus) = bandwidth("reduce_scatter_tensor", 2, 1_000_000, 2.0);
    assert!(
        (alg - 8.0).abs() < 1e-9 && (bus - 4.0).abs() < 1e-9,
        "{alg} {bus}"
    );
    assert_eq!(bandwidth("broadcast", 8, 1_000_000, 1.0), (8.0, 8.0));
    assert_eq!(bandwidth("barrier", 8, 0, 0.0), (0.0, 0.0));
}

#[test]
fn trimmed_mean_drops_a_tenth_from_each_end() {
    let mut v: Vec<f64> = (1..=10).map(f64::from).collect();
    v[9] = 1000.0;
    // round(10 * 0.1) = 1 from each end: mean of 2..=9.
    assert_eq!(trim_mean(&v, 0.1), 5.5);
    assert_eq!(trim_mean(&[3.0], 0.1), 3.0);
    assert_eq!(trim_mean(&[], 0.1), 0.0);
}

#[test]
fn every_collective_is_recorded_by_kind_and_size_and_results_are_unchanged() {
    let stats: Vec<Arc<CommStats>> = run_ranks(2, Duration::from_secs(30), |comm| {
        let rank = comm.rank();
        let stats = Arc::new(CommStats::new(cfg(), rank));
        let c = CommsLogger::new(comm, stats.clone());
        let mut v = [rank as f32 + 1.0; 6];
        c.all_reduce(BufMut::F32(&mut v), ReduceOp::Sum)?;
        assert_eq!(v, [3.0; 6]);
        let mut out = [0f32; 3];
        c.reduce_scatter(BufRef::F32(&[1.0; 6]), BufMut::F32(&mut out), ReduceOp::Sum)?;
        assert_eq!(out, [2.0; 3]);
        let mut full = [0f32; 8];
        c.all_gather(BufRef::F32(&[rank as f32; 4]), BufMut::F32(&mut full))?;
        assert_eq!(full, [0., 0., 0., 0., 1., 1., 1., 1.]);
        // A duplicate (the engine's communication worker) records into the same table.
        let dup = c.duplicate()?;
        let mut b = [rank as f32; 5];
        dup.broadcast(BufMut::F32(&mut b), 1)?;
        assert_eq!(b, [1.0; 5]);
        dup.barrier()?;
        let mut w = [0f32; 6];
        c.all_reduce(BufMut::F32(&mut w), ReduceOp::Sum)?;
        let mut x = [0f32; 2];
        c.all_reduce(BufMut::F32(&mut x), ReduceOp::Max)?;
        Ok(stats)
    })
    .unwrap();
    let rows = stats[0].snapshot();
    let got: Vec<(&str, u64, u64)> = rows
        .iter()
        .map(|r| (r.op.as_str(), r.msg_size, r.count))
        .collect();
    assert_eq!(
        got,
        [
            ("all_reduce", 8, 1),
            ("all_reduce", 24, 2),
            // Per-rank output of a reduce-scatter, per-rank input of an all-gather.
            ("reduce_scatter_tensor", 12, 1),
            ("all_gather_into_tensor", 16, 1),
            ("broadcast", 20, 1),
            ("barrier", 0, 1),
        ]
    );
    assert_eq!(stats[0].bytes("all_reduce"), 8 + 48);
    let table = stats[0].summary();
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(
        lines[0].trim_end(),
        "Comm. Op            Message Size        Count               Total Latency(ms)   \
         Avg Latency(ms)     tput_avg (Gbps)     busbw_avg (Gbps)"
    );
    assert_eq!(lines[1], "all_reduce");
    assert!(
        lines[2].starts_with(&format!("{:<20}{:<20}{:<20}", " ", "8.0 B", 1)),
        "{table}"
    );
    assert!(
        lines[3].starts_with(&format!("{:<20}{:<20}{:<20}", " ", "24.0 B", 2)),
        "{table}"
    );
    assert_eq!(lines[4], "reduce_scatter_tensor");
    assert_eq!(lines.len(), 1 + 5 + 6, "{table}");
}

#[test]
fn prof_ops_limits_and_debug_names_the_calling_thread() {
    let stats = run_ranks(2, Duration::from_secs(30), |comm| {
        let config = CommsLoggerConfig {
            prof_all: false,
            prof_ops: vec!["barrier".into()],
            debug: true,
            ..cfg()
        };
        let stats = Arc::new(CommStats::new(config, comm.rank()));
        let c = CommsLogger::new(comm, stats.clone());
        let mut v = [1f32; 4];
        c.all_reduce(BufMut::F32(&mut v), ReduceOp::Sum)?;
        // The communicator moves to a thread of that name, as to the engine's worker.
        std::thread::Builder::new()
            .name("trainer".into())
            .spawn(move || c.barrier())
            .unwrap()
            .join()
            .unwrap()?;
        Ok(stats)
    })
    .unwrap();
    let rows = stats[0].snapshot();
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0].op, "barrier | [Caller Func: trainer]");
    assert_eq!(stats[0].bytes("barrier"), 0);
}
