//! `ferrozero report` (DeepSpeed's `ds_report`): what this machine and this build can do,
//! and for every missing capability, one line saying why and what to do.

use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// Arguments.
#[derive(clap::Args)]
pub struct Args {
    /// NVMe swap directories to check (free space, filesystem); the temp dir is always checked.
    #[arg(long = "nvme-path")]
    nvme_paths: Vec<PathBuf>,
}

/// One capability: its name, whether it is there, and a one-line detail or reason.
struct Line {
    name: &'static str,
    ok: bool,
    detail: String,
}

fn line(name: &'static str, ok: bool, detail: impl Into<String>) -> Line {
    Line {
        name,
        ok,
        detail: detail.into(),
    }
}

/// Runs the subcommand.
pub fn run(args: Args) -> ExitCode {
    let mut sections: Vec<(&str, Vec<Line>)> = vec![
        ("build", build_lines()),
        ("cpu and memory", cpu_lines()),
        ("storage", storage_lines(&args.nvme_paths)),
        ("communication and accelerators", accel_lines()),
    ];
    for (title, lines) in &mut sections {
        println!("-- {title}");
        for l in lines.iter() {
            let mark = if l.ok { "[OK]" } else { "[--]" };
            println!("{mark} {:<22} {}", l.name, l.detail);
        }
    }
    ExitCode::SUCCESS
}

fn build_lines() -> Vec<Line> {
    let feats: Vec<&str> = [
        ("mpi", cfg!(feature = "mpi")),
        ("cuda", cfg!(feature = "cuda")),
    ]
    .iter()
    .filter(|f| f.1)
    .map(|f| f.0)
    .collect();
    vec![
        line("ferrozero", true, env!("CARGO_PKG_VERSION")),
        line("os", true, os_description()),
        line(
            "features",
            true,
            if feats.is_empty() {
                "none (default build: CPU backend, local and TCP communicators)".to_string()
            } else {
                feats.join(", ")
            },
        ),
        line(
            "build profile",
            !cfg!(debug_assertions),
            if cfg!(debug_assertions) {
                "debug build: kernels run 10-50x slower; build with --release"
            } else {
                "release"
            },
        ),
    ]
}

fn os_description() -> String {
    let pretty = std::fs::read_to_string("/etc/os-release")
        .ok()
        .and_then(|t| {
            t.lines().find_map(|l| {
                l.strip_prefix("PRETTY_NAME=")
                    .map(|v| v.trim_matches('"').to_string())
            })
        })
        .unwrap_or_else(|| std::env::consts::OS.to_string());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown kernel".into());
    format!("{pretty}, kernel {kernel}, {}", std::env::consts::ARCH)
}

fn simd_features() -> (Vec<&'static str>, Vec<&'static str>) {
    let (mut have, mut lack) = (Vec::new(), Vec::new());
    #[cfg(target_arch = "x86_64")]
    {
        let checks = [
            ("sse4.2", std::is_x86_feature_detected!("sse4.2")),
            ("avx", std::is_x86_feature_detected!("avx")),
            ("avx2", std::is_x86_feature_detected!("avx2")),
            ("fma", std::is_x86_feature_detected!("fma")),
            ("f16c", std::is_x86_feature_detected!("f16c")),
            ("avx512f", std::is_x86_feature_detected!("avx512f")),
            ("avx512bw", std::is_x86_feature_detected!("avx512bw")),
            ("avx512vl", std::is_x86_feature_detected!("avx512vl")),
        ];
        for (n, ok) in checks {
            if ok {
                have.push(n)
            } else {
                lack.push(n)
            }
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        if std::arch::is_aarch64_feature_detected!("neon") {
            have.push("neon")
        } else {
            lack.push("neon")
        }
    }
    (have, lack)
}

fn cpu_lines() -> Vec<Line> {
    let (have, lack) = simd_features();
    let simd_ok = have.contains(&"avx2") || have.contains(&"neon");
    let mut simd = format!("detected: {}", have.join(" "));
    if !lack.is_empty() {
        simd.push_str(&format!(
            "; missing: {} (runtime dispatch uses the best present)",
            lack.join(" ")
        ));
    }
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let ram = ram_bytes();
    let memlock = memlock_detail();
    vec![
        line("simd", simd_ok, simd),
        line(
            "cores",
            cores > 0,
            format!("{cores} available to this process"),
        ),
        line(
            "ram",
            ram.is_some(),
            ram.map_or("cannot read /proc/meminfo".to_string(), |b| {
                format!("{} total", super::estimate::human(b))
            }),
        ),
        memlock,
    ]
}

/// Total RAM from `/proc/meminfo`.
pub fn ram_bytes() -> Option<u64> {
    let t = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kb: u64 = t
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kb * 1024)
}

/// The soft RLIMIT_MEMLOCK in bytes; `None` when unlimited or unreadable.
pub fn memlock_limit() -> Option<u64> {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `r` is a valid, writable rlimit for the duration of the call.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r) };
    (rc == 0 && r.rlim_cur != libc::RLIM_INFINITY).then_some(r.rlim_cur)
}

fn memlock_detail() -> Line {
    match memlock_limit() {
        None => line("locked memory", true, "RLIMIT_MEMLOCK unlimited: mlocked buffers can be as large as needed"),
        Some(b) if b >= 1 << 30 => line(
            "locked memory",
            true,
            format!("RLIMIT_MEMLOCK {}", super::estimate::human(b)),
        ),
        Some(b) => line(
            "locked memory",
            false,
            format!(
                "RLIMIT_MEMLOCK is only {}: mlocked offload buffers (pin_memory with NVMe offload) beyond it fail; raise it (ulimit -l unlimited, or memlock in /etc/security/limits.conf) or set pin_memory = false. A GPU's page-locked host memory (cuMemHostRegister) is not charged against it, only against host RAM",
                super::estimate::human(b)
            ),
        ),
    }
}

fn storage_lines(extra: &[PathBuf]) -> Vec<Line> {
    let mut v = vec![io_uring_line()];
    let mut paths = vec![std::env::temp_dir()];
    paths.extend(extra.iter().cloned());
    for p in paths {
        v.push(path_line(&p));
    }
    v
}

/// Probes io_uring by creating (and closing) a one-entry ring.
fn io_uring_line() -> Line {
    let mut params = [0u8; 120];
    // SAFETY: io_uring_setup reads and writes a 120-byte io_uring_params struct, which
    // `params` provides zeroed; the returned fd is closed below.
    let fd = unsafe { libc::syscall(libc::SYS_io_uring_setup, 1u32, params.as_mut_ptr()) };
    if fd >= 0 {
        // SAFETY: `fd` is a file descriptor this function just opened and owns.
        unsafe { libc::close(fd as libc::c_int) };
        return line("io_uring", true, "available: NVMe swaps use io_uring");
    }
    let err = std::io::Error::last_os_error();
    let why = match err.raw_os_error() {
        Some(libc::ENOSYS) => "the kernel has no io_uring (older than 5.1 or built without it)",
        Some(libc::EPERM) => "denied (sysctl kernel.io_uring_disabled or a seccomp policy)",
        _ => "io_uring_setup failed",
    };
    line(
        "io_uring",
        false,
        format!("{why} ({err}); NVMe swaps fall back to a pread/pwrite thread pool"),
    )
}

fn fs_name(magic: i64) -> &'static str {
    match magic {
        0xEF53 => "ext4",
        0x5846_5342 => "xfs",
        0x0102_1994 => "tmpfs",
        0x9123_683E => "btrfs",
        0x794C_7630 => "overlayfs",
        0x6969 => "nfs",
        0x2FC1_2FC1 => "zfs",
        0xF2F5_2010 => "f2fs",
        _ => "other",
    }
}

fn path_line(p: &Path) -> Line {
    let name = "swap path";
    let Ok(c) = CString::new(p.as_os_str().as_encoded_bytes()) else {
        return line(
            name,
            false,
            format!("{}: path contains a NUL byte", p.display()),
        );
    };
    // SAFETY: all-zero is a valid statfs; `c` is a NUL-terminated path and `s` is writable.
    let mut s: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: see above.
    if unsafe { libc::statfs(c.as_ptr(), &mut s) } != 0 {
        let e = std::io::Error::last_os_error();
        return line(name, false, format!("{}: cannot stat ({e})", p.display()));
    }
    let free = s.f_bavail as u64 * s.f_bsize as u64;
    let fs = fs_name(s.f_type as i64);
    let note = match fs {
        "tmpfs" => "; tmpfs is RAM, not NVMe, and may refuse O_DIRECT",
        "overlayfs" | "nfs" => "; O_DIRECT may be unsupported here: use a local NVMe mount",
        _ => "",
    };
    line(
        name,
        true,
        format!(
            "{}: {} free, {fs}{note}",
            p.display(),
            super::estimate::human(free)
        ),
    )
}

fn on_path(exe: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(exe))
        .find(|f| f.is_file())
}

/// Tries to dlopen the first loadable of `names`; returns the name or dlerror's message.
fn loadable(names: &[&str]) -> Result<String, String> {
    let mut last = String::new();
    for n in names {
        let c = CString::new(*n).map_err(|e| e.to_string())?;
        // SAFETY: `c` is NUL-terminated; the handle is closed right away and no symbol used.
        let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL) };
        if !h.is_null() {
            // SAFETY: `h` is a live handle from dlopen.
            unsafe { libc::dlclose(h) };
            return Ok(n.to_string());
        }
        // SAFETY: dlerror returns a thread-local C string or null.
        let e = unsafe { libc::dlerror() };
        if !e.is_null() {
            // SAFETY: non-null dlerror result is a valid C string until the next dl call.
            last = unsafe { std::ffi::CStr::from_ptr(e) }
                .to_string_lossy()
                .into_owned();
        }
    }
    Err(last)
}

fn accel_lines() -> Vec<Line> {
    let mpirun = on_path("mpirun");
    let mpi = match (cfg!(feature = "mpi"), &mpirun) {
        (true, Some(p)) => line("mpi", true, format!("compiled in; mpirun at {}", p.display())),
        (true, None) => line("mpi", false, "compiled in, but mpirun is not on PATH (apt-get install openmpi-bin)"),
        (false, Some(p)) => line("mpi", false, format!("mpirun at {} but this build lacks the `mpi` feature (rebuild with --features mpi)", p.display())),
        (false, None) => line("mpi", false, "not compiled in (--features mpi) and no mpirun on PATH; the local and TCP communicators work"),
    };
    let gpu = Path::new("/dev/nvidia0").exists();
    let cuda = match loadable(&["libcuda.so.1", "libcuda.so"]) {
        Ok(n) if gpu => line(
            "cuda driver",
            true,
            format!("{n} loads; /dev/nvidia0 present"),
        ),
        Ok(n) => line(
            "cuda driver",
            false,
            format!("{n} loads but no /dev/nvidia0: no GPU visible to this machine"),
        ),
        Err(e) => line(
            "cuda driver",
            false,
            format!(
                "libcuda not loadable ({e}): no NVIDIA driver installed{}",
                if gpu { "" } else { ", and no GPU here" }
            ),
        ),
    };
    let nccl = match loadable(&["libnccl.so.2", "libnccl.so"]) {
        Ok(n) => line("nccl", true, format!("{n} loads")),
        Err(e) => line("nccl", false, format!("libnccl not loadable ({e}): install nvidia-nccl-cu12 and link libnccl.so -> libnccl.so.2")),
    };
    let mut lines = vec![mpi, cuda, nccl];
    lines.extend(cuda_backend_lines());
    lines
}

/// The CUDA backend: each GPU with its driver, NVRTC and cuBLASLt versions, or why there is none.
#[cfg(feature = "cuda")]
fn cuda_backend_lines() -> Vec<Line> {
    use ferrozero::runtime::backend::cuda::driver;
    let nvrtc = match driver::nvrtc::version() {
        Ok((a, b)) => line(
            "nvrtc",
            true,
            format!("NVRTC {a}.{b} compiles ferrozero's kernels at first use (cached on disk)"),
        ),
        Err(e) => line("nvrtc", false, e.to_string()),
    };
    let mut out = match driver::device_count() {
        Ok(0) => vec![line(
            "cuda backend",
            false,
            "compiled in, but the driver reports no GPU: the CPU backend runs",
        )],
        Ok(n) => (0..n)
            .map(|i| match driver::open(i) {
                Ok(d) => line("gpu", true, d.info().to_string()),
                Err(e) => line("gpu", false, format!("device {i} does not open: {e}")),
            })
            .collect(),
        Err(e) => vec![line(
            "cuda backend",
            false,
            format!("compiled in; {e}; the CPU backend runs"),
        )],
    };
    out.push(nvrtc);
    out
}

#[cfg(not(feature = "cuda"))]
fn cuda_backend_lines() -> Vec<Line> {
    vec![line(
        "cuda backend",
        false,
        "not compiled in (rebuild with --features cuda); the CPU backend runs",
    )]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_missing_capability_says_why() {
        let all: Vec<Line> = [
            build_lines(),
            cpu_lines(),
            storage_lines(&[PathBuf::from("/nonexistent-ferrozero-path")]),
            accel_lines(),
        ]
        .into_iter()
        .flatten()
        .collect();
        assert!(all.len() >= 12);
        for l in &all {
            assert!(!l.detail.is_empty(), "{}", l.name);
            // A missing capability comes with its reason.
            assert!(l.ok || l.detail.len() > 30, "{}: `{}`", l.name, l.detail);
            assert!(!l.detail.contains('\n'), "{}: one line", l.name);
        }
        // A path that does not exist is reported, not a panic.
        assert!(all
            .iter()
            .any(|l| !l.ok && l.detail.contains("nonexistent")));
    }

    #[test]
    fn host_facts_are_read() {
        assert!(ram_bytes().unwrap() > 1 << 26);
        assert!(fs_name(0xEF53) == "ext4" && fs_name(1) == "other");
        assert!(loadable(&["libdefinitely-not-here.so.9"]).is_err());
        assert!(loadable(&["libc.so.6"]).is_ok());
    }
}
