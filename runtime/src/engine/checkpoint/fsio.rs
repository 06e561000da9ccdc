//! Durable file-system steps: fsync of files and directories, checksums, and publishing a
//! directory or a small file by rename so that readers see either the old or the new one.

use std::fs::File;
use std::io::{Read, Write};
use std::path::Path;

use crate::{Error, Result};

/// Wraps an I/O error with the path and the action.
pub fn io_err(what: &str, path: &Path, e: std::io::Error) -> Error {
    if e.kind() == std::io::ErrorKind::NotFound {
        return Error::File {
            path: path.display().to_string(),
            reason: format!("missing (while trying to {what})"),
        };
    }
    Error::Io {
        context: format!("{what} {}", path.display()),
        source: e,
    }
}

/// Reads a whole (small) file.
pub fn read_file(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| io_err("read", path, e))
}

/// Makes a directory's entries (creations, renames) durable.
pub fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(|e| io_err("fsync directory", dir, e))
}

/// Writes `bytes` to `path` and fsyncs it.
pub fn write_durable(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = File::create(path).map_err(|e| io_err("create", path, e))?;
    f.write_all(bytes)
        .and_then(|()| f.sync_all())
        .map_err(|e| io_err("write", path, e))
}

/// Size and CRC-32C of a file, read in bounded chunks.
pub fn file_crc(path: &Path) -> Result<(u64, u32)> {
    let mut f = File::open(path).map_err(|e| io_err("open", path, e))?;
    let mut buf = vec![0u8; 1 << 20];
    let (mut crc, mut size) = (0u32, 0u64);
    loop {
        let n = f.read(&mut buf).map_err(|e| io_err("read", path, e))?;
        if n == 0 {
            return Ok((size, crc));
        }
        crc = crc32c::crc32c_append(crc, &buf[..n]);
        size += n as u64;
    }
}

/// Replaces `small` file contents atomically: temp file, fsync, rename, fsync directory.
pub fn replace_file(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let tmp = dir.join(format!(".{name}.tmp"));
    write_durable(&tmp, bytes)?;
    std::fs::rename(&tmp, path).map_err(|e| io_err("rename into place", path, e))?;
    sync_dir(dir)
}

/// Publishes the complete directory `tmp` as `dst`. An existing `dst` is swapped out in one
/// atomic step (so a reader never finds `dst` missing) and then removed.
pub fn publish_dir(tmp: &Path, dst: &Path) -> Result<()> {
    let parent = dst.parent().unwrap_or(Path::new("."));
    if dst.exists() {
        exchange(tmp, dst)?;
        sync_dir(parent)?;
        std::fs::remove_dir_all(tmp).map_err(|e| io_err("remove replaced checkpoint", tmp, e))?;
    } else {
        std::fs::rename(tmp, dst).map_err(|e| io_err("publish checkpoint", dst, e))?;
    }
    sync_dir(parent)
}

#[cfg(target_os = "linux")]
fn exchange(a: &Path, b: &Path) -> Result<()> {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &Path| {
        CString::new(p.as_os_str().as_bytes())
            .map_err(|_| Error::Invalid(format!("path {} contains a NUL byte", p.display())))
    };
    let (ca, cb) = (c(a)?, c(b)?);
    // SAFETY: both pointers are valid NUL-terminated strings that outlive the call.
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            ca.as_ptr(),
            libc::AT_FDCWD,
            cb.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    if rc != 0 {
        return Err(io_err(
            "atomically replace existing checkpoint",
            b,
            std::io::Error::last_os_error(),
        ));
    }
    Ok(())
}

#[cfg(not(target_os = "linux"))]
fn exchange(_a: &Path, b: &Path) -> Result<()> {
    Err(Error::File {
        path: b.display().to_string(),
        reason: "already exists; replacing a checkpoint atomically needs Linux".into(),
    })
}
