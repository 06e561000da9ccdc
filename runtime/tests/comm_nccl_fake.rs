//! The NCCL communicator's logic on the fake NCCL (no GPU): the unique id travels through
//! the TCP store, a dead rank or an NCCL error makes every survivor fail within
//! `comms.timeout` with an error naming the collective and the rank, aborting its
//! communicator; deterministic reductions equal the local communicator's bit for bit;
//! splits (and so hybrid sharding) work over NCCL as over the local communicator.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::toy;
use ferrozero_config::resolved::{CommBackend, Precision, ZeroStage};
use ferrozero_runtime::comm::hybrid::HybridComm;
use ferrozero_runtime::comm::local::run_ranks;
use ferrozero_runtime::comm::nccl::fake::{FakeNccl, InjectedError};
use ferrozero_runtime::comm::nccl::{NcclComm, NcclOptions};
use ferrozero_runtime::comm::store::{JobSecret, StoreServer, TcpStore};
use ferrozero_runtime::comm::{BufMut, BufRef, Communicator, ReduceOp};
use ferrozero_runtime::engine::Engine;
use ferrozero_runtime::{Error, Result};

const TIMEOUT: Duration = Duration::from_millis(400);

fn secret() -> JobSecret {
    JobSecret::new("the fake NCCL jobs' store secret").unwrap()
}

fn server() -> StoreServer {
    StoreServer::bind("127.0.0.1:0".parse().unwrap(), secret()).expect("store server")
}

fn comm(
    lib: &FakeNccl,
    addr: SocketAddr,
    rank: usize,
    world: usize,
    det: bool,
) -> Result<NcclComm> {
    comm_t(lib, addr, (rank, world), det, TIMEOUT)
}

fn comm_t(
    lib: &FakeNccl,
    addr: SocketAddr,
    (rank, world): (usize, usize),
    det: bool,
    timeout: Duration,
) -> Result<NcclComm> {
    let store = Arc::new(TcpStore::connect(addr, Duration::from_secs(10), &secret())?);
    let opts = NcclOptions {
        timeout,
        deterministic: det,
    };
    NcclComm::init(lib, store, "job", (rank, world), opts)
}

/// Runs `f` on `world` threads, each with its NCCL communicator; results in rank order.
fn ranks<T: Send>(
    lib: &FakeNccl,
    world: usize,
    det: bool,
    f: impl Fn(usize, Result<NcclComm>) -> T + Sync,
) -> Vec<T> {
    ranks_t(lib, world, det, TIMEOUT, f)
}

fn ranks_t<T: Send>(
    lib: &FakeNccl,
    world: usize,
    det: bool,
    timeout: Duration,
    f: impl Fn(usize, Result<NcclComm>) -> T + Sync,
) -> Vec<T> {
    let srv = server();
    let addr = srv.addr();
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..world)
            .map(|r| {
                let f = &f;
                s.spawn(move || f(r, comm_t(lib, addr, (r, world), det, timeout)))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
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

#[test]
fn the_id_travels_through_the_store_and_collectives_run() {
    let lib = FakeNccl::default();
    let sums = ranks(&lib, 3, false, |r, c| {
        let c = c.expect("init");
        let mut v = [r as f32 + 1.0, 10.0];
        c.all_reduce(BufMut::F32(&mut v), ReduceOp::Sum).unwrap();
        v
    });
    assert!(sums.iter().all(|v| *v == [6.0, 30.0]), "{sums:?}");
    let inits = lib.inits();
    assert_eq!(inits.len(), 3);
    assert!(
        inits.iter().all(|(_, id)| *id == inits[0].1),
        "ranks got different ids"
    );
}

#[test]
fn a_dead_rank_fails_every_survivor_within_the_timeout_naming_it() {
    let lib = FakeNccl::default();
    let out = ranks(&lib, 3, false, |r, c| {
        let c = c.expect("init");
        if r == 2 {
            return None; // dies before the collective
        }
        let t = Instant::now();
        let mut v = [1.0f32];
        let first = comm_err(c.all_reduce(BufMut::F32(&mut v), ReduceOp::Sum));
        let waited = t.elapsed();
        // The communicator was aborted: the next call fails at once, saying so.
        let t = Instant::now();
        let again = comm_err(c.barrier());
        Some((first, waited, again, t.elapsed()))
    });
    for (rank, o) in out.iter().enumerate().take(2) {
        let ((op, peer, _, reason), waited, again, fast) = o.clone().unwrap();
        assert_eq!(op, "all_reduce");
        assert_eq!(peer, Some(2), "rank {rank}: {reason}");
        assert!(
            reason.contains("comms.timeout") && reason.contains("rank 2"),
            "{reason}"
        );
        assert!(
            waited >= TIMEOUT && waited < TIMEOUT * 2 + Duration::from_secs(1),
            "{waited:?}"
        );
        assert!(
            again.3.contains("aborted") && fast < Duration::from_millis(50),
            "{again:?}"
        );
    }
    let mut aborted = lib.aborted_ranks();
    aborted.sort_unstable();
    assert_eq!(aborted, vec![0, 1]);
}

#[test]
fn an_nccl_error_on_one_rank_is_named_by_the_others() {
    let lib = FakeNccl::with_errors(vec![InjectedError {
        rank: 1,
        seq: 2,
        reason: "ncclRemoteError: remote process exited".into(),
    }]);
    let out = ranks(&lib, 3, false, |_, c| {
        let c = c.expect("init");
        c.barrier().expect("first collective");
        let mut v = [0f32; 4];
        comm_err(c.all_reduce(BufMut::F32(&mut v), ReduceOp::Sum))
    });
    let (op, _, _, reason) = &out[1];
    assert_eq!(op, "all_reduce");
    assert!(reason.contains("ncclRemoteError"), "{reason}");
    for r in [0, 2] {
        let (_, peer, _, reason) = &out[r];
        assert_eq!(*peer, Some(1), "rank {r}: {reason}");
        assert!(reason.contains("rank 1 reported an NCCL error"), "{reason}");
    }
}

#[test]
fn a_rank_that_never_initialises_is_named_at_init() {
    let lib = FakeNccl::default();
    let srv = server();
    let addr = srv.addr();
    let errs: Vec<String> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|r| {
                let lib = &lib;
                s.spawn(move || match comm(lib, addr, r, 3, false) {
                    Err(Error::Comm { op, peer, .. }) => format!("{op} {peer:?}"),
                    other => format!("unexpected {other:?}"),
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(errs, vec!["init Some(2)", "init Some(2)"]);
}

/// Values whose sums round differently in different orders.
fn data(rank: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 7 + rank * 13) as f32 * 0.37).sin() * 10f32.powi((i % 7) as i32 - 3))
        .collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// (all_reduce, reduce_scatter) results of every rank over `c`.
fn reduce_both(c: &dyn Communicator, n: usize) -> (Vec<u32>, Vec<u32>) {
    let w = c.world_size();
    let mut a = data(c.rank(), n);
    c.all_reduce(BufMut::F32(&mut a), ReduceOp::Sum).unwrap();
    let input = data(c.rank() + 5, n * w);
    let mut out = vec![0f32; n];
    c.reduce_scatter(BufRef::F32(&input), BufMut::F32(&mut out), ReduceOp::Sum)
        .unwrap();
    (bits(&a), bits(&out))
}

#[test]
fn deterministic_reductions_equal_the_local_communicator_bit_for_bit() {
    let n = 1001;
    let local = run_ranks(3, TIMEOUT * 10, |c| Ok(reduce_both(&*c, n))).unwrap();
    let det = ranks(&FakeNccl::default(), 3, true, |_, c| {
        reduce_both(&c.unwrap(), n)
    });
    assert_eq!(local, det);
    // The fake's native order (like NCCL's ring) is not rank order: without the option the
    // bits differ, which is why the option exists.
    let native = ranks(&FakeNccl::default(), 3, false, |_, c| {
        reduce_both(&c.unwrap(), n)
    });
    assert_ne!(local, native);
}

#[test]
fn splits_and_hybrid_sharding_work_over_nccl() {
    let out = ranks(&FakeNccl::default(), 4, true, |r, c| {
        let c = c.unwrap();
        let sub = c.split(r % 2, r).unwrap();
        let mut v = [r as f32];
        sub.all_reduce(BufMut::F32(&mut v), ReduceOp::Sum).unwrap();
        let h = HybridComm::new(&c, 2).unwrap();
        let mut w = [r as f32 + 1.0];
        h.all_reduce(BufMut::F32(&mut w), ReduceOp::Sum).unwrap();
        (sub.rank(), sub.world_size(), v[0], h.rank(), w[0])
    });
    assert_eq!(
        out,
        vec![
            (0, 2, 2.0, 0, 10.0),
            (0, 2, 4.0, 1, 10.0),
            (1, 2, 2.0, 0, 10.0),
            (1, 2, 4.0, 1, 10.0),
        ]
    );
}

/// Four steps of stage 3 at world 2; (losses, parameter bits) of rank 0.
fn train(e: &mut Engine, rank: usize) -> Result<(Vec<f64>, Vec<Vec<u32>>)> {
    let mut losses = Vec::new();
    for s in 0..4 {
        losses.push(
            e.train_batch(&[toy::batch(11, 5, (s * 2 + rank) * 2, 2)])?
                .loss,
        );
    }
    let params = e.parameters()?.iter().map(|t| bits(&t.data)).collect();
    Ok((losses, params))
}

#[test]
fn the_engine_trains_over_deterministic_nccl_bit_for_bit_like_local_threads() {
    let mut cfg = common::config(ZeroStage::Stage3, 2, 2, 1, Precision::F32);
    cfg.zero.overlap_comm = true;
    let local = run_ranks(2, Duration::from_secs(30), |c| {
        let r = c.rank();
        train(
            &mut Engine::new(toy::model(11, 6, 5, 2), cfg.clone(), c)?,
            r,
        )
    })
    .unwrap();
    cfg.comms.backend = CommBackend::Nccl;
    cfg.comms.reduction = ferrozero_config::resolved::CommReduction::RankOrdered;
    let long = Duration::from_secs(30);
    let nccl = ranks_t(&FakeNccl::default(), 2, true, long, |r, c| {
        let e = Engine::new(toy::model(11, 6, 5, 2), cfg.clone(), Box::new(c.unwrap()));
        train(&mut e.unwrap(), r).unwrap()
    });
    assert_eq!(local, nccl);
    // Asking for determinism from a communicator that does not give it is refused.
    let refused = ranks_t(&FakeNccl::default(), 2, false, long, |_, c| {
        let e = Engine::new(toy::model(11, 6, 5, 2), cfg.clone(), Box::new(c.unwrap()));
        e.err().map(|e| e.to_string()).unwrap_or_default()
    });
    assert!(
        refused[0].contains("comms.reduction = \"rank_ordered\""),
        "{refused:?}"
    );
}

/// (all_reduce, reduce_scatter, all_gather) results of every rank over `c`, with the
/// buffers in `be`'s memory.
#[cfg(feature = "cuda")]
fn collectives_on(
    c: &dyn Communicator,
    be: &dyn ferrozero_runtime::backend::Backend,
    n: usize,
) -> Result<Vec<Vec<u32>>> {
    let w = c.world_size();
    let f32s = |s: &ferrozero_runtime::tensor::Storage| s.to_vec_f32().map(|v| bits(&v));
    let mut a = be.upload(BufRef::F32(&data(c.rank(), n)))?;
    c.all_reduce_view(a.view_mut(), ReduceOp::Sum)?;
    let input = be.upload(BufRef::F32(&data(c.rank() + 5, n * w)))?;
    let mut out = be.zeros(ferrozero_runtime::tensor::DType::F32, n)?;
    c.reduce_scatter_view(input.view(), out.view_mut(), ReduceOp::Sum)?;
    let mut all = be.zeros(ferrozero_runtime::tensor::DType::F32, n * w)?;
    c.all_gather_view(out.view(), all.view_mut())?;
    Ok(vec![f32s(&a)?, f32s(&out)?, f32s(&all)?])
}

/// Device buffers (the CUDA backend on its emulator) go to the library as they are, not
/// staged through host memory by the communicator, and give the host buffers' bits; with
/// `deterministic`, those of the local communicator.
#[cfg(feature = "cuda")]
#[test]
fn device_buffers_reach_nccl_as_they_are() {
    use ferrozero_runtime::tensor::DType;
    let dev = ferrozero_runtime::backend::cuda::emulated(DType::F32).expect("emulator");
    let host = ferrozero_runtime::backend::cpu();
    let n = 301;
    for det in [false, true] {
        let lib = FakeNccl::default();
        let on_host = ranks(&lib, 3, det, |_, c| collectives_on(&c.unwrap(), &*host, n));
        assert_eq!(lib.device_collectives(), 0);
        let lib = FakeNccl::default();
        let on_dev = ranks(&lib, 3, det, |_, c| collectives_on(&c.unwrap(), &*dev, n));
        let on_host: Vec<_> = on_host.into_iter().map(Result::unwrap).collect();
        let on_dev: Vec<_> = on_dev.into_iter().map(Result::unwrap).collect();
        assert_eq!(on_host, on_dev, "deterministic: {det}");
        // Native: three collectives per rank handed over in device memory. Deterministic:
        // the ordered sums run on the host, so only the all-gather is.
        assert_eq!(lib.device_collectives(), if det { 3 } else { 9 });
        if det {
            let local = run_ranks(3, TIMEOUT * 10, |c| collectives_on(&*c, &*host, n)).unwrap();
            assert_eq!(local, on_host);
        }
    }
}
