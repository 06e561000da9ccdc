//! The NCCL communicator on device buffers (the CUDA backend's emulator, the fake NCCL): the
//! collective is ordered after the compute stream and before it again by events on the
//! device's collective stream, never by the host fencing the device; the host goes on while
//! the collective runs and settles it later (the next collective, `fence`), and a collective
//! that fails or never finishes is still reported there within `comms.timeout`, named.
#![cfg(feature = "cuda")]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferrozero_runtime::backend::cuda::driver::{StreamKind, TraceOp, Traced};
use ferrozero_runtime::backend::cuda::CudaBackend;
use ferrozero_runtime::backend::MemoryOps;
use ferrozero_runtime::comm::nccl::fake::{FakeNccl, InjectedError};
use ferrozero_runtime::comm::nccl::{NcclComm, NcclOptions};
use ferrozero_runtime::comm::store::{JobSecret, StoreServer, TcpStore};
use ferrozero_runtime::comm::{BufMut, BufRef, Communicator, ReduceOp};
use ferrozero_runtime::tensor::{DType, Storage};
use ferrozero_runtime::{Error, Result};

const TIMEOUT: Duration = Duration::from_millis(400);

fn secret() -> JobSecret {
    JobSecret::new("the fake NCCL event tests' store secret").unwrap()
}

fn comm(lib: &FakeNccl, addr: SocketAddr, rank: usize, world: usize, t: Duration) -> NcclComm {
    let store = Arc::new(TcpStore::connect(addr, Duration::from_secs(10), &secret()).unwrap());
    let opts = NcclOptions {
        timeout: t,
        deterministic: false,
    };
    NcclComm::init(lib, store, "events", (rank, world), opts).expect("init")
}

/// An emulated device per rank, or `None` (skipped) without the emulator.
fn devices(world: usize) -> Option<Vec<Arc<CudaBackend>>> {
    let mut out = Vec::new();
    for _ in 0..world {
        match ferrozero_runtime::backend::cuda::emulated(DType::F32) {
            Ok(b) => out.push(b),
            Err(e) => {
                let why = format!("no emulated device: {e}");
                ferrozero_runtime::backend::cuda::emu::skip_unless_required(&why);
                return None;
            }
        }
    }
    Some(out)
}

/// Runs `f` on `world` threads, each with its communicator and its own emulated device.
fn ranks<T: Send>(
    lib: &FakeNccl,
    world: usize,
    timeout: Duration,
    f: impl Fn(usize, NcclComm, &CudaBackend) -> T + Sync,
) -> Option<Vec<T>> {
    let devs = devices(world)?;
    let srv = StoreServer::bind("127.0.0.1:0".parse().unwrap(), secret()).expect("store");
    let addr = srv.addr();
    Some(std::thread::scope(|s| {
        let hs: Vec<_> = (0..world)
            .map(|r| {
                let (f, dev) = (&f, &devs[r]);
                s.spawn(move || f(r, comm(lib, addr, r, world, timeout), dev))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    }))
}

fn data(rank: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 7 + rank * 13) as f32 * 0.37).sin() * 10f32.powi((i % 7) as i32 - 3))
        .collect()
}

fn bits(s: &Storage) -> Vec<u32> {
    s.to_vec_f32()
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect()
}

fn comm_err(r: Result<()>) -> (String, Option<usize>, Duration, String) {
    match r {
        Err(Error::Comm {
            op,
            peer,
            elapsed,
            reason,
            ..
        }) => (op.to_string(), peer, elapsed, reason),
        other => panic!("expected a collective error, got {other:?}"),
    }
}

/// The event operations of a trace, as (stream, record?, event index in order of first use).
fn events(trace: &[Traced]) -> Vec<(StreamKind, bool, usize)> {
    let mut seen = Vec::new();
    let mut index = |e| match seen.iter().position(|x| *x == e) {
        Some(i) => i,
        None => {
            seen.push(e);
            seen.len() - 1
        }
    };
    trace
        .iter()
        .filter_map(|(s, op)| match op {
            TraceOp::Record(e) => Some((s.expect("a stream"), true, index(*e))),
            TraceOp::Wait(e) => Some((s.expect("a stream"), false, index(*e))),
            _ => None,
        })
        .collect()
}

/// The host waits in a trace that are the fake library's data movement: it reads inputs from
/// and writes results to device memory with copies the host waits for (on a GPU, NCCL's
/// kernels move the data on the device).
fn copies_waited(trace: &[Traced]) -> u64 {
    let waited = |op: &TraceOp| match op {
        TraceOp::CopyDtoH { wait, .. } | TraceOp::CopyHtoD { wait, .. } => *wait,
        _ => false,
    };
    trace.iter().filter(|(_, op)| waited(op)).count() as u64
}

#[test]
fn device_collectives_wait_on_events_and_never_fence_the_device() {
    let (n, world) = (64, 2);
    let lib = FakeNccl::default();
    let out = ranks(&lib, world, TIMEOUT * 10, |r, c, be| {
        let mut a = be.upload(BufRef::F32(&data(r, n))).unwrap();
        let input = be.upload(BufRef::F32(&data(r + 5, n * world))).unwrap();
        let mut part = be.zeros(DType::F32, n).unwrap();
        let obs = be.device().observed();
        let before = be.activity().unwrap().host_syncs;
        obs.start_trace();
        c.all_reduce_view(a.view_mut(), ReduceOp::Sum).unwrap();
        c.reduce_scatter_view(input.view(), part.view_mut(), ReduceOp::Sum)
            .unwrap();
        c.fence().unwrap();
        let trace = obs.take_trace();
        let syncs = be.activity().unwrap().host_syncs - before;
        (trace, syncs, bits(&a), bits(&part))
    });
    let Some(out) = out else { return };
    assert_eq!(lib.device_collectives(), 2 * world);
    use StreamKind::{Collective, Compute};
    for (r, (trace, syncs, ..)) in out.iter().enumerate() {
        // Per collective: `ready` on the compute stream, the collective stream waits for it;
        // `done` on the collective stream, the compute stream waits for it. The events are
        // the communicator's two, reused.
        let order = [
            (Compute, true, 0),
            (Collective, false, 0),
            (Collective, true, 1),
            (Compute, false, 1),
        ];
        assert_eq!(
            events(trace),
            [order, order].concat(),
            "rank {r}: {trace:?}"
        );
        // The library reads the inputs and writes the results after the collective stream's
        // wait for `ready` and before `done` is recorded.
        let marks: Vec<usize> = (0..trace.len())
            .filter(|&i| matches!(trace[i].1, TraceOp::Record(_) | TraceOp::Wait(_)))
            .collect();
        for k in 0..2 {
            let copies = |from: usize, to: usize| {
                trace[from..to]
                    .iter()
                    .filter(|(_, op)| {
                        matches!(op, TraceOp::CopyDtoH { .. } | TraceOp::CopyHtoD { .. })
                    })
                    .count()
            };
            let m = &marks[4 * k..4 * k + 4];
            assert_eq!(copies(m[0], m[1]), 0, "rank {r}: {trace:?}");
            assert!(copies(m[1], m[2]) >= 2, "rank {r}: {trace:?}");
        }
        // No host fence of the device: the host waited only for the fake's own copies.
        assert!(
            !trace.iter().any(|(_, op)| *op == TraceOp::Synchronize),
            "rank {r}: {trace:?}"
        );
        assert_eq!(*syncs, copies_waited(trace), "rank {r}: {trace:?}");
    }
    // The fake sums in reverse rank order: rank 1's values first.
    let (a0, a1) = (data(0, n), data(1, n));
    let want: Vec<u32> = (0..n).map(|i| (a1[i] + a0[i]).to_bits()).collect();
    assert!(out.iter().all(|o| o.2 == want));
}

#[test]
fn the_host_goes_on_while_a_device_collective_runs_and_settles_it_later() {
    const DELAY: Duration = Duration::from_millis(1200);
    let n = 33;
    let lib = FakeNccl::default().with_completion_delay(DELAY);
    let out = ranks(&lib, 2, Duration::from_secs(10), |r, c, be| {
        let mut a = be.upload(BufRef::F32(&data(r, n))).unwrap();
        let t = Instant::now();
        c.all_reduce_view(a.view_mut(), ReduceOp::Sum).unwrap();
        let queued = t.elapsed();
        // A host-buffer collective settles the one before it first.
        let mut v = [r as f32];
        c.all_reduce(BufMut::F32(&mut v), ReduceOp::Sum).unwrap();
        let settled = t.elapsed();
        (queued, settled, v[0], bits(&a))
    });
    let Some(out) = out else { return };
    for (r, (queued, settled, v, _)) in out.iter().enumerate() {
        assert!(
            *queued < DELAY,
            "rank {r} waited {queued:?} for a queued collective"
        );
        // The device collective's delay, then the host one's.
        assert!(*settled >= DELAY * 2, "rank {r}: {settled:?}");
        assert_eq!(*v, 1.0);
    }
    assert_eq!(out[0].3, out[1].3);
}

#[test]
fn a_device_collective_that_never_finishes_fails_where_the_host_waits_naming_it() {
    // Collective #2 (the all-gather) is queued on every rank but never finishes.
    let lib = FakeNccl::default().hanging_at(2);
    let out = ranks(&lib, 2, TIMEOUT, |r, c, be| {
        c.barrier().unwrap();
        let input = be.upload(BufRef::F32(&data(r, 8))).unwrap();
        let mut all = be.zeros(DType::F32, 16).unwrap();
        c.all_gather_view(input.view(), all.view_mut())
            .expect("queued: the host does not wait for it");
        let t = Instant::now();
        // Rank 0 learns it at its fence, rank 1 at its next collective.
        let err = if r == 0 {
            comm_err(c.fence())
        } else {
            let mut v = [1.0f32];
            comm_err(c.all_reduce(BufMut::F32(&mut v), ReduceOp::Sum))
        };
        let waited = t.elapsed();
        let again = comm_err(c.fence().and_then(|()| c.barrier()));
        (err, waited, again)
    });
    let Some(out) = out else { return };
    for (r, ((op, peer, _, reason), waited, again)) in out.iter().enumerate() {
        assert_eq!(op, "all_gather", "rank {r}: {reason}");
        assert_eq!(*peer, None, "rank {r}: {reason}");
        assert!(
            reason.contains("comms.timeout") && reason.contains("every rank reached collective #2"),
            "rank {r}: {reason}"
        );
        assert!(
            *waited >= TIMEOUT && *waited < TIMEOUT * 2 + Duration::from_secs(1),
            "rank {r}: {waited:?}"
        );
        assert!(again.3.contains("aborted after all_gather"), "{again:?}");
    }
}

#[test]
fn a_failing_or_missing_rank_on_device_buffers_is_named_within_the_timeout() {
    let lib = FakeNccl::with_errors(vec![InjectedError {
        rank: 1,
        seq: 1,
        reason: "ncclRemoteError: remote process exited".into(),
    }]);
    let out = ranks(&lib, 3, TIMEOUT, |r, c, be| {
        let mut a = be.upload(BufRef::F32(&data(r, 8))).unwrap();
        comm_err(c.all_reduce_view(a.view_mut(), ReduceOp::Sum))
    });
    let Some(out) = out else { return };
    assert!(out[1].3.contains("ncclRemoteError"), "{:?}", out[1]);
    for r in [0, 2] {
        let (op, peer, _, reason) = &out[r];
        assert_eq!((op.as_str(), *peer), ("all_reduce", Some(1)), "{reason}");
        assert!(reason.contains("rank 1 reported an NCCL error"), "{reason}");
    }
    let out = ranks(&FakeNccl::default(), 3, TIMEOUT, |r, c, be| {
        let a = be.upload(BufRef::F32(&data(r, 12))).unwrap();
        if r == 2 {
            return None; // never reaches the collective
        }
        let t = Instant::now();
        let e = comm_err(c.reduce_scatter_view(
            a.view(),
            be.zeros(DType::F32, 4).unwrap().view_mut(),
            ReduceOp::Sum,
        ));
        Some((e, t.elapsed()))
    });
    let Some(out) = out else { return };
    for ((op, peer, _, reason), waited) in out.into_iter().flatten() {
        assert_eq!((op.as_str(), peer), ("reduce_scatter", Some(2)), "{reason}");
        assert!(
            reason.contains("rank 2 never reached collective #1"),
            "{reason}"
        );
        assert!(waited < TIMEOUT * 2 + Duration::from_secs(1), "{waited:?}");
    }
}
