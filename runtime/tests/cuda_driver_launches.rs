//! Kernel launches through an emulator library (the fixture kernels and a stand-in library):
//! raw parameters reach the kernel, and what a GPU would refuse is refused.
#![cfg(feature = "cuda")]

mod cuda_driver_common;

use std::ffi::c_void;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::OnceLock;

use cuda_driver_common::{
    device_err, download, fixture_program, fixtures, on_real_device, upload, S,
};
use ferrozero_runtime::backend::cuda::driver::{Driver, EmuDriver, EmuOptions, LaunchConfig};
use ferrozero_runtime::tensor::DType;

// ---------------------------------------------------------------------------------------------
// Kernel launches through an emulator library (the fixture kernels and a stand-in library
// until the kernels registry's emulator is merged).

/// Builds the stand-in emulator library once per test process; `None` (test skipped) without
/// a C++ compiler.
fn stub_library() -> Option<PathBuf> {
    static LIB: OnceLock<Option<PathBuf>> = OnceLock::new();
    LIB.get_or_init(|| {
        let cxx = ["c++", "g++", "clang++"].into_iter().find(|c| {
            std::process::Command::new(c)
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success())
        });
        let Some(cxx) = cxx else {
            ferrozero_runtime::backend::cuda::emu::skip_unless_required(
                "no C++ compiler for the stand-in emulator library",
            );
            return None;
        };
        // Named by the sources' content, built once, published by rename: concurrent test
        // processes share it and no stale copy is ever loaded.
        let mut text = Vec::new();
        for f in ["emu_stub.cpp", "driver_fixture.cu"] {
            text.extend(std::fs::read(fixtures().join(f)).unwrap());
        }
        let hash = text.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
        });
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
        let out = dir.join(format!("libfz_emu_stub-{hash:016x}.so"));
        if out.is_file() {
            return Some(out);
        }
        let tmp = dir.join(format!(
            "libfz_emu_stub-{hash:016x}.{}.tmp",
            std::process::id()
        ));
        let status = std::process::Command::new(cxx)
            .args([
                "-std=c++17",
                "-O1",
                "-fPIC",
                "-shared",
                "-ffp-contract=off",
                "-I",
            ])
            .arg(fixtures())
            .arg(fixtures().join("emu_stub.cpp"))
            .arg("-o")
            .arg(&tmp)
            .status()
            .unwrap();
        assert!(status.success(), "building the stand-in emulator failed");
        std::fs::rename(&tmp, &out).unwrap();
        assert!(status.success(), "building the stand-in emulator failed");
        Some(out)
    })
    .clone()
}

fn stub_driver() -> Option<Arc<dyn Driver>> {
    let lib = stub_library()?;
    Some(Arc::new(
        EmuDriver::new(EmuOptions {
            library: Some(lib),
            programs: vec![fixture_program()],
            ..EmuOptions::default()
        })
        .unwrap(),
    ))
}

fn launches_run_kernels_with_raw_parameters(d: &Arc<dyn Driver>) {
    let n = 1000usize;
    let x: Vec<f32> = (0..n).map(|i| i as f32 * 0.37 - 11.0).collect();
    let y: Vec<f32> = (0..n).map(|i| (i as f32).sin()).collect();
    let xp = upload(d, &x, DType::F32);
    let yp = upload(d, &y, DType::F32);
    let k = d.kernel("fz_fixture_axpy").unwrap();
    let mut a = 1.5f32;
    let (mut xa, mut ya, mut na) = (xp.0, yp.0, n as i64);
    let mut params = [
        &mut a as *mut f32 as *mut c_void,
        &mut xa as *mut u64 as *mut c_void,
        &mut ya as *mut u64 as *mut c_void,
        &mut na as *mut i64 as *mut c_void,
    ];
    // A small grid: the kernel's grid-stride loop covers the rest.
    let cfg = LaunchConfig::for_elements(n as u64, 128, 3);
    assert_eq!(cfg.grid, [3, 1, 1]);
    unsafe { d.launch(k, &cfg, &mut params, S) }.unwrap();
    let got = download(d, yp, n, DType::F32);
    for i in 0..n {
        assert_eq!(got[i].to_bits(), (1.5 * x[i] + y[i]).to_bits(), "y[{i}]");
    }

    // A 2-D grid visits every index once.
    let k = d.kernel("fz_fixture_iota").unwrap();
    let n = 3 * 4 * 32 - 5;
    let op = d.malloc(n * 4).unwrap();
    let (mut oa, mut off, mut nn) = (op.0, 7u32, n as i64);
    let mut params = [
        &mut oa as *mut u64 as *mut c_void,
        &mut off as *mut u32 as *mut c_void,
        &mut nn as *mut i64 as *mut c_void,
    ];
    let cfg = LaunchConfig {
        grid: [3, 4, 1],
        block: [32, 1, 1],
        dyn_smem: 0,
    };
    unsafe { d.launch(k, &cfg, &mut params, S) }.unwrap();
    let mut out = vec![0u8; n * 4];
    d.copy_dtoh(op, &mut out, S).unwrap();
    for (i, c) in out.chunks_exact(4).enumerate() {
        assert_eq!(u32::from_le_bytes(c.try_into().unwrap()), i as u32 + 7);
    }
}

fn launches_reject_what_the_gpu_would(d: &Arc<dyn Driver>) {
    let (op, detail) = device_err(d.kernel("fz_fixture_nope"));
    assert_eq!(op, "cuModuleGetFunction");
    assert!(
        detail.contains("fz_fixture_axpy"),
        "lists the known kernels: {detail}"
    );

    let k = d.kernel("fz_fixture_iota").unwrap();
    let mut params: [*mut c_void; 0] = [];
    for (cfg, why) in [
        (LaunchConfig::linear(1, 2048), "2048 threads per block"),
        (LaunchConfig::linear(0, 32), "at least 1"),
        (
            LaunchConfig {
                grid: [1, 70000, 1],
                block: [32, 1, 1],
                dyn_smem: 0,
            },
            "grid dimensions",
        ),
        (
            LaunchConfig {
                grid: [1, 1, 1],
                block: [32, 1, 1],
                dyn_smem: 228 * 1024,
            },
            "dynamic shared memory",
        ),
    ] {
        let (op, detail) = device_err(unsafe { d.launch(k, &cfg, &mut params, S) });
        assert_eq!(op, "cuLaunchKernel");
        assert!(detail.contains(why), "{detail}");
    }
}

#[test]
fn emulated_launches_run_kernels_with_raw_parameters() {
    if let Some(d) = stub_driver() {
        launches_run_kernels_with_raw_parameters(&d);
    }
}

#[test]
fn emulated_launches_reject_what_the_gpu_would() {
    let Some(d) = stub_driver() else { return };
    launches_reject_what_the_gpu_would(&d);
    let mut params: [*mut c_void; 0] = [];
    // A kernel the library cannot run reports the library's own words.
    let k = d.kernel("fz_fixture_block_sum").unwrap();
    let (op, detail) =
        device_err(unsafe { d.launch(k, &LaunchConfig::linear(1, 256), &mut params, S) });
    assert_eq!(op, "cuLaunchKernel");
    assert!(
        detail.contains("cannot run kernel fz_fixture_block_sum"),
        "{detail}"
    );

    // Duplicate kernel names across programs are refused when the driver is built.
    let mut twice = fixture_program();
    twice.file = "again.cu".into();
    let err = EmuDriver::new(EmuOptions {
        programs: vec![fixture_program(), twice],
        ..EmuOptions::default()
    })
    .unwrap_err();
    assert!(err.to_string().contains("defined by both"), "{err}");
}

/// The fixture's shared-memory reduction, which the stand-in emulator cannot run.
fn block_sum_runs(d: &Arc<dyn Driver>) {
    let blocks = 5usize;
    let x: Vec<f32> = (0..blocks * 256).map(|i| (i % 17) as f32 - 8.0).collect();
    let xp = upload(d, &x, DType::F32);
    let op = d.malloc(blocks * 4).unwrap();
    let k = d.kernel("fz_fixture_block_sum").unwrap();
    let (mut xa, mut oa) = (xp.0, op.0);
    let mut params = [
        &mut xa as *mut u64 as *mut c_void,
        &mut oa as *mut u64 as *mut c_void,
    ];
    let cfg = LaunchConfig::linear(blocks as u32, 256);
    unsafe { d.launch(k, &cfg, &mut params, S) }.unwrap();
    let got = download(d, op, blocks, DType::F32);
    for (b, g) in got.iter().enumerate() {
        let want: f32 = x[b * 256..(b + 1) * 256].iter().sum();
        assert_eq!(*g, want, "block {b}");
    }
    unsafe { d.free(xp) }.unwrap();
    unsafe { d.free(op) }.unwrap();
}

#[test]
fn real_device_passes_the_launches_checks() {
    on_real_device(&[
        (
            "launches_run_kernels_with_raw_parameters",
            launches_run_kernels_with_raw_parameters,
        ),
        (
            "launches_reject_what_the_gpu_would",
            launches_reject_what_the_gpu_would,
        ),
        ("block_sum_runs", block_sum_runs),
    ]);
}
