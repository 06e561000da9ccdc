//! Property tests of the `local` communicator: every collective equals the sequential
//! reference bit for bit, for random sizes (zero and non-divisible included), world sizes
//! 1 to 8 and every dtype, and repeated runs give identical bits.

use std::fmt::Debug;
use std::time::Duration;

use ferrozero_runtime::comm::local::run_ranks;
use ferrozero_runtime::comm::reference::{self, RefElem};
use ferrozero_runtime::comm::{BufMut, BufRef, Communicator, ReduceOp};
use half::{bf16, f16};
use proptest::prelude::*;

const TIMEOUT: Duration = Duration::from_secs(30);

/// An element type usable in these tests.
trait El: RefElem + Send + Sync + Debug + 'static {
    fn bits(self) -> u32;
}
impl El for f32 {
    fn bits(self) -> u32 {
        self.to_bits()
    }
}
impl El for bf16 {
    fn bits(self) -> u32 {
        self.to_bits().into()
    }
}
impl El for f16 {
    fn bits(self) -> u32 {
        self.to_bits().into()
    }
}

/// Deterministic pseudo-random values spanning several magnitudes, so that rounding and
/// summation order matter.
fn values<T: El>(seed: u64, rank: usize, len: usize) -> Vec<T> {
    let mut s = seed ^ (rank as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (0..len)
        .map(|_| {
            s = s
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            let u = (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            let scale = [1e-3f32, 1.0, 37.0, 900.0][(s >> 20) as usize % 4];
            T::narrow(u * scale)
        })
        .collect()
}

fn bits<T: El>(v: &[T]) -> Vec<u32> {
    v.iter().map(|x| x.bits()).collect()
}

/// Every rank's outputs of all four collectives.
#[derive(Debug, PartialEq)]
struct Outputs {
    all_reduce: Vec<u32>,
    reduce_scatter: Vec<u32>,
    all_gather: Vec<u32>,
    broadcast: Vec<u32>,
}

fn run_all<T: El>(
    world: usize,
    len: usize,
    m: usize,
    seed: u64,
    op: ReduceOp,
    root: usize,
) -> Vec<Outputs>
where
    for<'a> &'a mut [T]: Into<BufMut<'a>>,
    for<'a> &'a [T]: Into<BufRef<'a>>,
{
    run_ranks(world, TIMEOUT, |c: Box<dyn Communicator>| {
        let r = c.rank();
        let mut ar = values::<T>(seed, r, len);
        c.all_reduce((&mut ar[..]).into(), op)?;
        let rs_in = values::<T>(seed ^ 1, r, m * world);
        let mut rs_out = vec![T::narrow(0.0); m];
        c.reduce_scatter((&rs_in[..]).into(), (&mut rs_out[..]).into(), op)?;
        let ag_in = values::<T>(seed ^ 2, r, m);
        let mut ag_out = vec![T::narrow(0.0); m * world];
        c.all_gather((&ag_in[..]).into(), (&mut ag_out[..]).into())?;
        let mut bc = values::<T>(seed ^ 3, r, len);
        c.broadcast((&mut bc[..]).into(), root)?;
        c.barrier()?;
        Ok(Outputs {
            all_reduce: bits(&ar),
            reduce_scatter: bits(&rs_out),
            all_gather: bits(&ag_out),
            broadcast: bits(&bc),
        })
    })
    .expect("collectives succeed")
}

fn expected<T: El>(
    world: usize,
    len: usize,
    m: usize,
    seed: u64,
    op: ReduceOp,
    root: usize,
) -> Vec<Outputs> {
    let inputs =
        |s: u64, l: usize| -> Vec<Vec<T>> { (0..world).map(|r| values::<T>(s, r, l)).collect() };
    let ar = bits(&reference::all_reduce(&inputs(seed, len), op));
    let rs = inputs(seed ^ 1, m * world);
    let ag = bits(&reference::all_gather(&inputs(seed ^ 2, m)));
    let bc = bits(&inputs(seed ^ 3, len)[root]);
    (0..world)
        .map(|r| Outputs {
            all_reduce: ar.clone(),
            reduce_scatter: bits(&reference::reduce_scatter(&rs, op, r)),
            all_gather: ag.clone(),
            broadcast: bc.clone(),
        })
        .collect()
}

fn check<T: El>(world: usize, len: usize, m: usize, seed: u64, op: ReduceOp, root: usize)
where
    for<'a> &'a mut [T]: Into<BufMut<'a>>,
    for<'a> &'a [T]: Into<BufRef<'a>>,
{
    let got = run_all::<T>(world, len, m, seed, op, root);
    let want = expected::<T>(world, len, m, seed, op, root);
    for (r, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g, w, "rank {r} of {world}, len {len}, m {m}, {op:?}");
    }
}

fn op_strategy() -> impl Strategy<Value = ReduceOp> {
    prop_oneof![
        Just(ReduceOp::Sum),
        Just(ReduceOp::Avg),
        Just(ReduceOp::Max)
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 40, ..ProptestConfig::default() })]

    #[test]
    fn collectives_match_the_sequential_reference(
        world in 1usize..=8,
        len in prop_oneof![Just(0usize), 0usize..200, 0usize..9000],
        m in prop_oneof![Just(0usize), 0usize..700],
        seed in any::<u64>(),
        op in op_strategy(),
        root_pick in any::<usize>(),
        dtype in 0u8..3,
    ) {
        let root = root_pick % world;
        match dtype {
            0 => check::<f32>(world, len, m, seed, op, root),
            1 => check::<bf16>(world, len, m, seed, op, root),
            _ => check::<f16>(world, len, m, seed, op, root),
        }
    }

    #[test]
    fn results_are_bitwise_reproducible(
        world in 2usize..=8,
        len in 1usize..20_000,
        seed in any::<u64>(),
        dtype in 0u8..3,
    ) {
        let run = || match dtype {
            0 => run_all::<f32>(world, len, len / world, seed, ReduceOp::Sum, 0),
            1 => run_all::<bf16>(world, len, len / world, seed, ReduceOp::Avg, 0),
            _ => run_all::<f16>(world, len, len / world, seed, ReduceOp::Sum, 0),
        };
        let first = run();
        for _ in 0..3 {
            prop_assert_eq!(&run(), &first);
        }
    }
}

#[test]
fn large_all_reduce_crosses_many_blocks_and_matches() {
    check::<f32>(3, 300_001, 50_000, 7, ReduceOp::Sum, 2);
    check::<bf16>(5, 123_457, 10_007, 8, ReduceOp::Avg, 4);
}

#[test]
fn sum_is_in_rank_order_not_pairwise() {
    // ((1e8 + 1) - 1e8) is 0 in f32, whereas pairing ranks 0 and 2 first would give 1.
    let out = run_ranks(3, TIMEOUT, |c: Box<dyn Communicator>| {
        let mut v = [[1e8f32, 1.0, -1e8][c.rank()]];
        c.all_reduce(BufMut::F32(&mut v), ReduceOp::Sum)?;
        Ok(v[0])
    })
    .unwrap();
    assert_eq!(out, vec![0.0; 3]);
}
