//! Swap pipelines and the NVMe-resident tiled Adam step: the tiled step equals the in-memory
//! step bit for bit, pipelines deliver every tensor in order within the pool's bound, and a
//! corrupted tile stops the step with the documented error.

use ferrozero_offload::optim::{self, AdamHyper, LowPrecision, WeightDecay};
use ferrozero_offload::pipeline::{Prefetch, WriteBehind};
use ferrozero_offload::pool::{BufferPool, Pinning};
use ferrozero_offload::store::{AioSettings, EngineChoice, NvmeStore};
use ferrozero_offload::tiled::NvmeAdam;
use ferrozero_offload::Error;
use half::bf16;

const HP: AdamHyper = AdamHyper {
    lr: 2e-3,
    beta1: 0.9,
    beta2: 0.995,
    eps: 1e-8,
    weight_decay: 0.05,
    decay: WeightDecay::Decoupled,
    bias_correction: true,
};

fn settings(engine: EngineChoice) -> AioSettings {
    AioSettings {
        block_size: 8 << 10,
        engine,
        ..AioSettings::default()
    }
}

fn values(n: usize, seed: u32) -> Vec<f32> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x % 20_000) as f32 / 10_000.0 - 1.0
        })
        .collect()
}

#[test]
fn tiled_nvme_adam_equals_the_in_memory_step() {
    let n = 10_007;
    let sub_group = 1_000;
    for engine in [EngineChoice::Auto, EngineChoice::Threads] {
        let tmp = tempfile::tempdir().unwrap();
        let store = NvmeStore::open(tmp.path(), &settings(engine)).unwrap();
        let pool = BufferPool::new(3, sub_group * 12, Pinning::Locked).unwrap();
        let start = values(n, 7);
        let state = NvmeAdam::create(&store, &pool, "opt", &start, sub_group).unwrap();
        let (mut p, mut m, mut v) = (start.clone(), vec![0.0f32; n], vec![0.0f32; n]);
        let (mut lp_mem, mut lp_nvme) = (vec![bf16::ZERO; n], vec![bf16::ZERO; n]);
        for step in 1..=4u64 {
            let g = values(n, 100 + step as u32);
            optim::adam_step(
                &HP,
                step,
                0.25,
                &mut p,
                &g,
                &mut m,
                &mut v,
                LowPrecision::Bf16(&mut lp_mem),
            )
            .unwrap();
            state
                .adam_step(
                    &store,
                    &pool,
                    &HP,
                    step,
                    0.25,
                    &g,
                    LowPrecision::Bf16(&mut lp_nvme),
                )
                .unwrap();
        }
        let mut back = vec![0.0f32; n];
        state.read_params(&store, &pool, &mut back).unwrap();
        assert!(
            back.iter().zip(&p).all(|(a, b)| a.to_bits() == b.to_bits()),
            "{engine:?}"
        );
        assert!(lp_mem
            .iter()
            .zip(&lp_nvme)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
        assert_ne!(back, start, "the step changed something");
        assert_eq!(pool.available(), 3, "every buffer went back to the pool");
    }
}

#[test]
fn prefetch_and_write_behind_move_everything_in_order_within_the_pool() {
    let tmp = tempfile::tempdir().unwrap();
    let store = NvmeStore::open(tmp.path(), &settings(EngineChoice::Auto)).unwrap();
    let pool = BufferPool::new(2, 16 << 10, Pinning::Pageable).unwrap();
    let mut wb = WriteBehind::new(&store, 1);
    for i in 0..10u8 {
        let mut buf = pool.acquire();
        let len = 1000 + 997 * i as usize;
        buf[..len].fill(i);
        wb.push(&format!("k{i}"), buf, len).unwrap();
        assert!(pool.available() <= 2);
    }
    wb.flush().unwrap();
    let keys: Vec<String> = (0..10).map(|i| format!("k{i}")).collect();
    let reads = Prefetch::new(&store, &pool, keys, 4).unwrap();
    let mut seen = 0;
    for (i, s) in reads.enumerate() {
        let s = s.unwrap();
        assert_eq!(s.key, format!("k{i}"));
        assert_eq!(s.len, 1000 + 997 * i);
        assert!(s.bytes().iter().all(|&b| b == i as u8));
        seen += 1;
    }
    assert_eq!(seen, 10);
    let e = Prefetch::new(&store, &pool, vec!["missing".into()], 1)
        .err()
        .unwrap();
    assert!(e.to_string().contains("missing"), "{e}");
}

#[test]
fn a_corrupted_tile_stops_the_step_with_a_checksum_error() {
    let tmp = tempfile::tempdir().unwrap();
    let store = NvmeStore::open(tmp.path(), &settings(EngineChoice::Auto)).unwrap();
    let pool = BufferPool::new(2, 12_000, Pinning::Pageable).unwrap();
    let state = NvmeAdam::create(&store, &pool, "opt", &values(5_000, 3), 1_000).unwrap();
    let file = tmp.path().join("t-opt.3.swp");
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[100] ^= 1;
    std::fs::write(&file, &bytes).unwrap();
    let g = values(5_000, 4);
    let e = state
        .adam_step(&store, &pool, &HP, 1, 1.0, &g, LowPrecision::None)
        .unwrap_err();
    match e {
        Error::Corrupt { tensor, offset, .. } => {
            assert_eq!(tensor, "opt.3");
            assert_eq!(offset, 0);
        }
        e => panic!("expected Corrupt, got {e}"),
    }
    assert!(matches!(
        state.adam_step(&store, &pool, &HP, 1, 1.0, &g[1..], LowPrecision::None),
        Err(Error::Length { .. })
    ));
    let mut short = vec![bf16::ZERO; 10];
    assert!(state
        .adam_step(
            &store,
            &pool,
            &HP,
            1,
            1.0,
            &g,
            LowPrecision::Bf16(&mut short)
        )
        .is_err());
    assert!(
        NvmeAdam::create(&store, &pool, "big", &values(10, 1), 2_000).is_err(),
        "tile > buffer"
    );
}

/// VmRSS of this process in bytes.
fn rss() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = s.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib << 10
}

#[test]
fn a_meta_store_keeps_lengths_moves_nothing_and_never_fills() {
    let store = NvmeStore::meta(&settings(EngineChoice::Auto)).unwrap();
    assert!(store.is_meta());
    assert_eq!(store.engine().name(), "meta");
    store.write("a", &[7u8; 100]).unwrap();
    assert_eq!(store.len_of("a"), Some(100));
    let mut back = vec![1u8; 100];
    store.read("a", &mut back).unwrap();
    assert!(
        back.iter().all(|&b| b == 1),
        "a meta read leaves its buffer as it was"
    );
    assert!(matches!(
        store.read("a", &mut [0u8; 99]),
        Err(Error::Length { .. })
    ));
    assert!(
        store.read("b", &mut [0u8; 1]).is_err(),
        "an unknown key is refused"
    );
    assert_eq!(store.bytes_moved().written, 100);

    // Half a billion parameters of master weights and moments: 6 GB of tiles, none of them
    // filled, written or stepped, so neither the time nor the resident memory grows.
    let (n, tile) = (500_000_000usize, 50_000_000usize);
    let pool = BufferPool::new(4, tile * 12, Pinning::Pageable).unwrap();
    let before = rss();
    let t = std::time::Instant::now();
    let state = NvmeAdam::create_with(&store, &pool, "opt", n, tile, |_, _| {
        panic!("a meta store never asks for values")
    })
    .unwrap();
    assert_eq!(store.len_of("opt.9"), Some(tile * 12));
    assert_eq!(state.len(), n);
    let mut lp = vec![bf16::ZERO; 0];
    let short = state.adam_step(&store, &pool, &HP, 1, 1.0, &[], LowPrecision::Bf16(&mut lp));
    assert!(
        matches!(short, Err(Error::Length { .. })),
        "lengths are still checked"
    );
    let grown = rss().saturating_sub(before);
    assert!(grown < 64 << 20, "resident memory grew by {grown} bytes");
    assert!(t.elapsed().as_secs_f64() < 2.0, "took {:?}", t.elapsed());
}
