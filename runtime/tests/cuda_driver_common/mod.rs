//! What the `cuda_driver_*` tests share: the emulated driver, error matchers, the fixture
//! program, and the runner that takes a concept's checks to a real GPU when there is one.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::Arc;

use ferrozero_runtime::backend::cuda::driver::{
    CudaDriver, DevPtr, Driver, EmuDriver, EmuOptions, Program, StreamKind,
};
use ferrozero_runtime::tensor::DType;
use ferrozero_runtime::Error;
use half::{bf16, f16};

pub const S: StreamKind = StreamKind::Compute;

pub fn emu() -> Arc<dyn Driver> {
    Arc::new(EmuDriver::new(EmuOptions::default()).unwrap())
}

pub fn emu_with_memory(total: u64) -> Arc<dyn Driver> {
    Arc::new(
        EmuDriver::new(EmuOptions {
            total_memory: total,
            ..EmuOptions::default()
        })
        .unwrap(),
    )
}

pub fn device_err(r: Result<impl std::fmt::Debug, Error>) -> (String, String) {
    match r {
        Err(Error::Device { op, detail }) => (op, detail),
        other => panic!("expected Error::Device, got {other:?}"),
    }
}

pub fn invalid(r: Result<(), Error>) -> String {
    match r {
        Err(Error::Invalid(msg)) => msg,
        other => panic!("expected Error::Invalid, got {other:?}"),
    }
}

pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

pub fn fixture_program() -> Program {
    let text = std::fs::read_to_string(fixtures().join("driver_fixture.cu")).unwrap();
    Program::new(
        "driver_fixture.cu",
        text,
        &["fz_fixture_axpy", "fz_fixture_iota", "fz_fixture_block_sum"],
    )
}

/// Rounds to `t` and back (the values a buffer of type `t` can hold).
pub fn quantize(v: f32, t: DType) -> f32 {
    match t {
        DType::F32 => v,
        DType::Bf16 => bf16::from_f32(v).to_f32(),
        DType::F16 => f16::from_f32(v).to_f32(),
    }
}

pub fn to_bytes(v: &[f32], t: DType) -> Vec<u8> {
    match t {
        DType::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::Bf16 => v
            .iter()
            .flat_map(|x| bf16::from_f32(*x).to_bits().to_le_bytes())
            .collect(),
        DType::F16 => v
            .iter()
            .flat_map(|x| f16::from_f32(*x).to_bits().to_le_bytes())
            .collect(),
    }
}

pub fn from_bytes(b: &[u8], t: DType) -> Vec<f32> {
    match t {
        DType::F32 => b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        DType::Bf16 => b
            .chunks_exact(2)
            .map(|c| bf16::from_bits(u16::from_le_bytes(c.try_into().unwrap())).to_f32())
            .collect(),
        DType::F16 => b
            .chunks_exact(2)
            .map(|c| f16::from_bits(u16::from_le_bytes(c.try_into().unwrap())).to_f32())
            .collect(),
    }
}

/// Deterministic test values in [-2, 2), already representable in `t`.
pub fn values(n: usize, seed: u64, t: DType) -> Vec<f32> {
    let mut rng = fastrand::Rng::with_seed(seed);
    (0..n).map(|_| quantize(rng.f32() * 4.0 - 2.0, t)).collect()
}

/// A device buffer holding `v` in type `t`.
pub fn upload(d: &Arc<dyn Driver>, v: &[f32], t: DType) -> DevPtr {
    let bytes = to_bytes(v, t);
    let p = d.malloc(bytes.len().max(1)).unwrap();
    d.copy_htod(&bytes, p, S).unwrap();
    p
}

pub fn download(d: &Arc<dyn Driver>, p: DevPtr, n: usize, t: DType) -> Vec<f32> {
    let mut b = vec![0u8; n * t.size()];
    d.copy_dtoh(p, &mut b, S).unwrap();
    from_bytes(&b, t)
}

/// A check that runs on any driver, emulated or real.
pub type Check = fn(&Arc<dyn Driver>);

/// Runs every check on GPU 0 when there is one (skipped, saying why, when there is none);
/// every check runs (a GPU run is scarce): each failure prints its panic, then all are named.
pub fn on_real_device(checks: &[(&str, Check)]) {
    let d: Arc<dyn Driver> = match CudaDriver::open(0, vec![fixture_program()]) {
        Ok(d) => Arc::new(d),
        Err(e) => {
            println!("skipped: {e}");
            return;
        }
    };
    println!("{}", d.info());
    let failed: Vec<&str> = checks
        .iter()
        .filter(|(_, check)| {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| check(&d))).is_err()
        })
        .map(|(name, _)| *name)
        .collect();
    assert!(failed.is_empty(), "failed on {}: {failed:?}", d.info());
}
