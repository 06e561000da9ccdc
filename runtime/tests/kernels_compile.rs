//! CI's check that every kernel source compiles for the GPUs we run on: NVRTC (through the
//! runtime's own `nvrtc::compile_cached`, so with the runtime's exact options) to PTX for
//! compute_80 and compute_90, then `ptxas -v` for sm_80 and sm_90, with a table of registers,
//! spills and shared memory per kernel. Also the kernel cache and NVRTC's error reporting.
//!
//! Without NVRTC (libnvrtc.so.12 on LD_LIBRARY_PATH) or ptxas (`$FERROZERO_PTXAS`, `ptxas` on
//! PATH, or the nvidia-cuda-nvcc-cu12 wheel under /opt/cuda-wheels) each test prints
//! "skipped: ..." and passes, unless `FERROZERO_REQUIRE_NVRTC=1` (CI sets it).
#![cfg(feature = "cuda")]

use std::path::{Path, PathBuf};
use std::process::Command;

use ferrozero_runtime::backend::cuda::driver::nvrtc::{self, ImageKind, Target};
use ferrozero_runtime::backend::cuda::driver::{self, Program};
use ferrozero_runtime::Error;

/// The architectures CI compiles for: A100 and H100.
const ARCHS: [(u32, u32); 2] = [(8, 0), (9, 0)];

const WHEEL_PTXAS: &str = "/opt/cuda-wheels/nvidia/cuda_nvcc/bin/ptxas";

fn required() -> bool {
    std::env::var("FERROZERO_REQUIRE_NVRTC").is_ok_and(|v| v == "1")
}

/// Skips (or, when required, fails) a test that lacks a tool.
fn skip(why: &str) {
    if required() {
        panic!("FERROZERO_REQUIRE_NVRTC=1 but {why}");
    }
    println!("skipped: {why}");
}

fn nvrtc_present() -> bool {
    if nvrtc::is_available() {
        true
    } else {
        skip(
            "NVRTC not found (put the directory of libnvrtc.so.12, e.g. \
             /opt/cuda-wheels/nvidia/cuda_nvrtc/lib, on LD_LIBRARY_PATH)",
        );
        false
    }
}

/// ptxas: `$FERROZERO_PTXAS`, else `ptxas` on PATH, else the PyPI wheel's.
fn find_ptxas() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("FERROZERO_PTXAS").filter(|p| !p.is_empty()) {
        let p = PathBuf::from(p);
        if p.is_file() {
            return Some(p);
        }
        skip(&format!("FERROZERO_PTXAS={} is not a file", p.display()));
        return None;
    }
    let on_path = std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|d| d.join("ptxas"))
            .find(|p| p.is_file())
    });
    let found = on_path.or_else(|| Some(PathBuf::from(WHEEL_PTXAS)).filter(|p| p.is_file()));
    if found.is_none() {
        skip("ptxas not found ($FERROZERO_PTXAS, PATH, or the nvidia-cuda-nvcc-cu12 wheel)");
    }
    found
}

fn fixture_program() -> Program {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/driver_fixture.cu");
    Program::new(
        "driver_fixture.cu",
        std::fs::read_to_string(path).unwrap(),
        &["fz_fixture_axpy", "fz_fixture_iota", "fz_fixture_block_sum"],
    )
}

/// ferrozero's kernel sources plus the driver's fixture.
fn all_programs() -> Vec<Program> {
    let mut programs = driver::builtin_programs();
    programs.push(fixture_program());
    programs
}

/// What `ptxas -v` says about one entry function.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct Usage {
    name: String,
    registers: u32,
    spill_stores: u32,
    spill_loads: u32,
    smem: u32,
    stack: u32,
}

/// The number right before `unit` in `line` (e.g. `12` in "Used 12 registers").
fn number_before(line: &str, unit: &str) -> Option<u32> {
    let at = line.find(unit)?;
    line[..at].split_whitespace().last()?.parse().ok()
}

/// Parses `ptxas -v`'s report: per entry function, registers, spills, stack and shared memory.
fn parse_ptxas(report: &str) -> Vec<Usage> {
    let mut out: Vec<Usage> = Vec::new();
    for line in report.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or_default().to_string();
            out.push(Usage {
                name,
                ..Usage::default()
            });
            continue;
        }
        let Some(cur) = out.last_mut() else { continue };
        if line.contains("spill stores") {
            cur.spill_stores = number_before(line, "bytes spill stores").unwrap_or(0);
            cur.spill_loads = number_before(line, "bytes spill loads").unwrap_or(0);
            cur.stack = number_before(line, "bytes stack frame").unwrap_or(0);
        }
        if line.contains("Used") && line.contains("registers") {
            cur.registers = number_before(line, "registers").unwrap_or(0);
            cur.smem = number_before(line, "bytes smem").unwrap_or(0);
        }
    }
    out
}

#[test]
fn every_kernel_compiles_and_assembles() {
    if !nvrtc_present() {
        return;
    }
    let Some(ptxas) = find_ptxas() else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut table = Vec::new();
    for program in all_programs() {
        for (major, minor) in ARCHS {
            let target = Target::ptx(major, minor);
            let compiled = nvrtc::compile_cached(&program, target, Some(dir.path()))
                .unwrap_or_else(|e| panic!("{} for compute_{major}{minor}: {e}", program.file));
            let stem = format!("{}-sm{major}{minor}", program.file);
            let ptx = dir.path().join(format!("{stem}.ptx"));
            std::fs::write(&ptx, &compiled.image).unwrap();
            let out = Command::new(&ptxas)
                .arg(format!("-arch=sm_{major}{minor}"))
                .arg("-v")
                .arg(&ptx)
                .arg("-o")
                .arg(dir.path().join(format!("{stem}.cubin")))
                .output()
                .unwrap_or_else(|e| panic!("running {}: {e}", ptxas.display()));
            let report = String::from_utf8_lossy(&out.stderr);
            assert!(
                out.status.success(),
                "ptxas -arch=sm_{major}{minor} failed for {}:\n{report}",
                program.file
            );
            let usage = parse_ptxas(&report);
            for k in &program.kernels {
                assert!(
                    usage.iter().any(|u| &u.name == k),
                    "{} lists kernel {k}, but its PTX for sm_{major}{minor} has no such entry \
                     (entries: {:?})",
                    program.file,
                    usage.iter().map(|u| &u.name).collect::<Vec<_>>()
                );
            }
            for u in usage {
                assert!(
                    program.kernels.contains(&u.name),
                    "{} defines entry {} that its kernel list lacks",
                    program.file,
                    u.name
                );
                table.push((program.file.clone(), format!("sm_{major}{minor}"), u));
            }
        }
    }
    println!(
        "{:<28} {:<20} {:<6} {:>5} {:>12} {:>11} {:>6} {:>6}",
        "kernel", "file", "arch", "regs", "spill stores", "spill loads", "stack", "smem"
    );
    for (file, arch, u) in &table {
        println!(
            "{:<28} {:<20} {:<6} {:>5} {:>12} {:>11} {:>6} {:>6}",
            u.name, file, arch, u.registers, u.spill_stores, u.spill_loads, u.stack, u.smem
        );
    }
    let spilling: Vec<_> = table
        .iter()
        .filter(|(_, _, u)| u.spill_stores + u.spill_loads > 0)
        .map(|(_, arch, u)| format!("{} ({arch})", u.name))
        .collect();
    if !spilling.is_empty() {
        println!("note: kernels that spill: {}", spilling.join(", "));
    }
    // The fixture's shared-memory reduction is visible in the table.
    assert!(table
        .iter()
        .any(|(_, _, u)| u.name == "fz_fixture_block_sum" && u.smem == 1024));
}

#[test]
fn cubins_for_the_runtime_are_elf_images() {
    if !nvrtc_present() {
        return;
    }
    let program = fixture_program();
    for (major, minor) in ARCHS {
        let image = nvrtc::compile_uncached(&program, Target::cubin(major, minor)).unwrap();
        assert_eq!(&image[..4], b"\x7fELF", "a CUBIN for sm_{major}{minor}");
    }
    // NVRTC knows both architectures, so a device gets CUBIN directly; one newer than NVRTC
    // gets PTX for the newest architecture NVRTC has.
    assert_eq!(nvrtc::target_for((9, 0)).unwrap(), Target::cubin(9, 0));
    let newest = *nvrtc::supported_archs().unwrap().last().unwrap();
    let future = nvrtc::target_for((99, 9)).unwrap();
    assert_eq!(future.kind, ImageKind::Ptx);
    assert_eq!(future.sm(), newest);
    println!(
        "NVRTC {:?}, architectures up to sm_{newest}",
        nvrtc::version().unwrap()
    );
}

#[test]
fn kernel_cache_reuses_and_repairs_entries() {
    if !nvrtc_present() {
        return;
    }
    let program = fixture_program();
    let target = Target::cubin(9, 0);
    let dir = tempfile::tempdir().unwrap();
    let first = nvrtc::compile_cached(&program, target, Some(dir.path())).unwrap();
    assert!(!first.from_cache);
    let path = first.path.clone().unwrap();
    let name = path.file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        name.starts_with("driver_fixture-sm90-") && name.ends_with(".cubin"),
        "{name}"
    );
    assert_eq!(
        name,
        nvrtc::cache_file_name(&program, target, nvrtc::version().unwrap())
    );

    let second = nvrtc::compile_cached(&program, target, Some(dir.path())).unwrap();
    assert!(second.from_cache);
    assert_eq!(second.image, first.image);

    // Another text, option set or architecture is another entry.
    let mut edited = program.clone();
    edited.text.push_str("\n// edited\n");
    assert_ne!(
        nvrtc::cache_file_name(&edited, target, (12, 9)),
        nvrtc::cache_file_name(&program, target, (12, 9))
    );
    assert_ne!(
        nvrtc::cache_file_name(&program, Target::ptx(9, 0), (12, 9)),
        nvrtc::cache_file_name(&program, target, (12, 9))
    );
    assert_ne!(
        nvrtc::cache_file_name(&program, target, (12, 8)),
        nvrtc::cache_file_name(&program, target, (12, 9))
    );

    // A flipped byte and a torn file are both recompiled and rewritten, never loaded.
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[100] ^= 0x40;
    std::fs::write(&path, &bytes).unwrap();
    let repaired = nvrtc::compile_cached(&program, target, Some(dir.path())).unwrap();
    assert!(!repaired.from_cache);
    assert_eq!(repaired.image, first.image);
    assert!(
        nvrtc::compile_cached(&program, target, Some(dir.path()))
            .unwrap()
            .from_cache
    );
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    assert!(
        !nvrtc::compile_cached(&program, target, Some(dir.path()))
            .unwrap()
            .from_cache
    );
    // No temporary files are left behind.
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");

    // An unwritable cache (its directory would be under a regular file) only warns.
    let blocker = dir.path().join("not-a-dir");
    std::fs::write(&blocker, b"x").unwrap();
    let c = nvrtc::compile_cached(&program, target, Some(&blocker.join("kernels"))).unwrap();
    assert!(!c.from_cache);
    assert_eq!(c.image, first.image);
}

#[test]
fn compile_errors_carry_nvrtcs_log() {
    if !nvrtc_present() {
        return;
    }
    let broken = Program::new(
        "broken.cu",
        "extern \"C\" __global__ void broken(float* x) {\n  x[0] = undeclared_name;\n}\n",
        &["broken"],
    );
    match nvrtc::compile_uncached(&broken, Target::cubin(8, 0)) {
        Err(Error::Device { op, detail }) => {
            assert_eq!(op, "nvrtcCompileProgram");
            assert!(detail.starts_with("NVRTC_ERROR_COMPILATION"), "{detail}");
            assert!(
                detail.contains("broken.cu(2)"),
                "the log names file and line: {detail}"
            );
            assert!(detail.contains("undeclared_name"), "{detail}");
            assert!(
                detail.contains("--fmad=false"),
                "the options are shown: {detail}"
            );
        }
        other => panic!("expected a compile error, got {other:?}"),
    }
}

#[test]
fn ptxas_report_parsing() {
    let report = "\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'k_one' for 'sm_90'
ptxas info    : Function properties for k_one
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 12 registers, used 1 barriers, 1024 bytes smem, 380 bytes cmem[0]
ptxas info    : Compiling entry function 'k_two' for 'sm_90'
ptxas info    : Function properties for k_two
    48 bytes stack frame, 40 bytes spill stores, 36 bytes spill loads
ptxas info    : Used 255 registers, 372 bytes cmem[0]
";
    let u = parse_ptxas(report);
    assert_eq!(u.len(), 2);
    assert_eq!(
        u[0],
        Usage {
            name: "k_one".into(),
            registers: 12,
            smem: 1024,
            ..Usage::default()
        }
    );
    assert_eq!(
        u[1],
        Usage {
            name: "k_two".into(),
            registers: 255,
            spill_stores: 40,
            spill_loads: 36,
            stack: 48,
            smem: 0,
        }
    );
}
