//! The swap directory a store owns: its lock file, tensor file names, and cleanup.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// Name of the lock file inside a swap directory.
pub const LOCK_FILE: &str = ".ferrozero-swap.lock";
const PREFIX: &str = "t-";
const SUFFIX: &str = ".swp";

/// A held exclusive lock on a swap directory; released (and the lock file removed) on drop.
pub(super) struct DirLock {
    file: File,
    path: PathBuf,
}

fn resource(dir: &Path, what: &str, e: std::io::Error) -> Error {
    Error::Resource(format!("swap directory {}: {what}: {e}", dir.display()))
}

impl DirLock {
    /// Creates `dir` if needed and takes its lock, refusing if another store holds it.
    pub(super) fn acquire(dir: &Path) -> Result<DirLock> {
        std::fs::create_dir_all(dir).map_err(|e| resource(dir, "cannot create", e))?;
        let path = dir.join(LOCK_FILE);
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&path)
            .map_err(|e| resource(dir, "cannot open the lock file", e))?;
        // SAFETY: flock on a descriptor we own.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let e = std::io::Error::last_os_error();
            let holder = std::fs::read_to_string(&path).unwrap_or_default();
            return Err(Error::Resource(format!(
                "swap directory {} is in use by another store ({}): {e}; give each run its own \
                 nvme_path",
                dir.display(),
                holder.trim()
            )));
        }
        let _ = file.set_len(0);
        let _ = writeln!(file, "pid {}", std::process::id());
        Ok(DirLock { file, path })
    }
}

impl Drop for DirLock {
    fn drop(&mut self) {
        // Remove before unlocking so a waiting store never sees a stale file it did not lock.
        let _ = std::fs::remove_file(&self.path);
        // SAFETY: unlocking our own descriptor.
        unsafe { libc::flock(self.file.as_raw_fd(), libc::LOCK_UN) };
    }
}

/// The file name of a tensor key: safe characters kept, everything else `%XX`-escaped, so
/// distinct keys never share a file and no key escapes the directory.
pub(super) fn file_name(key: &str) -> Result<String> {
    if key.is_empty() {
        return Err(invalid("an empty tensor key".into()));
    }
    let mut name = String::from(PREFIX);
    for b in key.bytes() {
        if b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.' {
            name.push(b as char);
        } else {
            name.push_str(&format!("%{b:02X}"));
        }
    }
    name.push_str(SUFFIX);
    if name.len() > 255 {
        return Err(invalid(format!(
            "tensor key too long for a file name: {key:?}"
        )));
    }
    Ok(name)
}

fn invalid(detail: String) -> Error {
    Error::Invalid {
        op: "NvmeStore",
        detail,
    }
}

/// Removes tensor files left by a run that did not exit cleanly (we hold the lock, so they
/// are nobody's); returns how many.
pub(super) fn remove_stale(dir: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .filter(|e| {
            let n = e.file_name();
            let n = n.to_string_lossy();
            n.starts_with(PREFIX) && n.ends_with(SUFFIX)
        })
        .filter(|e| std::fs::remove_file(e.path()).is_ok())
        .count()
}

/// Whether the file system under `dir` accepts O_DIRECT (tmpfs before Linux 6.6 and some
/// network file systems do not).
pub(super) fn supports_direct(dir: &Path) -> bool {
    let probe = dir.join(".ferrozero-direct-probe");
    let ok = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT)
        .open(&probe)
        .is_ok();
    let _ = std::fs::remove_file(&probe);
    ok
}

#[cfg(test)]
mod tests {
    use super::file_name;

    #[test]
    fn keys_map_to_distinct_safe_names() {
        assert_eq!(file_name("layer.0/w").unwrap(), "t-layer.0%2Fw.swp");
        assert_ne!(file_name("a/b").unwrap(), file_name("a%2Fb").unwrap());
        assert!(file_name("").is_err());
        assert!(file_name(&"x".repeat(300)).is_err());
        assert!(!file_name("../../etc/passwd").unwrap().contains('/'));
    }
}
