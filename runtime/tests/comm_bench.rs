//! The collective benchmark core: rows for every op and size, nccl-tests bus factors, and
//! JSON rows with exactly the documented keys.

use std::time::Duration;

use ferrozero_runtime::comm::bench::{self, BenchOp};
use ferrozero_runtime::comm::local::run_ranks;

#[test]
fn sizes_double_from_min_to_max() {
    assert_eq!(bench::sizes(1024, 8192), vec![1024, 2048, 4096, 8192]);
    assert_eq!(bench::sizes(1024, 1000), Vec::<usize>::new());
    assert_eq!(bench::sizes(1 << 10, 256 << 20).len(), 19);
}

#[test]
fn bus_factors_follow_nccl_tests() {
    assert_eq!(BenchOp::AllReduce.bus_factor(4), 1.5);
    assert_eq!(BenchOp::ReduceScatter.bus_factor(4), 0.75);
    assert_eq!(BenchOp::AllGather.bus_factor(2), 0.5);
    assert_eq!(BenchOp::Broadcast.bus_factor(8), 1.0);
    assert_eq!(BenchOp::AllReduce.bus_factor(1), 0.0);
}

#[test]
fn every_rank_reports_the_same_consistent_rows() {
    let sizes = [4096, 12_000];
    let rows = run_ranks(3, Duration::from_secs(30), |c| {
        bench::run(&*c, &BenchOp::ALL, &sizes)
    })
    .unwrap();
    assert!(
        rows.iter().all(|r| *r == rows[0]),
        "ranks agree on the slowest time"
    );
    let rows = &rows[0];
    assert_eq!(rows.len(), 8);
    for (row, (op, size)) in rows.iter().zip(
        BenchOp::ALL
            .iter()
            .flat_map(|o| sizes.iter().map(move |s| (*o, *s))),
    ) {
        assert_eq!(row.op, op);
        assert_eq!(row.ranks, 3);
        // Rounded down to whole f32 elements divisible by the world size.
        assert!(row.bytes <= size && row.bytes > size - 12 && row.bytes % 12 == 0);
        assert!(row.time_us > 0.0);
        let algbw = row.bytes as f64 / (row.time_us * 1e-6) / 1e9;
        assert!((row.algbw_gbps - algbw).abs() <= 1e-9 * algbw.max(1.0));
        assert!((row.busbw_gbps - algbw * op.bus_factor(3)).abs() <= 1e-9 * algbw.max(1.0));
    }
}

#[test]
fn json_rows_have_the_documented_keys() {
    let rows = run_ranks(2, Duration::from_secs(30), |c| {
        bench::run(&*c, &[BenchOp::ReduceScatter], &[1024])
    })
    .unwrap();
    let v: serde_json::Value = serde_json::to_value(&rows[0][0]).unwrap();
    let mut keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(
        keys,
        [
            "algbw_gbps",
            "busbw_gbps",
            "bytes",
            "op",
            "ranks",
            "time_us"
        ]
    );
    assert_eq!(v["op"], "reduce_scatter");
}
