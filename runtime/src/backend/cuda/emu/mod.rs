//! The CPU emulator of ferrozero's CUDA kernels: the same `.cu` text compiled as C++ by g++
//! with an emulation header (`emu.h`), run on the CPU with CUDA's semantics (blocks, threads as
//! fibers, `__syncthreads`, warp shuffles and votes, shared memory), so kernel logic is tested
//! against the CPU backend in `cargo test` on machines without a GPU. See `README.md` here for
//! the design, the guarantees and the limits.
//!
//! [`build_library`] compiles the emulator and every kernel source into one shared library that
//! exports a single C function, `fz_emu_launch`, with the shape of `cuLaunchKernel`:
//!
//! ```c
//! // params: pointers to the argument values, exactly like cuLaunchKernel's kernelParams;
//! // device pointers are plain host addresses. Returns 0, or nonzero with a message in err.
//! int fz_emu_launch(const char* kernel, const unsigned grid[3], const unsigned block[3],
//!                   unsigned long long dyn_smem_bytes, void** params,
//!                   char* err, unsigned long long err_len);
//! ```
//!
//! Builds are cached by content: every object file and the library carry a hash of the text,
//! the compiler and the flags in their names, so an unchanged build is a file lookup and a
//! changed kernel recompiles only its own file.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use super::kernels::{self, KernelSource};

/// The environment variable that turns a missing emulator into a failure: with
/// `FERROZERO_REQUIRE_EMULATOR=1` (CI sets it) a test that cannot build or open the emulator
/// fails instead of printing "skipped" and passing, so a broken toolchain cannot hide.
pub const REQUIRE_ENV: &str = "FERROZERO_REQUIRE_EMULATOR";

/// Whether [`REQUIRE_ENV`] is `1`.
pub fn required() -> bool {
    std::env::var(REQUIRE_ENV).is_ok_and(|v| v == "1")
}

/// For a test that cannot run without the emulator: prints `skipped: <why>` so the pass is
/// visibly a skip, or panics with `why` when [`required`].
pub fn skip_unless_required(why: &str) {
    if required() {
        panic!("{REQUIRE_ENV}=1 but the emulator is unavailable: {why}");
    }
    println!("skipped: {why}");
}

/// The CUDA-in-C++ layer every translation unit includes first.
const EMU_H: &str = include_str!("emu.h");
/// The scheduler and `fz_emu_launch`.
const RUNTIME_CPP: &str = include_str!("runtime.cpp");

/// Flags for every translation unit. `-ffp-contract=off` keeps `a * b + c` two roundings, as
/// `__fmul_rn`/`__fadd_rn` (and bitwise parity with the CPU) demand; `-fno-strict-aliasing`
/// because CUDA code reinterprets memory as vectors; hidden visibility so that only
/// `fz_emu_launch` is exported.
const CXX_FLAGS: &[&str] = &[
    "-std=c++17",
    "-O2",
    "-fPIC",
    "-ffp-contract=off",
    "-fno-fast-math",
    "-fno-strict-aliasing",
    "-fvisibility=hidden",
    "-fvisibility-inlines-hidden",
    "-pthread",
];

/// Flags for linking the shared library (plus a version script on Linux).
const LINK_FLAGS: &[&str] = &["-shared", "-pthread"];

/// The linker version script: exactly one exported symbol.
const VERSION_SCRIPT: &str = "{ global: fz_emu_launch; local: *; };\n";

/// The C++ compiler the emulator is built with: `$CXX` when set, else `g++`, else `c++` on
/// `PATH`; `None` when there is none (tests then skip).
pub fn find_compiler() -> Option<PathBuf> {
    if let Some(cxx) = std::env::var_os("CXX").filter(|s| !s.is_empty()) {
        let p = PathBuf::from(cxx);
        if p.components().count() > 1 {
            return p.is_file().then_some(p);
        }
        return which(p.to_str()?);
    }
    which("g++").or_else(|| which("c++"))
}

fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

/// Compiles the emulator and every kernel source into one shared library under `dir` (reused when a library
/// built from the same text with the same compiler flags exists: the file name carries a content hash), and
/// returns its path. Errors carry the compiler's output.
pub fn build_library(dir: &std::path::Path) -> Result<std::path::PathBuf, String> {
    build_library_from(dir, kernels::SOURCES)
}

/// [`build_library`] for another set of sources (e.g. a test's own kernels, or a kernel under
/// development before it joins the registry). Every name in each source's `kernels` list must
/// be an `extern "C" __global__` function of that source.
pub fn build_library_from(dir: &Path, sources: &[KernelSource]) -> Result<PathBuf, String> {
    let cxx = find_compiler().ok_or(
        "skipped: no C++ compiler (g++ or c++ on PATH, or $CXX) to build the CUDA emulator",
    )?;
    let identity = compiler_identity(&cxx)?;
    std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;

    // The header lives in a directory named by its own hash, so every object's hash covers it.
    let header_hash = hash_parts(&[EMU_H]);
    let include_dir = dir.join(format!("include-{header_hash:016x}"));
    write_once(&include_dir.join("emu.h"), EMU_H)?;

    let flags = CXX_FLAGS.join(" ");
    let mut units: Vec<(String, String)> = vec![("runtime".into(), RUNTIME_CPP.to_string())];
    for src in sources {
        units.push((unit_name(src.file), translation_unit(src)));
    }

    let mut objects = Vec::new();
    let mut missing = Vec::new();
    for (name, text) in &units {
        let h = hash_parts(&[&identity, &flags, EMU_H, text]);
        let obj = dir.join(format!("{name}-{h:016x}.o"));
        let cpp = dir.join(format!("{name}-{h:016x}.cpp"));
        if !obj.is_file() {
            write_once(&cpp, text)?;
            missing.push((name.clone(), cpp, obj.clone()));
        }
        objects.push((h, obj));
    }

    let link_hash = {
        let mut parts: Vec<String> = objects.iter().map(|(h, _)| format!("{h:016x}")).collect();
        parts.push(LINK_FLAGS.join(" "));
        parts.push(VERSION_SCRIPT.to_string());
        let refs: Vec<&str> = parts.iter().map(String::as_str).collect();
        hash_parts(&refs)
    };
    let lib = dir.join(format!("libfz_emu-{link_hash:016x}.so"));
    let mut keep: Vec<PathBuf> = objects.iter().map(|(_, o)| o.clone()).collect();
    keep.extend(objects.iter().map(|(_, o)| o.with_extension("cpp")));
    keep.push(include_dir.clone());
    keep.push(lib.clone());
    if lib.is_file() {
        prune(dir, &keep);
        return Ok(lib);
    }

    compile_all(&cxx, &include_dir, &missing)?;

    let tmp = temp_path(&lib);
    let mut cmd = Command::new(&cxx);
    cmd.args(LINK_FLAGS).arg("-o").arg(&tmp);
    for (_, obj) in &objects {
        cmd.arg(obj);
    }
    if cfg!(target_os = "linux") {
        let script = dir.join("fz_emu.map");
        write_once(&script, VERSION_SCRIPT)?;
        cmd.arg(format!("-Wl,--version-script={}", script.display()));
    }
    let out = cmd
        .output()
        .map_err(|e| format!("running {}: {e}", cxx.display()))?;
    if !out.status.success() {
        let _ = std::fs::remove_file(&tmp);
        return Err(format!(
            "linking the CUDA emulator library failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    std::fs::rename(&tmp, &lib).map_err(|e| format!("renaming to {}: {e}", lib.display()))?;
    prune(dir, &keep);
    Ok(lib)
}

/// Build products unused for this long are removed from the cache directory.
const PRUNE_AFTER: std::time::Duration = std::time::Duration::from_secs(7 * 24 * 3600);

/// Marks this build's files as used (their modification time) and removes our files that no
/// build has used for [`PRUNE_AFTER`], so the cache does not grow with every kernel edit.
/// Failures are ignored: the cache only costs disk space.
fn prune(dir: &Path, keep: &[PathBuf]) {
    let now = std::time::SystemTime::now();
    for path in keep {
        if path.is_file() {
            let _ = std::fs::File::options()
                .append(true)
                .open(path)
                .and_then(|f| f.set_modified(now));
        }
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if keep.contains(&path) || !is_build_product(&name) {
            continue;
        }
        let old = entry
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| now.duration_since(t).ok())
            .is_some_and(|age| age > PRUNE_AFTER);
        if old {
            let _ = if path.is_dir() {
                std::fs::remove_dir_all(&path)
            } else {
                std::fs::remove_file(&path)
            };
        }
    }
}

/// Whether `name` is one of ours: `<unit>-<hash>.cpp|.o`, `libfz_emu-<hash>.so`,
/// `include-<hash>` (hash: 16 hex digits), or a temporary file an interrupted build left.
fn is_build_product(name: &str) -> bool {
    if name.contains(".tmp-") {
        return true;
    }
    let stem = name
        .strip_suffix(".cpp")
        .or_else(|| name.strip_suffix(".o"))
        .or_else(|| name.strip_suffix(".so"))
        .unwrap_or(name);
    stem.rsplit_once('-')
        .is_some_and(|(_, h)| h.len() == 16 && h.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// The C++ translation unit the emulator compiles for one kernel source: `emu.h`, the
/// program text inside a namespace of its own (so helper functions of different files never
/// collide; `extern "C"` kernels keep their names), then a registration per kernel.
pub fn translation_unit(src: &KernelSource) -> String {
    let ns = format!("fz_k_{}", unit_name(src.file));
    let mut tu = format!(
        "// Generated by ferrozero's CUDA emulator from {file}: do not edit.\n\
         #include \"emu.h\"\n\
         namespace {ns} {{\n",
        file = src.file
    );
    tu.push_str(&kernels::program_text(src));
    tu.push_str(&format!("\n}}  // namespace {ns}\n"));
    for (i, k) in src.kernels.iter().enumerate() {
        tu.push_str(&format!(
            "static ::fz_emu::Registrar fz_register_{i}(\"{k}\", \"{file}\", &{ns}::{k});\n",
            file = src.file
        ));
    }
    tu
}

/// A file name's stem as a C identifier (`norm.cu` -> `norm`).
fn unit_name(file: &str) -> String {
    let stem = file.rsplit_once('.').map_or(file, |(s, _)| s);
    stem.chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect()
}

/// The compiler's path and version line, part of every hash (a compiler upgrade rebuilds).
fn compiler_identity(cxx: &Path) -> Result<String, String> {
    let out = Command::new(cxx)
        .arg("--version")
        .output()
        .map_err(|e| format!("running {} --version: {e}", cxx.display()))?;
    let version = String::from_utf8_lossy(&out.stdout);
    Ok(format!(
        "{} {}",
        cxx.display(),
        version.lines().next().unwrap_or("")
    ))
}

/// Compiles the missing objects, a few compilers at a time (`$FERROZERO_EMU_JOBS`, default the
/// available parallelism up to 4).
fn compile_all(
    cxx: &Path,
    include: &Path,
    units: &[(String, PathBuf, PathBuf)],
) -> Result<(), String> {
    let jobs = std::env::var("FERROZERO_EMU_JOBS")
        .ok()
        .and_then(|s| s.parse::<usize>().ok())
        .filter(|&j| j > 0)
        .unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map_or(1, |n| n.get())
                .min(4)
        });
    let mut errors = Vec::new();
    for batch in units.chunks(jobs) {
        let mut running: Vec<(&String, &PathBuf, PathBuf, Child)> = Vec::new();
        for (name, cpp, obj) in batch {
            let tmp = temp_path(obj);
            let child = Command::new(cxx)
                .args(CXX_FLAGS)
                .arg("-I")
                .arg(include)
                .arg("-c")
                .arg(cpp)
                .arg("-o")
                .arg(&tmp)
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .map_err(|e| format!("running {}: {e}", cxx.display()))?;
            running.push((name, obj, tmp, child));
        }
        for (name, obj, tmp, child) in running {
            let out = child
                .wait_with_output()
                .map_err(|e| format!("waiting for {}: {e}", cxx.display()))?;
            if out.status.success() {
                std::fs::rename(&tmp, obj)
                    .map_err(|e| format!("renaming to {}: {e}", obj.display()))?;
            } else {
                let _ = std::fs::remove_file(&tmp);
                errors.push(format!(
                    "compiling {name} for the CUDA emulator failed:\n{}",
                    String::from_utf8_lossy(&out.stderr)
                ));
            }
        }
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors.join("\n"))
    }
}

/// Writes `text` to `path` unless it exists (content-addressed names: same name, same text),
/// through a temporary file and a rename so concurrent builders never see a partial file.
fn write_once(path: &Path, text: &str) -> Result<(), String> {
    if path.is_file() {
        return Ok(());
    }
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)
            .map_err(|e| format!("creating {}: {e}", parent.display()))?;
    }
    let tmp = temp_path(path);
    std::fs::write(&tmp, text).map_err(|e| format!("writing {}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, path).map_err(|e| format!("renaming to {}: {e}", path.display()))
}

/// A sibling of `path` unique to this process and call.
fn temp_path(path: &Path) -> PathBuf {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".tmp-{}-{n}", std::process::id()));
    path.with_file_name(name)
}

/// 64-bit FNV-1a over the parts, each followed by a separator byte (stable across Rust
/// versions and processes, unlike `DefaultHasher`'s contract).
fn hash_parts(parts: &[&str]) -> u64 {
    let mut h: u64 = 0xCBF2_9CE4_8422_2325;
    for part in parts {
        for b in part.bytes().chain(std::iter::once(0xff)) {
            h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01B3);
        }
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn translation_unit_wraps_the_program_and_registers_every_kernel() {
        let src = &kernels::SOURCES[0];
        let tu = translation_unit(src);
        assert!(tu.contains("#include \"emu.h\""));
        assert!(tu.contains(&kernels::program_text(src)));
        for k in src.kernels {
            assert!(
                tu.contains(&format!("(\"{k}\", \"{}\", &fz_k_", src.file)),
                "{k}"
            );
        }
    }

    #[test]
    fn only_our_build_products_are_pruned() {
        assert!(is_build_product("norm-0123456789abcdef.o"));
        assert!(is_build_product("norm-0123456789abcdef.cpp"));
        assert!(is_build_product("libfz_emu-0123456789abcdef.so"));
        assert!(is_build_product("include-0123456789abcdef"));
        assert!(!is_build_product("fz_emu.map"));
        assert!(!is_build_product("notes-2024.txt"));
        assert!(is_build_product("libfz_emu-0123456789abcdef.so.tmp-12-0"));
    }

    #[test]
    fn hashes_separate_their_parts() {
        assert_ne!(hash_parts(&["ab", "c"]), hash_parts(&["a", "bc"]));
        assert_eq!(unit_name("norm.cu"), "norm");
        assert_eq!(unit_name("a-b.cu"), "a_b");
    }
}
