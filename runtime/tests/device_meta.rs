//! The size-only CUDA device (`driver::MetaDriver`) against the emulator: the same training
//! steps allocate, free, launch, copy and wait exactly alike on both (the caching allocator's
//! counters, the driver layer's counts and its issue order, the page-locked bytes), a
//! multi-GiB workload runs on it without the process's memory growing, and its refusals read
//! as the emulator's.
#![cfg(feature = "cuda")]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::models::{batches, build, resident, serial, Which, MICRO};
use common::{checkpointing, config};
use ferrozero_config::resolved::{OffloadTarget, Precision, ResolvedConfig, ZeroStage};
use ferrozero_runtime::backend::cuda::driver::{
    self, AllocatorStats, DeviceInfo, Driver, LaunchConfig, MetaDriver, StreamKind, TraceOp,
    Traced, EMU_DEFAULT_TOTAL_MEMORY,
};
use ferrozero_runtime::backend::cuda::{self, CudaBackend};
use ferrozero_runtime::backend::{Backend, DeviceActivity};
use ferrozero_runtime::comm::local::run_ranks;
use ferrozero_runtime::comm::meta::MetaComm;
use ferrozero_runtime::comm::Communicator;
use ferrozero_runtime::engine::ledger::{Category, Ledger, Location};
use ferrozero_runtime::engine::Engine;
use ferrozero_runtime::tensor::DType;

const SEQ: usize = 32;
const GAS: usize = 2;
const STEPS: usize = 2;

/// The emulator as a device to run on.
fn emulated(act: DType) -> ferrozero_runtime::Result<Arc<CudaBackend>> {
    cuda::emulated(act)
}

/// The size-only H100, with the emulator's memory so that both refuse at the same size.
fn size_only(act: DType) -> ferrozero_runtime::Result<Arc<CudaBackend>> {
    cuda::meta(
        act,
        DeviceInfo::h100_sizes_only(Some(EMU_DEFAULT_TOTAL_MEMORY)),
    )
}

type Open = fn(DType) -> ferrozero_runtime::Result<Arc<CudaBackend>>;

/// What one rank's device saw over a run, from before the engine was built.
#[derive(Debug)]
struct Seen {
    stats: AllocatorStats,
    activity: DeviceActivity,
    page_locked: u64,
    trace: Vec<Traced>,
    skipped: Vec<bool>,
    /// The engine ledger's host peaks, category by category, then the page-locked bytes'
    /// peak (zeros when the engine was not built).
    host: Vec<u64>,
    /// The error that ended the run early, if one did.
    error: Option<String>,
}

/// The ledger's host side: every category's peak, the total's, the page-locked peak.
fn host_peaks(l: &Ledger) -> Vec<u64> {
    let mut out: Vec<u64> = Category::ALL
        .iter()
        .map(|&c| l.peak(Location::Host, c))
        .collect();
    out.push(l.peak_total(Location::Host));
    out.push(l.page_locked().1);
    out
}

/// One case of the sweep.
#[derive(Clone, Copy, Debug)]
struct Case {
    stage: ZeroStage,
    world: usize,
    fp16: bool,
    offload: Offload,
    ckpt: bool,
    /// `overlap_comm`: reductions and stage-3 prefetches on the comm worker.
    overlap: bool,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Offload {
    None,
    Optimizer,
    OptimizerAndParams,
}

fn make_config(c: Case) -> ResolvedConfig {
    // A scale of 2^8 keeps the tiny models' fp16 gradients finite on the emulator: no step
    // is skipped, so both devices take the same path.
    let precision = match c.fp16 {
        true => Precision::Fp16(common::dynamic_scaling(8, 1000, 2)),
        false => Precision::Bf16,
    };
    let mut cfg = config(c.stage, c.world, MICRO, GAS, precision);
    if c.offload != Offload::None {
        cfg.zero.offload_optimizer.target = OffloadTarget::Cpu;
    }
    if c.offload == Offload::OptimizerAndParams {
        cfg.zero.offload_param.target = OffloadTarget::Cpu;
    }
    cfg.activation_checkpointing = c.ckpt.then(|| checkpointing(false));
    cfg.zero.overlap_comm = c.overlap;
    cfg
}

/// Two optimizer steps of `which` under `cfg`, each rank on its own device from `open`,
/// traced from before the engine is built; a rank's error is kept with what its device saw.
fn run(which: Which, cfg: &ResolvedConfig, open: Open) -> Vec<Seen> {
    let (act, world) = (act_dtype(cfg), cfg.world_size);
    run_ranks(world, Duration::from_secs(600), |comm| {
        rank_run(which, cfg, open(act)?, comm)
    })
    .expect("the ranks ran")
}

/// [`run`] on the size-only device with a [`MetaComm`]: rank 0 alone, standing for the world.
fn run_size_only(which: Which, cfg: &ResolvedConfig) -> Vec<Seen> {
    let act = act_dtype(cfg);
    let comm = MetaComm::new(0, cfg.world_size, cfg.comms.backend).expect("a meta communicator");
    vec![rank_run(
        which,
        cfg,
        size_only(act).expect("the size-only device"),
        Box::new(comm),
    )
    .expect("the size-only rank ran")]
}

/// One rank's two optimizer steps on `dev`, traced from before the engine is built.
fn rank_run(
    which: Which,
    cfg: &ResolvedConfig,
    dev: Arc<CudaBackend>,
    comm: Box<dyn Communicator>,
) -> ferrozero_runtime::Result<Seen> {
    let rank = comm.rank();
    dev.device().observed().start_trace();
    let be: Arc<dyn Backend> = dev.clone();
    let (mut skipped, mut host) = (Vec::new(), vec![0; Category::ALL.len() + 2]);
    let steps = || -> ferrozero_runtime::Result<()> {
        let mut e = Engine::with_backend(build(which), cfg.clone(), comm, be)?;
        for s in 0..STEPS {
            skipped.push(e.train_batch(&batches(cfg, SEQ, s, rank))?.skipped);
        }
        host = host_peaks(e.ledger());
        Ok(())
    };
    let error = steps().err().map(|e| e.to_string());
    let d = dev.device();
    Ok(Seen {
        stats: d.allocator().stats(),
        activity: d.observed().activity(),
        page_locked: d.page_locked_bytes(),
        trace: d.observed().take_trace(),
        skipped,
        host,
        error,
    })
}

fn act_dtype(cfg: &ResolvedConfig) -> DType {
    match cfg.precision {
        Precision::Fp16(_) => DType::F16,
        _ => DType::Bf16,
    }
}

/// Where two traces (or sorted lists) first part, for the failure message.
fn first_difference<T: PartialEq + std::fmt::Debug>(a: &[T], b: &[T]) -> String {
    let i = a.iter().zip(b).take_while(|(x, y)| x == y).count();
    format!(
        "lengths {} and {}; first difference at {i}: {:?} vs {:?}",
        a.len(),
        b.len(),
        a.get(i),
        b.get(i)
    )
}

impl Case {
    /// Whether a comm worker thread issues device work beside the compute thread
    /// (`overlap_comm` with a peer to reduce with).
    fn threaded(&self) -> bool {
        self.overlap && self.world > 1
    }

    /// Whether the parameters live on the host (stage 3's `offload_param`): a size-only
    /// host holds no bytes, so their uploads allocate as on the emulator and copy nothing.
    fn host_params(&self) -> bool {
        self.offload == Offload::OptimizerAndParams
    }

    /// Whether the size-only run simulates rank 0 alone with a `MetaComm`: at two ranks with
    /// state offloaded, whose size-only host buffers the local communicator cannot exchange.
    fn meta_comm(&self) -> bool {
        self.world > 1 && self.offload != Offload::None
    }
}

/// The emulator's run of one case, every rank, against the size-only device's rank 0 alone
/// with a `MetaComm` (its host side size-only): the allocator's counters, the page-locked
/// bytes and the ledger's host peaks equal; the issue order too, unless a comm worker's
/// timing orders it (then as a multiset) or stage-3 parameters come up from the size-only
/// host (those uploads copy nothing: the copies and the trace are not compared). Failures
/// are collected, one line per case.
fn compare(which: Which, c: Case, failures: &mut Vec<String>) {
    let mut cfg = make_config(c);
    if let Which::Gpt2Wide = which {
        // DeepSpeed's default buckets and one optimizer tile per group: the shared config's
        // tiny ones would make a million parameters tens of thousands of collectives.
        cfg.zero.sub_group_size = 1_000_000_000;
        cfg.zero.reduce_bucket_size = 500_000_000;
        cfg.zero.allgather_bucket_size = 500_000_000;
        cfg.zero.prefetch_bucket_size = 50_000_000;
    }
    let what = format!("{which:?} {c:?}");
    let emu = run(which, &cfg, emulated);
    let meta = match c.meta_comm() {
        true => run_size_only(which, &cfg),
        false => run(which, &cfg, size_only),
    };
    for (rank, (e, m)) in emu.iter().zip(&meta).enumerate() {
        assert_eq!(e.error, None, "{what}: the emulator's run failed");
        assert!(
            e.skipped.iter().all(|s| !s),
            "{what}: the emulator skipped a step ({:?}): the case compares taken steps",
            e.skipped
        );
        let mut diffs = match (c.host_params() || c.meta_comm(), c.threaded()) {
            (true, threaded) => host_side_differences(e, m, threaded),
            (false, false) => differences(e, m),
            (false, true) => threaded_differences(e, m),
        };
        // The staging pool page-locks best effort: a buffer sharing a page with a registered
        // neighbour stays pageable, as CUDA refuses it. Which buffers neighbour depends on the
        // host heap, which the emulator's device memory shares and the size-only device's
        // does not: with megabytes of staging the two heaps part (the wide model's stage-3
        // offload registered 9450496 bytes on the emulator, 7870976 size-only). Equal
        // elsewhere, and held equal there.
        // The ledger's page-locked peak includes that staging: its other host peaks are
        // still held equal.
        if let Which::Gpt2Wide = which {
            let n = e.host.len() - 1;
            let host_equal = e.host[..n] == m.host[..n];
            diffs.retain(|d| {
                !(d.starts_with("page-locked") || host_equal && d.starts_with("host ledger"))
            });
        }
        eprintln!(
            "| {what} rank {rank} | peak {} reserved {} mallocs {} | launches {} copies {} syncs {} | trace {} | page-locked {} / {} | {} |",
            m.stats.peak_live,
            m.stats.peak_reserved,
            m.stats.driver_allocs,
            m.activity.kernel_launches,
            m.activity.copies,
            m.activity.host_syncs,
            m.trace.len(),
            e.page_locked,
            m.page_locked,
            if !diffs.is_empty() {
                "DIFFERENT"
            } else if c.host_params() || c.meta_comm() {
                "allocator, page-locked and host ledger equal; copies not compared"
            } else if c.threaded() {
                "equal as a multiset, live peak aside"
            } else {
                "equal"
            }
        );
        if !diffs.is_empty() {
            failures.push(format!("{what} rank {rank}: {}", diffs.join("; ")));
        }
    }
}

/// Every way two complete runs of a comm worker differ. Its thread issues beside the compute
/// thread as their timing falls, so on the emulator alone two runs issue in different orders
/// (event numbers included) and peak a few hundred bytes apart: what is compared is what the
/// timing does not move, the operations issued (as a multiset, events unnumbered), the
/// counts, and the allocator's counters but the live peak.
fn threaded_differences(e: &Seen, m: &Seen) -> Vec<String> {
    let unordered = |s: &Seen| {
        let mut ops: Vec<String> = s
            .trace
            .iter()
            .map(|(st, op)| match op {
                TraceOp::Record(_) => format!("{st:?} Record"),
                TraceOp::Wait(_) => format!("{st:?} Wait"),
                TraceOp::HostWaitEvent(_) => format!("{st:?} HostWaitEvent"),
                op => format!("{st:?} {op:?}"),
            })
            .collect();
        ops.sort();
        ops
    };
    let without_peak = |s: &Seen| AllocatorStats {
        peak_live: 0,
        ..s.stats
    };
    let (ue, um) = (unordered(e), unordered(m));
    let mut diffs = differences(e, m);
    diffs.retain(|d| !d.starts_with("trace") && !d.starts_with("allocator"));
    if ue != um {
        diffs.push(format!("operations: {}", first_difference(&ue, &um)));
    }
    if without_peak(e) != without_peak(m) {
        diffs.push(format!("allocator {:?} vs {:?}", e.stats, m.stats));
    }
    eprintln!(
        "  live peak {} on the emulator, {} size-only (timing-dependent with a comm worker)",
        e.stats.peak_live, m.stats.peak_live
    );
    diffs
}

/// Every way two complete runs differ.
fn differences(e: &Seen, m: &Seen) -> Vec<String> {
    let mut diffs = Vec::new();
    if let Some(err) = &m.error {
        diffs.push(format!("the size-only run failed: {err}"));
    }
    if e.stats != m.stats {
        diffs.push(format!("allocator {:?} vs {:?}", e.stats, m.stats));
    }
    if e.activity != m.activity {
        diffs.push(format!("activity {:?} vs {:?}", e.activity, m.activity));
    }
    if e.page_locked != m.page_locked {
        diffs.push(format!(
            "page-locked {} vs {}",
            e.page_locked, m.page_locked
        ));
    }
    if e.trace != m.trace {
        diffs.push(format!("trace: {}", first_difference(&e.trace, &m.trace)));
    }
    if e.host != m.host {
        diffs.push(format!("host ledger {:?} vs {:?}", e.host, m.host));
    }
    if e.skipped != m.skipped {
        diffs.push(format!("skipped {:?} vs {:?}", e.skipped, m.skipped));
    }
    diffs
}

/// Every way two runs differ in what they allocate, page-lock and hold on the host, and the
/// steps they take, where the issued work is not comparable: parameter uploads from a
/// size-only host copy nothing, and a `MetaComm` standing for two ranks moves nothing where
/// the local communicator's device arithmetic copies and adds (`threaded`: a comm worker's
/// timing moves the live peak, as on the emulator alone). The ledger's page-locked peak may
/// exceed the emulator's by less than a page per group: the emulator's driver refuses to
/// register a small host shard sharing a page with a registered one (best effort), the
/// size-only host counts every shard as registered.
fn host_side_differences(e: &Seen, m: &Seen, threaded: bool) -> Vec<String> {
    let mut diffs = differences(e, m);
    diffs.retain(|d| {
        !["trace", "activity", "host ledger", "allocator"]
            .iter()
            .any(|p| d.starts_with(p))
    });
    let without_peak = |s: &Seen| AllocatorStats {
        peak_live: if threaded { 0 } else { s.stats.peak_live },
        ..s.stats
    };
    if without_peak(e) != without_peak(m) {
        diffs.push(format!("allocator {:?} vs {:?}", e.stats, m.stats));
    }
    let n = e.host.len() - 1;
    let (locked_e, locked_m) = (e.host[n], m.host[n]);
    if e.host[..n] != m.host[..n] || locked_m < locked_e || locked_m - locked_e >= 64 << 10 {
        diffs.push(format!("host ledger {:?} vs {:?}", e.host, m.host));
    }
    if locked_m != locked_e {
        eprintln!("  ledger's page-locked peak {locked_e} on the emulator, {locked_m} size-only");
    }
    diffs
}

/// The sweep: every stage at one and two ranks, bf16 and fp16, the optimizer's state offloaded,
/// stage 3's parameters offloaded, activation checkpointing on and off, communication
/// overlapped or not.
fn cases() -> Vec<Case> {
    use Offload::*;
    use ZeroStage::*;
    let case = |stage, world, fp16, offload, ckpt, overlap| Case {
        stage,
        world,
        fp16,
        offload,
        ckpt,
        overlap,
    };
    vec![
        case(Stage0, 1, false, None, false, false),
        case(Stage1, 1, true, None, true, false),
        case(Stage2, 1, false, Optimizer, true, false),
        case(Stage3, 1, true, OptimizerAndParams, false, false),
        case(Stage3, 1, false, None, true, true),
        case(Stage0, 2, true, None, true, false),
        case(Stage1, 2, false, Optimizer, false, false),
        case(Stage2, 2, true, None, false, false),
        case(Stage2, 2, false, None, true, true),
        case(Stage3, 2, false, OptimizerAndParams, true, true),
        case(Stage3, 2, true, Optimizer, false, false),
    ]
}

fn sweep(which: Which) {
    let _one = serial();
    let mut failures = Vec::new();
    for c in cases() {
        compare(which, c, &mut failures);
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn gpt2_tiny_allocates_launches_and_copies_as_on_the_emulator() {
    sweep(Which::Gpt2);
}

#[test]
fn llama_tiny_allocates_launches_and_copies_as_on_the_emulator() {
    sweep(Which::Llama);
}

/// The wide GPT-2 at the sweep's corners: two ranks with the state on the device, stage 3 at
/// one rank with everything offloaded.
#[test]
fn gpt2_wide_allocates_launches_and_copies_as_on_the_emulator() {
    use ZeroStage::*;
    let _one = serial();
    let mut failures = Vec::new();
    for (stage, world, offload, ckpt) in [
        (Stage2, 2, Offload::None, false),
        (Stage3, 1, Offload::OptimizerAndParams, true),
    ] {
        let c = Case {
            stage,
            world,
            fp16: false,
            offload,
            ckpt,
            overlap: false,
        };
        compare(Which::Gpt2Wide, c, &mut failures);
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// 40 GiB of operands and result, more than this machine's memory, zeroed and multiplied on
/// the size-only H100: the allocator's peak and reserve are their sizes to the byte, and the
/// process's resident memory barely moves. Past the device's 80 GiB, the refusal is the
/// device's out-of-memory error.
#[test]
fn size_only_device_prices_more_than_the_host_holds() {
    use ferrozero_runtime::backend::{Epilogue, MatmulShape, Transpose};
    let _one = serial();
    let before = resident();
    let dev = cuda::meta(DType::Bf16, DeviceInfo::h100_sizes_only(None)).unwrap();
    let be: Arc<dyn Backend> = dev.clone();
    assert!(be.name().contains("size-only"), "{}", be.name());
    let (m, k, n) = (1usize << 16, 1usize << 17, 1usize << 16);
    let a = be.zeros(DType::Bf16, m * k).unwrap();
    let b = be.zeros(DType::Bf16, k * n).unwrap();
    let mut c = be.buffer_uninit(DType::Bf16, m * n).unwrap();
    let shape = MatmulShape {
        m,
        n,
        k,
        ta: Transpose::No,
        tb: Transpose::No,
    };
    be.matmul(shape, a.view(), b.view(), c.view_mut(), Epilogue::Store)
        .unwrap();
    let want = 2 * (m * k + k * n + m * n) as u64;
    assert_eq!(want, 40 << 30);
    let mem = be.memory_stats().unwrap();
    assert_eq!((mem.peak, mem.reserved, mem.live), (want, want, want));
    assert_eq!(dev.device().driver().allocated(), want);
    let grown = resident().saturating_sub(before);
    eprintln!("{want} bytes on the size-only device; resident memory grew {grown} bytes");
    assert!(grown < 256 << 20, "resident memory grew {grown} bytes");
    // 42 GiB more than the 40 live: past the 80 GiB.
    match be.zeros(DType::Bf16, 21 << 30) {
        Err(ferrozero_runtime::Error::DeviceMemory { limit, .. }) => {
            assert_eq!(limit, driver::H100_MEMORY)
        }
        Err(e) => panic!("expected the device's out-of-memory refusal, got {e}"),
        Ok(_) => panic!("42 GiB more fit beside 40 GiB on an 80 GiB device"),
    }
    drop((a, b, c));
    assert_eq!(be.memory_stats().unwrap().live, 0);
}

/// `detail` with every hexadecimal address and every device number replaced (the two
/// devices' differ).
fn without_addresses(detail: &str) -> String {
    let mut out = String::new();
    let mut rest = detail;
    while let Some(i) = rest.find("0x") {
        out.push_str(&rest[..i]);
        out.push_str("ADDR");
        rest = rest[i + 2..].trim_start_matches(|c: char| c.is_ascii_hexdigit());
    }
    out.push_str(rest);
    let mut parts = out.split("device ");
    let mut norm = parts.next().unwrap_or_default().to_string();
    for part in parts {
        norm.push_str("device ");
        norm.push_str(part.trim_start_matches(|c: char| c.is_ascii_digit()));
    }
    norm
}

/// Each refusal as (call, detail without addresses); a call that succeeds is a failure.
fn refusals(d: &dyn Driver) -> Vec<(String, String)> {
    let s = StreamKind::Compute;
    let p = d.malloc(1000).unwrap();
    let mut host = vec![0u8; 2000];
    let name = driver::builtin_programs()[0].kernels[0].clone();
    let k = d.kernel(&name).unwrap_or_else(|e| panic!("{name}: {e}"));
    let e = d.event_create().unwrap();
    d.event_destroy(e).unwrap();
    let too_wide = LaunchConfig::linear(1, 2048);
    let too_much_smem = LaunchConfig {
        dyn_smem: 300 << 10,
        ..LaunchConfig::linear(1, 32)
    };
    let results: Vec<ferrozero_runtime::Result<()>> = vec![
        d.malloc(0).map(|_| ()),
        d.copy_htod(&host, p, s),
        d.copy_dtoh(p.offset(512), &mut host[..1000], s),
        d.copy_dtod(p, p.offset(256), 512, s),
        d.memset_zero(p.offset(1000), 1, s),
        d.kernel("no_such_kernel").map(|_| ()),
        // SAFETY: refused before any parameter is read.
        unsafe { d.launch(k, &too_wide, &mut [], s) },
        // SAFETY: as above.
        unsafe { d.launch(k, &too_much_smem, &mut [], s) },
        d.event_record(e, s),
        // An upload on the copy stream, then the compute stream touching the same bytes
        // without an event between: the order check refuses it.
        // SAFETY: `host` outlives the (synchronous, or never performed) copy.
        unsafe { d.copy_htod_async(&host[..8], p, StreamKind::HostToDevice) }
            .and_then(|()| d.memset_zero(p, 8, s)),
        // SAFETY: `p` is freed once; every use after is refused.
        unsafe { d.free(p) }.and_then(|()| d.memset_zero(p, 8, s)),
        // SAFETY: as above.
        unsafe { d.free(p) },
    ];
    results
        .into_iter()
        .map(|r| match r {
            Err(ferrozero_runtime::Error::Device { op, detail }) => {
                (op, without_addresses(&detail))
            }
            other => panic!("expected a device refusal, got {other:?}"),
        })
        .collect()
}

/// Out-of-range and overlapping copies, memsets past an allocation, freed pointers, bad launch
/// configurations, unknown kernels, dead events and streams not ordered by an event: refused by the size-only driver with the
/// emulator's words.
#[test]
fn refusals_read_as_the_emulators() {
    let _one = serial();
    let emu = driver::emulated().expect("the emulated device");
    let meta = MetaDriver::new(DeviceInfo::h100_sizes_only(None)).unwrap();
    let (want, got) = (refusals(&*emu), refusals(&meta));
    for (w, g) in want.iter().zip(&got) {
        eprintln!("{}: {}", g.0, g.1);
        assert_eq!(w, g);
    }
    assert_eq!(want.len(), got.len());
}

/// The size-only device's own promises: addresses aligned, never 0 and never shared between
/// devices; downloads leave the host buffer as it was; registration counts host bytes
/// without touching them; every builtin kernel resolves without a compiler; its memory is
/// the caller's and its description says it is size-only.
#[test]
fn size_only_driver_keeps_its_promises() {
    let _one = serial();
    let info = DeviceInfo::h100_sizes_only(Some(3 << 20));
    let (a, b) = (
        MetaDriver::new(info.clone()).unwrap(),
        MetaDriver::new(info).unwrap(),
    );
    let (p, q) = (a.malloc(1000).unwrap(), b.malloc(1000).unwrap());
    for x in [p, q] {
        assert!(!x.is_null() && x.0 % 256 == 0, "{x}");
    }
    assert!(p.0.abs_diff(q.0) >= 1000, "{p} and {q} overlap");
    let mut host = vec![0xABu8; 1000];
    a.copy_dtoh(p, &mut host, StreamKind::Compute).unwrap();
    // SAFETY: `host` outlives the copy, which the size-only device never performs.
    unsafe { a.copy_dtoh_async(p, &mut host[..], StreamKind::DeviceToHost) }.unwrap();
    assert!(
        host.iter().all(|&x| x == 0xAB),
        "a download wrote the host buffer"
    );
    let mut pinned = vec![0x5Au8; 8192];
    // SAFETY: `pinned` outlives its registration.
    unsafe { a.host_register(pinned.as_mut_ptr(), pinned.len()) }.unwrap();
    assert_eq!(a.registered_host_bytes(), 8192);
    // SAFETY: registered above.
    unsafe { a.host_unregister(pinned.as_mut_ptr()) }.unwrap();
    assert_eq!(a.registered_host_bytes(), 0);
    assert!(pinned.iter().all(|&x| x == 0x5A));
    for prog in driver::builtin_programs() {
        for k in &prog.kernels {
            a.kernel(k).unwrap_or_else(|e| panic!("{k}: {e}"));
        }
    }
    match a.malloc(3 << 20) {
        Err(ferrozero_runtime::Error::DeviceMemory { limit, detail, .. }) => {
            assert_eq!(limit, 3 << 20);
            assert!(detail.contains("size-only device"), "{detail}");
        }
        other => panic!("expected out of memory, got {other:?}"),
    }
    let shown = a.info().to_string();
    assert!(a.info().sizes_only && !a.info().emulated, "{shown}");
    assert!(
        shown.contains("NVIDIA H100 80GB HBM3") && shown.contains("size-only"),
        "{shown}"
    );
}
