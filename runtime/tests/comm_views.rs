//! The collectives' test bodies, written once and run on every kind of buffer the engine
//! hands a communicator (burn's one suite for all backends): host memory, and device memory
//! of the CUDA backend on its CPU emulator, with one device per rank (as `train_gpt --ranks N
//! --device cuda` opens them: every exchange is a copy between two devices' memory) and with
//! one device shared by every rank (as the engine tests run). Every result is compared bit
//! for bit with the sequential reference, whose sums are in rank order.

use std::sync::Arc;
use std::time::Duration;

use ferrozero_runtime::backend::{self, Backend};
use ferrozero_runtime::comm::local::run_ranks;
use ferrozero_runtime::comm::reference::{self, RefElem};
use ferrozero_runtime::comm::{Communicator, ReduceOp};
use ferrozero_runtime::tensor::{DType, FlatBuf, Storage};
use ferrozero_runtime::{Error, Result};
use half::bf16;

const TIMEOUT: Duration = Duration::from_secs(60);

/// Makes each rank's buffers in one kind of memory.
struct Maker {
    name: &'static str,
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
}

/// The maker called `name` for `world` ranks, or `None` (with a line saying why) when this
/// build has no such memory.
fn maker(name: &'static str, world: usize) -> Option<Maker> {
    let backends: Vec<Arc<dyn Backend>> = match name {
        "host" => vec![backend::cpu()],
        "cuda_emu_per_rank" => (0..world).map(|_| emulated()).collect::<Option<_>>()?,
        _ => vec![emulated()?],
    };
    Some(Maker { name, backends })
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

/// Runs `body` for world sizes 1 to 4 on the memory `place` names.
fn run(place: &'static str, body: fn(&Maker, usize)) {
    for world in 1..=4 {
        let Some(m) = maker(place, world) else { return };
        body(&m, world);
    }
}

/// One test per kind of memory for a body `fn(&Maker, world)`.
macro_rules! on_every_memory {
    ($body:ident) => {
        mod $body {
            #[test]
            fn host() {
                super::run("host", super::$body);
            }
            #[test]
            fn cuda_emu_per_rank() {
                super::run("cuda_emu_per_rank", super::$body);
            }
            #[test]
            fn cuda_emu_shared() {
                super::run("cuda_emu_shared", super::$body);
            }
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

/// Rank `rank`'s results of `f` for every rank, or the first error.
fn on_ranks<T: Send>(world: usize, f: impl Fn(&dyn Communicator) -> Result<T> + Sync) -> Vec<T> {
    run_ranks(world, TIMEOUT, |c| f(&*c)).expect("the collective succeeds")
}

fn all_reduce_matches_the_reference(m: &Maker, world: usize) {
    for dtype in DTYPES {
        for op in OPS {
            for len in LENGTHS {
                let seed = len as u64 * 31 + 7;
                let got = on_ranks(world, |c| {
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
on_every_memory!(all_reduce_matches_the_reference);

fn reduce_scatter_matches_the_reference(m: &Maker, world: usize) {
    for dtype in DTYPES {
        for op in OPS {
            for per in [0, 1, 67, 300] {
                let (seed, len) = (per as u64 * 13 + 3, per * world);
                let got = on_ranks(world, |c| {
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
on_every_memory!(reduce_scatter_matches_the_reference);

fn all_gather_and_broadcast_copy_exactly(m: &Maker, world: usize) {
    for dtype in DTYPES {
        for per in [0, 1, 67, 300] {
            let seed = per as u64 + 99;
            let got = on_ranks(world, |c| {
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
on_every_memory!(all_gather_and_broadcast_copy_exactly);

/// `((1e8 + 1) - 1e8)` is 0 in f32, whereas any other association of three ranks gives 1:
/// the sum is in rank order on every kind of memory; and `Max` keeps a NaN from any rank.
fn sums_are_in_rank_order(m: &Maker, world: usize) {
    if world != 3 {
        return;
    }
    let got = on_ranks(3, |c| {
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
on_every_memory!(sums_are_in_rank_order);

/// Ranks that disagree (lengths; host against device memory; input and output in different
/// places) get an error on every rank, naming the mismatch, never a hang or a wrong result.
fn mismatches_are_errors_on_every_rank(m: &Maker, world: usize) {
    if world < 2 {
        return;
    }
    let outcome = |f: &(dyn Fn(&dyn Communicator) -> Result<()> + Sync)| -> Vec<Error> {
        let comms = ferrozero_runtime::comm::local::LocalComm::group(world, TIMEOUT);
        std::thread::scope(|s| {
            let hs: Vec<_> = comms.into_iter().map(|c| s.spawn(move || f(&c))).collect();
            hs.into_iter()
                .map(|h| h.join().expect("no panic").expect_err("a mismatch fails"))
                .collect()
        })
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
    let host = maker("host", world).expect("host memory");
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
on_every_memory!(mismatches_are_errors_on_every_rank);
