//! Failure handling of the `local` communicator: dead, slow and mismatched ranks make every
//! other rank fail within the timeout with an error naming the op and the peer; nothing
//! hangs; a broken group keeps failing fast.

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use ferrozero_runtime::comm::local::{run_ranks, LocalComm};
use ferrozero_runtime::comm::{BufMut, BufRef, Communicator, ReduceOp};
use ferrozero_runtime::nn::weights::MappedFile;
use ferrozero_runtime::Error;

const TIMEOUT: Duration = Duration::from_millis(400);
/// Scheduling slack on a loaded 2-core machine.
const SLACK: Duration = Duration::from_secs(3);

/// Asserts that `e` is a collective error for `op` naming `peer`, raised within the
/// timeout (plus scheduling slack).
fn assert_names(e: &Error, op: &str, peer: usize, limit: Duration) {
    match e {
        Error::Comm {
            op: got,
            peer: p,
            elapsed,
            reason,
            ..
        } => {
            assert_eq!(*got, op, "{e}");
            assert_eq!(*p, Some(peer), "{e}");
            assert!(reason.contains(&format!("rank {peer}")), "{e}");
            assert!(*elapsed <= limit, "took {elapsed:?}: {e}");
        }
        other => panic!("expected a collective error, got {other}"),
    }
}

#[test]
fn a_rank_that_panics_mid_run_fails_every_other_rank_naming_it() {
    let comms = LocalComm::group(4, Duration::from_secs(30));
    let start = Instant::now();
    let results: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|c| {
                s.spawn(move || {
                    let mut v = vec![1.0f32; 100_000];
                    c.all_reduce(BufMut::F32(&mut v), ReduceOp::Sum)?;
                    if c.rank() == 2 {
                        // Let the others enter the next collective, then die.
                        std::thread::sleep(Duration::from_millis(100));
                        panic!("rank 2 dies on purpose");
                    }
                    c.all_reduce(BufMut::F32(&mut v), ReduceOp::Sum)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join()).collect()
    });
    // The timeout is 30 s: the death must be noticed long before it.
    let limit = Duration::from_secs(5);
    assert!(start.elapsed() < limit);
    for (rank, r) in results.into_iter().enumerate() {
        if rank == 2 {
            assert!(r.is_err(), "rank 2 panicked");
            continue;
        }
        let e = r.expect("no panic").expect_err("the dead peer is noticed");
        assert_names(&e, "all_reduce", 2, limit);
        assert!(e.to_string().contains("panicked"), "{e}");
    }
}

#[test]
fn a_dropped_communicator_fails_the_waiting_peers() {
    let mut comms = LocalComm::group(3, Duration::from_secs(30));
    let dropped = comms.remove(1);
    let gate = Arc::new(Barrier::new(3));
    let results: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|c| {
                let gate = Arc::clone(&gate);
                s.spawn(move || {
                    gate.wait();
                    c.barrier()
                })
            })
            .collect();
        gate.wait();
        std::thread::sleep(Duration::from_millis(50));
        drop(dropped);
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for r in results {
        let e = r.expect_err("rank 1 is gone");
        assert_names(&e, "barrier", 1, Duration::from_secs(5));
        assert!(e.to_string().contains("dropped"), "{e}");
    }
}

#[test]
fn a_rank_that_stops_answering_times_out_every_other_rank() {
    let start = Instant::now();
    let err = run_ranks(3, TIMEOUT, |c: Box<dyn Communicator>| {
        if c.rank() == 1 {
            std::thread::sleep(TIMEOUT * 5);
        }
        let mut v = vec![c.rank() as f32; 1000];
        c.all_reduce(BufMut::F32(&mut v), ReduceOp::Sum)
    });
    let elapsed = start.elapsed();
    let e = err.expect_err("rank 1 is too slow");
    // The detecting ranks report rank 1; rank 1 itself reports who gave up on it.
    assert_names(&e, "all_reduce", 1, TIMEOUT + SLACK);
    // The slow rank got its full allowance, counted from the first rank that waited for
    // it; the reported error is the lowest rank's, whose own wait can be shorter when it
    // entered after the rank that detected the timeout (so its `elapsed` is not checked
    // against TIMEOUT: on a loaded machine rank 0 may enter well after rank 2).
    assert!(elapsed >= TIMEOUT, "{elapsed:?}");
    assert!(
        e.to_string().contains(&format!("waited {TIMEOUT:?}")),
        "{e}"
    );
    assert!(elapsed < TIMEOUT * 5 + SLACK, "{elapsed:?}");
}

#[test]
fn every_rank_reports_a_timeout_within_the_limit() {
    let outcomes = std::thread::scope(|s| {
        let comms = LocalComm::group(4, TIMEOUT);
        let hs: Vec<_> = comms
            .into_iter()
            .map(|c| {
                s.spawn(move || {
                    if c.rank() == 3 {
                        std::thread::sleep(TIMEOUT * 3);
                        return None;
                    }
                    let mut out = vec![0f32; 8];
                    Some(c.all_gather(BufRef::F32(&[1.0, 2.0]), BufMut::F32(&mut out)))
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    let mut longest = Duration::ZERO;
    for r in outcomes.into_iter().flatten() {
        let e = r.expect_err("rank 3 never came");
        assert_names(&e, "all_gather", 3, TIMEOUT + SLACK);
        if let Error::Comm { elapsed, .. } = e {
            longest = longest.max(elapsed);
        }
    }
    // Not earlier than the timeout either: a slow peer gets its full allowance from the
    // rank that detected the timeout. Ranks that entered later see the group's abort after
    // a shorter wait of their own, so only the longest wait is held to the timeout.
    assert!(longest >= TIMEOUT, "{longest:?}");
}

fn mismatch_on_all_ranks(
    f: impl Fn(&dyn Communicator) -> ferrozero_runtime::Result<()> + Sync,
) -> Vec<Error> {
    let comms = LocalComm::group(3, Duration::from_secs(30));
    std::thread::scope(|s| {
        let f = &f;
        let hs: Vec<_> = comms
            .into_iter()
            .map(|c| s.spawn(move || f(&c).expect_err("mismatch detected")))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn different_collectives_at_the_same_step_are_reported_on_every_rank() {
    let errors = mismatch_on_all_ranks(|c| {
        let mut v = vec![1.0f32; 10];
        if c.rank() == 2 {
            c.broadcast(BufMut::F32(&mut v), 0)
        } else {
            c.all_reduce(BufMut::F32(&mut v), ReduceOp::Sum)
        }
    });
    for e in &errors {
        let s = e.to_string();
        assert!(
            s.contains("mismatched") && s.contains("rank 2 called broadcast"),
            "{s}"
        );
    }
}

#[test]
fn different_lengths_and_dtypes_are_reported_and_break_the_group() {
    let errors = mismatch_on_all_ranks(|c| {
        let mut v = vec![1.0f32; 10 + c.rank() / 2];
        let first = c.all_reduce(BufMut::F32(&mut v), ReduceOp::Sum);
        assert!(first.is_err());
        // The group stays broken: the next call fails at once, naming the first cause.
        let t = Instant::now();
        let again = c.barrier().expect_err("broken group");
        assert!(t.elapsed() < Duration::from_secs(1));
        assert!(again.to_string().contains("11 elements"), "{again}");
        first
    });
    for e in &errors {
        assert!(
            e.to_string()
                .contains("rank 2 called all_reduce #0 (F32, 11 elements"),
            "{e}"
        );
    }
    let errors = mismatch_on_all_ranks(|c| {
        let mut a = vec![half::bf16::ZERO; 4];
        let mut b = vec![0f32; 4];
        match c.rank() {
            0 => c.all_reduce(BufMut::Bf16(&mut a), ReduceOp::Sum),
            _ => c.all_reduce(BufMut::F32(&mut b), ReduceOp::Sum),
        }
    });
    assert!(errors.iter().all(|e| e.to_string().contains("Bf16")));
}

#[test]
fn bad_arguments_on_one_rank_fail_all_ranks_fast() {
    let errors = mismatch_on_all_ranks(|c| {
        let input = vec![1.0f32; 9];
        let mut out = vec![0f32; if c.rank() == 1 { 4 } else { 3 }];
        c.reduce_scatter(BufRef::F32(&input), BufMut::F32(&mut out), ReduceOp::Sum)
    });
    for e in &errors {
        let s = e.to_string();
        assert!(
            s.contains("reduce_scatter") && s.contains("input 9 and output 4"),
            "{s}"
        );
    }
    let errors = mismatch_on_all_ranks(|c| c.broadcast(BufMut::F32(&mut [0.0; 3]), 3));
    assert!(errors.iter().all(|e| e.to_string().contains("root 3")));
}

#[test]
fn run_ranks_surfaces_the_root_cause() {
    let e = run_ranks(3, Duration::from_secs(30), |c: Box<dyn Communicator>| {
        if c.rank() == 1 {
            return Err(Error::Invalid("rank 1 gave up".into()));
        }
        c.barrier()
    })
    .expect_err("rank 1 failed");
    assert!(
        e.to_string()
            .contains("job aborted: rank 1 failed: invalid argument: rank 1 gave up"),
        "{e}"
    );
    let e = run_ranks(2, Duration::from_secs(30), |c: Box<dyn Communicator>| {
        assert!(c.rank() != 0, "boom on rank 0");
        c.barrier()
    })
    .expect_err("rank 0 panicked");
    assert!(
        e.to_string()
            .contains("job aborted: rank 0 failed: panicked: boom on rank 0"),
        "{e}"
    );
    assert!(run_ranks(0, TIMEOUT, |_c: Box<dyn Communicator>| Ok(())).is_err());
}

/// A rank that cannot read its file fails the job with one message naming the rank, the file
/// and the reader's own words, not only the other ranks' "peer is dead".
#[test]
fn run_ranks_names_the_rank_and_file_of_a_loader_error() {
    let dir = std::env::temp_dir().join(format!("fz-loader-err-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("rank1.safetensors");
    std::fs::write(&bad, b"\x08\0\0\0\0\0\0\0{not js").unwrap();
    let e = run_ranks(3, Duration::from_secs(30), |c: Box<dyn Communicator>| {
        if c.rank() == 1 {
            MappedFile::open(&bad)?;
        }
        c.barrier()
    })
    .expect_err("rank 1 cannot read its file");
    let s = e.to_string();
    assert!(s.starts_with("job aborted: rank 1 failed: "), "{s}");
    assert!(s.contains(&bad.display().to_string()), "{s}");
    assert!(s.contains("header"), "{s}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A rank that stops answering is named by the collective that timed out, with the op and
/// how long its peers waited.
#[test]
fn run_ranks_names_the_rank_that_timed_out() {
    let e = run_ranks(3, TIMEOUT, |c: Box<dyn Communicator>| {
        if c.rank() == 2 {
            std::thread::sleep(TIMEOUT * 3);
        }
        let mut v = vec![1.0f32; 8];
        c.all_reduce(BufMut::F32(&mut v), ReduceOp::Sum)
    })
    .expect_err("rank 2 is too slow");
    let s = e.to_string();
    assert!(s.contains("collective all_reduce failed on rank 0"), "{s}");
    assert!(s.contains("rank 2 stopped answering"), "{s}");
    assert!(s.contains(&format!("waited {TIMEOUT:?}")), "{s}");
}
