//! The collectives' test bodies, written once and run on every communicator this build can
//! run in one process and every kind of buffer the engine hands one (burn's one suite for
//! all backends, as `test_device!` is for devices). Communicators: `local` (ranks as threads)
//! and `nccl_fake` (the NCCL communicator over the fake library, rank-ordered sums as
//! `comms.reduction = "rank_ordered"` asks; a GPU's real NCCL runs under `ferrozero launch`).
//! MPI's ranks are processes, so its bodies run under `mpirun` in `comm_mpi.rs`. Memory: host,
//! and device memory of the CUDA backend on its CPU emulator, with one device per rank (as
//! `train_gpt --ranks N --device cuda` opens them: every exchange is a copy between two
//! devices' memory) and with one device shared by every rank (as the engine tests run).
//! Every result is compared bit for bit with the sequential reference, whose sums are in rank
//! order.

use std::sync::Arc;
use std::time::Duration;

use ferrozero_runtime::backend::{self, Backend};
use ferrozero_runtime::comm::local::LocalComm;
use ferrozero_runtime::comm::nccl::fake::FakeNccl;
use ferrozero_runtime::comm::nccl::{NcclComm, NcclOptions};
use ferrozero_runtime::comm::reference::{self, RefElem};
use ferrozero_runtime::comm::store::{JobSecret, StoreServer, TcpStore};
use ferrozero_runtime::comm::{Communicator, ReduceOp};
use ferrozero_runtime::tensor::{DType, FlatBuf, Storage};
use ferrozero_runtime::{Error, Result};
use half::bf16;

const TIMEOUT: Duration = Duration::from_secs(60);

/// Runs `f` on every rank of a fresh `world`-rank group of the communicator `comm`, each
/// rank on its own thread, and returns every rank's outcome in rank order.
fn each_rank<T: Send>(
    comm: &str,
    world: usize,
    f: &(dyn Fn(&dyn Communicator) -> Result<T> + Sync),
) -> Vec<Result<T>> {
    match comm {
        "local" => std::thread::scope(|s| {
            let hs: Vec<_> = LocalComm::group(world, TIMEOUT)
                .into_iter()
                .map(|c| s.spawn(move || f(&c)))
                .collect();
            hs.into_iter()
                .map(|h| h.join().expect("no panic"))
                .collect()
        }),
        "nccl_fake" => nccl_fake_ranks(world, f),
        other => panic!("no communicator {other}: add its arm here"),
    }
}

/// NCCL's ranks initialise together (rank 0 publishes the unique id through the store), so
/// each one is made on its own thread.
fn nccl_fake_ranks<T: Send>(
    world: usize,
    f: &(dyn Fn(&dyn Communicator) -> Result<T> + Sync),
) -> Vec<Result<T>> {
    let secret = JobSecret::new("comm_views' store secret").expect("secret");
    let srv = StoreServer::bind("127.0.0.1:0".parse().unwrap(), secret.clone()).expect("store");
    let (lib, addr) = (FakeNccl::default(), srv.addr());
    let opts = NcclOptions {
        timeout: TIMEOUT,
        deterministic: true,
    };
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..world)
            .map(|r| {
                let (lib, secret, opts) = (&lib, &secret, opts.clone());
                s.spawn(move || {
                    let store = Arc::new(TcpStore::connect(addr, TIMEOUT, secret)?);
                    let c = NcclComm::init(lib, store, "views", (r, world), opts)?;
                    f(&c)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("no panic"))
            .collect()
    })
}

/// Makes each rank's buffers in one kind of memory, and runs them on one communicator.
struct Maker {
    name: &'static str,
    /// The communicator, a row of [`test_comm!`].
    comm: &'static str,
    /// The backend rank `r` allocates on (`r % len`).
    backends: Vec<Arc<dyn Backend>>,
}

impl Maker {
    /// `values` (rounded to `dtype`) in rank `rank`'s memory.
    fn put(&self, rank: usize, dtype: DType, values: &[f32]) -> Storage {
        let mut b = FlatBuf::zeros(dtype, values.len());
        b.store_f32(0, values);
        let be = &self.backends[rank % self.backends.len()];
        be.upload(b.as_ref()).expect("upload")
    }

    /// Whether these buffers are device memory.
    fn on_device(&self) -> bool {
        self.name != "host"
    }

    /// Every rank's result of `f`, in rank order; a failure on any rank fails the test.
    fn on_ranks<T: Send>(
        &self,
        world: usize,
        f: impl Fn(&dyn Communicator) -> Result<T> + Sync,
    ) -> Vec<T> {
        each_rank(self.comm, world, &f)
            .into_iter()
            .enumerate()
            .map(|(r, o)| o.unwrap_or_else(|e| panic!("{} rank {r}/{world}: {e}", self.comm)))
            .collect()
    }
}

/// The maker called `name` for `world` ranks on `comm`, or `None` (with a line saying why)
/// when this build has no such memory.
fn maker(comm: &'static str, name: &'static str, world: usize) -> Option<Maker> {
    let backends: Vec<Arc<dyn Backend>> = match name {
        "host" => vec![backend::cpu()],
        "cuda_emu_per_rank" => (0..world).map(|_| emulated()).collect::<Option<_>>()?,
        _ => vec![emulated()?],
    };
    Some(Maker {
        name,
        comm,
        backends,
    })
}

#[cfg(feature = "cuda")]
fn emulated() -> Option<Arc<dyn Backend>> {
    match backend::cuda::emulated(DType::F32) {
        Ok(b) => Some(b),
        Err(e) => {
            backend::cuda::emu::skip_unless_required(&format!("no emulated device: {e}"));
            None
        }
    }
}

#[cfg(not(feature = "cuda"))]
fn emulated() -> Option<Arc<dyn Backend>> {
    eprintln!("skipped: this build has no CUDA backend (build with --features cuda)");
    None
}

/// Runs `body` for world sizes 1 to 4 on communicator `comm` with the memory `place` names.
fn run(comm: &'static str, place: &'static str, body: fn(&Maker, usize)) {
    for world in 1..=4 {
        let Some(m) = maker(comm, place, world) else {
            return;
        };
        body(&m, world);
    }
}

/// One test per kind of memory on communicator `$comm`.
macro_rules! on_every_memory {
    ($comm:ident, $body:ident) => {
        mod $comm {
            #[test]
            fn host() {
                super::super::run(stringify!($comm), "host", super::super::$body);
            }
            #[test]
            fn cuda_emu_per_rank() {
                super::super::run(stringify!($comm), "cuda_emu_per_rank", super::super::$body);
            }
            #[test]
            fn cuda_emu_shared() {
                super::super::run(stringify!($comm), "cuda_emu_shared", super::super::$body);
            }
        }
    };
}

/// One test per communicator and kind of memory for a body `fn(&Maker, world)`, as
/// `test_device!` is for devices: a new communicator is one row here and its arm in
/// [`each_rank`].
macro_rules! test_comm {
    ($body:ident) => {
        mod $body {
            on_every_memory!(local, $body);
            on_every_memory!(nccl_fake, $body);
        }
    };
}

/// Deterministic values over several magnitudes, so rounding and summation order matter.
fn values(seed: u64, rank: usize, len: usize) -> Vec<f32> {
    let mut s = seed ^ (rank as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (0..len)
        .map(|_| {
            s = s
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            let u = (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            u * [1e-3f32, 1.0, 37.0, 900.0][(s >> 20) as usize % 4]
        })
        .collect()
}

/// The bits of a buffer's elements, wherever it lives.
fn bits(s: &Storage) -> Vec<u32> {
    match s.to_host().expect("download") {
        FlatBuf::F32(v) => v.iter().map(|x| x.to_bits()).collect(),
        FlatBuf::Bf16(v) => v.iter().map(|x| u32::from(x.to_bits())).collect(),
        FlatBuf::F16(v) => v.iter().map(|x| u32::from(x.to_bits())).collect(),
    }
}

fn ref_bits<T: RefElem>(v: &[T], f: impl Fn(&T) -> u32) -> Vec<u32> {
    v.iter().map(f).collect()
}

/// What `reference` computes on every rank's `values(seed, r, len)` rounded to `dtype`.
fn expected(
    dtype: DType,
    world: usize,
    seed: u64,
    len: usize,
    reference: &dyn Fn(&[Vec<f32>]) -> Vec<f32>,
    reference_bf16: &dyn Fn(&[Vec<bf16>]) -> Vec<bf16>,
) -> Vec<u32> {
    let inputs: Vec<Vec<f32>> = (0..world).map(|r| values(seed, r, len)).collect();
    match dtype {
        DType::F32 => ref_bits(&reference(&inputs), |x| x.to_bits()),
        _ => {
            let narrow: Vec<Vec<bf16>> = inputs
                .iter()
                .map(|v| v.iter().map(|&x| bf16::narrow(x)).collect())
                .collect();
            ref_bits(&reference_bf16(&narrow), |x| u32::from(x.to_bits()))
        }
    }
}

const DTYPES: [DType; 2] = [DType::F32, DType::Bf16];
const OPS: [ReduceOp; 3] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max];
/// Lengths that do not divide evenly among ranks or into the communicator's 64-element units.
const LENGTHS: [usize; 4] = [0, 1, 67, 1000];

fn all_reduce_matches_the_reference(m: &Maker, world: usize) {
    for dtype in DTYPES {
        for op in OPS {
            for len in LENGTHS {
                let seed = len as u64 * 31 + 7;
                let got = m.on_ranks(world, |c| {
                    let mut b = m.put(c.rank(), dtype, &values(seed, c.rank(), len));
                    c.all_reduce_view(b.view_mut(), op)?;
                    Ok(bits(&b))
                });
                let want = expected(
                    dtype,
                    world,
                    seed,
                    len,
                    &|i| reference::all_reduce(i, op),
                    &|i| reference::all_reduce(i, op),
                );
                for (r, g) in got.iter().enumerate() {
                    assert_eq!(
                        g, &want,
                        "{}: rank {r}/{world} {dtype:?} {op:?} len {len}",
                        m.name
                    );
                }
            }
        }
    }
}
test_comm!(all_reduce_matches_the_reference);

fn reduce_scatter_matches_the_reference(m: &Maker, world: usize) {
    for dtype in DTYPES {
        for op in OPS {
            for per in [0, 1, 67, 300] {
                let (seed, len) = (per as u64 * 13 + 3, per * world);
                let got = m.on_ranks(world, |c| {
                    let input = m.put(c.rank(), dtype, &values(seed, c.rank(), len));
                    let mut out = m.put(c.rank(), dtype, &vec![0.0; per]);
                    c.reduce_scatter_view(input.view(), out.view_mut(), op)?;
                    Ok(bits(&out))
                });
                let full = expected(
                    dtype,
                    world,
                    seed,
                    len,
                    &|i| reference::all_reduce(i, op),
                    &|i| reference::all_reduce(i, op),
                );
                for (r, g) in got.iter().enumerate() {
                    let want = &full[r * per..(r + 1) * per];
                    assert_eq!(
                        g, want,
                        "{}: rank {r}/{world} {dtype:?} {op:?} {per}",
                        m.name
                    );
                }
            }
        }
    }
}
test_comm!(reduce_scatter_matches_the_reference);

fn all_gather_and_broadcast_copy_exactly(m: &Maker, world: usize) {
    for dtype in DTYPES {
        for per in [0, 1, 67, 300] {
            let seed = per as u64 + 99;
            let got = m.on_ranks(world, |c| {
                let input = m.put(c.rank(), dtype, &values(seed, c.rank(), per));
                let mut out = m.put(c.rank(), dtype, &vec![0.0; per * world]);
                c.all_gather_view(input.view(), out.view_mut())?;
                let root = world - 1;
                let mut b = m.put(c.rank(), dtype, &values(seed ^ 5, c.rank(), per));
                c.broadcast_view(b.view_mut(), root)?;
                Ok((bits(&out), bits(&b)))
            });
            let gathered = expected(
                dtype,
                world,
                seed,
                per,
                &|i| reference::all_gather(i),
                &|i| reference::all_gather(i),
            );
            let root = m.put(world - 1, dtype, &values(seed ^ 5, world - 1, per));
            for (r, (g, b)) in got.iter().enumerate() {
                assert_eq!(
                    g, &gathered,
                    "{}: all_gather rank {r}/{world} {per}",
                    m.name
                );
                assert_eq!(
                    b,
                    &bits(&root),
                    "{}: broadcast rank {r}/{world} {per}",
                    m.name
                );
            }
        }
    }
}
test_comm!(all_gather_and_broadcast_copy_exactly);

/// `((1e8 + 1) - 1e8)` is 0 in f32, whereas any other association of three ranks gives 1:
/// the sum is in rank order on every kind of memory; and `Max` keeps a NaN from any rank.
fn sums_are_in_rank_order(m: &Maker, world: usize) {
    if world != 3 {
        return;
    }
    let got = m.on_ranks(3, |c| {
        let x = [1e8f32, 1.0, -1e8][c.rank()];
        let mut b = m.put(c.rank(), DType::F32, &[x; 130]);
        c.all_reduce_view(b.view_mut(), ReduceOp::Sum)?;
        let input = m.put(c.rank(), DType::F32, &[x; 3]);
        let mut out = m.put(c.rank(), DType::F32, &[7.0]);
        c.reduce_scatter_view(input.view(), out.view_mut(), ReduceOp::Sum)?;
        // An overflow on one rank stays visible through Max, whichever side the NaN is on.
        let row = [[f32::NAN, 1.0, 1.0], [2.0, f32::NAN, 1.0], [3.0, 3.0, 1.0]][c.rank()];
        let mut nan = m.put(c.rank(), DType::Bf16, &row);
        c.all_reduce_view(nan.view_mut(), ReduceOp::Max)?;
        Ok((b.to_vec_f32()?, out.to_vec_f32()?, nan.to_vec_f32()?))
    });
    for (all, mine, nan) in got {
        assert_eq!(all, vec![0.0; 130], "{}", m.name);
        assert_eq!(mine, vec![0.0], "{}", m.name);
        assert!(nan[0].is_nan() && nan[1].is_nan(), "{}: {nan:?}", m.name);
        assert_eq!(nan[2], 1.0, "{}", m.name);
    }
}
test_comm!(sums_are_in_rank_order);

/// Ranks that disagree (lengths; host against device memory; input and output in different
/// places) get an error on every rank, naming the mismatch, never a hang or a wrong result.
fn mismatches_are_errors_on_every_rank(m: &Maker, world: usize) {
    if world < 2 {
        return;
    }
    if m.comm == "nccl_fake" {
        // NCCL takes each rank's call on trust: ranks that disagree on a length make the
        // fake panic and a GPU's NCCL read past a buffer or hang. `NcclComm` has no
        // check-in of the calls (local's entry barrier, MPI's descriptor exchange) yet.
        eprintln!("skipped: the NCCL communicator does not check that ranks' calls match");
        return;
    }
    let outcome = |f: &(dyn Fn(&dyn Communicator) -> Result<()> + Sync)| -> Vec<Error> {
        each_rank(m.comm, world, f)
            .into_iter()
            .map(|o| o.expect_err("a mismatch fails"))
            .collect()
    };
    let errs = outcome(&|c| {
        let mut b = m.put(c.rank(), DType::F32, &vec![1.0; 10 + c.rank()]);
        c.all_reduce_view(b.view_mut(), ReduceOp::Sum)
    });
    for e in &errs {
        assert!(e.to_string().contains("mismatched"), "{}: {e}", m.name);
    }
    if !m.on_device() {
        return;
    }
    let host = maker(m.comm, "host", world).expect("host memory");
    let errs = outcome(&|c| {
        let place = if c.rank() == 0 { &host } else { m };
        let mut b = place.put(c.rank(), DType::F32, &[1.0; 8]);
        c.all_reduce_view(b.view_mut(), ReduceOp::Sum)
    });
    for e in &errs {
        assert!(e.to_string().contains("host"), "{}: {e}", m.name);
    }
    let errs = outcome(&|c| {
        let input = m.put(c.rank(), DType::F32, &vec![1.0; 4 * world]);
        let mut out = host.put(c.rank(), DType::F32, &[0.0; 4]);
        c.reduce_scatter_view(input.view(), out.view_mut(), ReduceOp::Sum)
    });
    for e in &errs {
        assert!(e.to_string().contains("one device"), "{}: {e}", m.name);
    }
}
test_comm!(mismatches_are_errors_on_every_rank);

/// Arbitrary 16-bit words (signalling NaN patterns included) in rank `rank`'s memory, as
/// ZeRO++'s packed quantized words travel.
fn words(m: &Maker, rank: usize, seed: u16, len: usize) -> Storage {
    let w: Vec<bf16> = (0..len)
        .map(|i| bf16::from_bits((i as u16).wrapping_mul(40_503) ^ seed ^ 0x7f81))
        .collect();
    let be = &m.backends[rank % m.backends.len()];
    be.upload(FlatBuf::Bf16(w).as_ref()).expect("upload")
}

fn word_bits(s: &Storage) -> Vec<u16> {
    match s.to_host().expect("download") {
        FlatBuf::Bf16(w) => w.iter().map(|x| x.to_bits()).collect(),
        _ => unreachable!("words are bf16 carriers"),
    }
}

/// `all_to_all`: rank `r`'s slot `k` is rank `k`'s slot `r`, every bit as sent.
fn all_to_all_copies_slots_exactly(m: &Maker, world: usize) {
    for per in [0, 1, 67] {
        let got = m.on_ranks(world, |c| {
            let input = words(m, c.rank(), c.rank() as u16 * 7919, per * world);
            let mut out = words(m, c.rank(), 1, per * world);
            c.all_to_all_view(input.view(), out.view_mut())?;
            Ok(word_bits(&out))
        });
        for (r, g) in got.iter().enumerate() {
            let want: Vec<u16> = (0..world)
                .flat_map(|k| {
                    let sent = word_bits(&words(m, k, k as u16 * 7919, per * world));
                    sent[r * per..(r + 1) * per].to_vec()
                })
                .collect();
            assert_eq!(g, &want, "{}: all_to_all rank {r}/{world} {per}", m.name);
        }
    }
}
test_comm!(all_to_all_copies_slots_exactly);
