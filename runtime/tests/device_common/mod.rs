//! One test body on every device (candle's `test_device!`): the CPU, the CUDA backend on the
//! CPU emulator of the device (f32 and bf16 activations; in `--features cuda` builds), and real
//! GPUs when present. Bodies compute on `d.be` and compare with the CPU backend on the same
//! inputs (rounded to the device's activation dtype first, so differences come from the
//! arithmetic, not the inputs), within tolerances stated per dtype in [`Dev::tol`].
#![allow(dead_code)]

use std::sync::Arc;

use ferrozero_runtime::backend::{self, Backend};
use ferrozero_runtime::tensor::{BufRef, DType, FlatBuf, Storage};

/// A device under test.
pub struct Dev {
    /// Which one (`cpu`, `cuda_emu_bf16`, ...).
    pub name: &'static str,
    /// Its backend.
    pub be: Arc<dyn Backend>,
}

/// Absolute and relative tolerance of a comparison with the CPU.
#[derive(Clone, Copy, Debug)]
pub struct Tol {
    pub abs: f64,
    pub rel: f64,
}

impl Dev {
    /// The activation dtype.
    pub fn act(&self) -> DType {
        self.be.act_dtype()
    }

    /// The training precision the device's activations make: bf16 on a bf16 device, f32
    /// elsewhere (an f16 device trains f32 parameters: fp16 needs its loss scale).
    pub fn training_precision(&self) -> ferrozero_config::resolved::Precision {
        use ferrozero_config::resolved::Precision;
        match self.act() {
            DType::Bf16 => Precision::Bf16,
            _ => Precision::F32,
        }
    }

    /// Tolerance against the CPU for results in the activation dtype: f32 differs in
    /// summation order and in exp/tanh implementations (a few ulp per term); bf16 and f16
    /// round every stored result (2^-8 and 2^-11 relative).
    pub fn tol(&self) -> Tol {
        match self.act() {
            DType::F32 => Tol {
                abs: 2e-5,
                rel: 2e-4,
            },
            DType::Bf16 => Tol {
                abs: 2e-2,
                rel: 2e-2,
            },
            DType::F16 => Tol {
                abs: 4e-3,
                rel: 4e-3,
            },
        }
    }

    /// `vals` rounded to the activation dtype, as host f32 (what the CPU reference computes on).
    pub fn round(&self, vals: &[f32]) -> Vec<f32> {
        let mut b = FlatBuf::zeros(self.act(), vals.len());
        b.store_f32(0, vals);
        let mut out = vec![0.0; vals.len()];
        b.load_f32(0, &mut out);
        out
    }

    /// `vals` on the device in the activation dtype.
    pub fn put(&self, vals: &[f32]) -> Storage {
        let mut b = FlatBuf::zeros(self.act(), vals.len());
        b.store_f32(0, vals);
        self.be.upload(b.as_ref()).expect("upload")
    }

    /// `vals` on the device in f32 (statistics, parameter gradients, optimizer state).
    pub fn put_f32(&self, vals: &[f32]) -> Storage {
        self.be.upload(BufRef::F32(vals)).expect("upload")
    }

    /// Zeros on the device in the activation dtype.
    pub fn zeros(&self, n: usize) -> Storage {
        self.be.zeros(self.act(), n).expect("zeros")
    }

    /// Zeros on the device in f32.
    pub fn zeros_f32(&self, n: usize) -> Storage {
        self.be.zeros(DType::F32, n).expect("zeros")
    }
}

/// The values of a storage as host f32.
pub fn get(s: &Storage) -> Vec<f32> {
    s.to_vec_f32().expect("download")
}

/// Deterministic values in [-1, 1).
pub fn rand(n: usize, seed: u64) -> Vec<f32> {
    (0..n)
        .map(|i| backend::rng::uniform_f32(seed, i as u64) * 2.0 - 1.0)
        .collect()
}

/// Asserts that a device's per-step training losses are the CPU's within the device's relative
/// tolerance (at least 1e-4: a step's loss sums many rounded terms).
pub fn assert_losses_close(d: &Dev, got: &[f64], cpu: &[f64]) {
    let rel = d.tol().rel.max(1e-4);
    assert_eq!(got.len(), cpu.len(), "{}: {got:?} vs CPU {cpu:?}", d.name);
    for (a, b) in got.iter().zip(cpu) {
        let close = (a - b).abs() <= rel * b.abs();
        assert!(close, "{}: losses {got:?} vs CPU {cpu:?}", d.name);
    }
}

/// [`Dev::tol`] for a sum of `k` terms: rounding errors in different summation orders grow
/// like the square root of the count.
pub fn tol_k(d: &Dev, k: usize) -> Tol {
    let t = d.tol();
    Tol {
        abs: t.abs * (k as f64).sqrt().max(1.0),
        rel: t.rel,
    }
}

/// Fails with the first element outside `|got - want| <= abs + rel * |want|`.
pub fn assert_close(what: &str, got: &[f32], want: &[f32], tol: Tol) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let (g, w) = (f64::from(g), f64::from(w));
        let ok = (g - w).abs() <= tol.abs + tol.rel * w.abs() || (g.is_nan() && w.is_nan());
        assert!(ok, "{what}[{i}]: got {g}, want {w} (tolerance {tol:?})");
    }
}

/// The CPU backend.
pub fn cpu() -> Dev {
    Dev {
        name: "cpu",
        be: backend::cpu(),
    }
}

/// The device `name` when this build and machine have it; `None` (with a line saying why)
/// otherwise.
pub fn device(name: &'static str) -> Option<Dev> {
    let be: Result<Arc<dyn Backend>, String> = match name {
        "cpu" => Ok(backend::cpu()),
        #[cfg(feature = "cuda")]
        "cuda_emu_f32" => emulated(DType::F32),
        #[cfg(feature = "cuda")]
        "cuda_emu_bf16" => emulated(DType::Bf16),
        "cuda_f32" => real(DType::F32),
        "cuda_bf16" => real(DType::Bf16),
        _ => Err("this build has no CUDA backend (build with --features cuda)".into()),
    };
    match be {
        Ok(be) => Some(Dev { name, be }),
        Err(why) if cfg!(feature = "cuda") && name.starts_with("cuda_emu") => {
            backend::cuda::emu::skip_unless_required(&format!("{name}: {why}"));
            None
        }
        Err(why) => {
            eprintln!("skipped on {name}: {why}");
            None
        }
    }
}

#[cfg(feature = "cuda")]
fn emulated(act: DType) -> Result<Arc<dyn Backend>, String> {
    backend::cuda::emulated(act)
        .map(|b| b as Arc<dyn Backend>)
        .map_err(|e| e.to_string())
}

fn real(act: DType) -> Result<Arc<dyn Backend>, String> {
    match backend::cuda::device_count() {
        Ok(n) if n > 0 => {
            backend::open(backend::Device::Cuda(Some(0)), act, 0).map_err(|e| e.to_string())
        }
        Ok(_) => Err("no CUDA device".into()),
        Err(e) => Err(e.to_string()),
    }
}

/// Runs `body` on device `name`, or says why it cannot.
pub fn run(name: &'static str, body: fn(&Dev)) {
    if let Some(d) = device(name) {
        body(&d);
    }
}

/// One test per device for a body `fn(&Dev)`.
#[macro_export]
macro_rules! test_device {
    ($body:ident) => {
        mod $body {
            #[test]
            fn cpu() {
                $crate::device_common::run("cpu", super::$body);
            }
            #[test]
            fn cuda_emu_f32() {
                $crate::device_common::run("cuda_emu_f32", super::$body);
            }
            #[test]
            fn cuda_emu_bf16() {
                $crate::device_common::run("cuda_emu_bf16", super::$body);
            }
            #[test]
            fn cuda_f32() {
                $crate::device_common::run("cuda_f32", super::$body);
            }
            #[test]
            fn cuda_bf16() {
                $crate::device_common::run("cuda_bf16", super::$body);
            }
        }
    };
}
