//! Small facts about the host read from the kernel: the locked-memory limit, whether this
//! process may ignore it, available RAM and free disk space.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use crate::{Error, Result};

/// The locked-memory limit of this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemlockLimit {
    /// `RLIMIT_MEMLOCK` is infinite, or the process holds `CAP_IPC_LOCK` (root): the kernel
    /// does not enforce a cap.
    Unlimited,
    /// The soft limit in bytes.
    Bytes(u64),
}

impl std::fmt::Display for MemlockLimit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MemlockLimit::Unlimited => write!(f, "unlimited"),
            MemlockLimit::Bytes(b) => write!(f, "{b} bytes ({})", human(*b)),
        }
    }
}

/// Bytes as a short human figure (binary units).
pub fn human(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    format!("{v:.1} {}", UNITS[u])
}

/// Reads `RLIMIT_MEMLOCK` and `CAP_IPC_LOCK` (which lets the kernel ignore the limit).
pub fn memlock_limit() -> MemlockLimit {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit struct that we own.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) };
    if rc != 0 || lim.rlim_cur == libc::RLIM_INFINITY || has_cap_ipc_lock() {
        return if rc != 0 {
            MemlockLimit::Bytes(0)
        } else {
            MemlockLimit::Unlimited
        };
    }
    MemlockLimit::Bytes(lim.rlim_cur)
}

/// The soft and hard `RLIMIT_MEMLOCK` in bytes (`None` = infinite), ignoring capabilities.
pub fn memlock_rlimit() -> (Option<u64>, Option<u64>) {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit struct that we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) } != 0 {
        return (Some(0), Some(0));
    }
    let finite = |v: libc::rlim_t| (v != libc::RLIM_INFINITY).then_some(v);
    (finite(lim.rlim_cur), finite(lim.rlim_max))
}

/// Raises the soft `RLIMIT_MEMLOCK` to `bytes` (`None`: infinite), at most the hard limit,
/// which an unprivileged process may not exceed.
pub fn raise_memlock_soft(bytes: Option<u64>) -> std::io::Result<()> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit read and write one rlimit struct that we own.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        lim.rlim_cur = bytes.map_or(libc::RLIM_INFINITY, |b| b as libc::rlim_t);
        if libc::setrlimit(libc::RLIMIT_MEMLOCK, &lim) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// The name of the effective user (for `limits.conf` lines), or `*` when it has none.
pub fn user_name() -> String {
    // SAFETY: getpwuid returns a pointer into static storage or null; the name is copied out
    // at once (nothing else in this process calls getpwuid concurrently in practice, and a
    // torn read would only garble a message).
    unsafe {
        let pw = libc::getpwuid(libc::geteuid());
        if pw.is_null() || (*pw).pw_name.is_null() {
            return "*".into();
        }
        std::ffi::CStr::from_ptr((*pw).pw_name)
            .to_string_lossy()
            .into_owned()
    }
}

/// Whether the effective capability set holds `CAP_IPC_LOCK` (bit 14).
fn has_cap_ipc_lock() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|h| u64::from_str_radix(h.trim(), 16).ok())
        .is_some_and(|caps| caps & (1 << 14) != 0)
}

/// `MemAvailable` from /proc/meminfo, in bytes.
pub fn mem_available() -> Result<u64> {
    let text = std::fs::read_to_string("/proc/meminfo")
        .map_err(|e| Error::Resource(format!("cannot read /proc/meminfo: {e}")))?;
    text.lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .ok_or_else(|| Error::Resource("no MemAvailable line in /proc/meminfo".into()))
}

/// Free bytes available to unprivileged users on the file system holding `path` (statvfs).
pub fn free_space(path: &Path) -> Result<u64> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| Error::Resource(format!("path {} contains a NUL byte", path.display())))?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `c` is a valid C string and statvfs fills the struct on success.
    let rc = unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        return Err(Error::Resource(format!(
            "cannot query free space of {}: {e}",
            path.display()
        )));
    }
    // SAFETY: statvfs returned 0, so the struct is initialised.
    let st = unsafe { st.assume_init() };
    // The field types are narrower on 32-bit targets.
    #[allow(clippy::unnecessary_cast)]
    let free = (st.f_bavail as u64).saturating_mul(st.f_frsize as u64);
    Ok(free)
}
