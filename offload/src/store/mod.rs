//! The NVMe tensor store: named byte tensors in files under a swap directory it owns,
//! moved with O_DIRECT in `block_size` requests by io_uring (or a pread/pwrite fallback),
//! every block checksummed.
//!
//! ```no_run
//! # use ferrozero_offload::store::{AioSettings, NvmeStore};
//! let store = NvmeStore::open("/nvme/swap/run-1".as_ref(), &AioSettings::default())?;
//! store.write("layer.0.m", &[1u8; 10_000])?;
//! let mut back = vec![0u8; 10_000];
//! store.read("layer.0.m", &mut back)?;
//! # Ok::<(), ferrozero_offload::Error>(())
//! ```
//!
//! A tensor file is its bytes padded to whole blocks. The checksums live in memory: swap
//! files only live as long as the store (they are removed on drop), and anything that
//! changes them underneath us is exactly what the checksums catch.

mod asynch;
mod dir;
mod engine;
mod iobuf;
mod lane;
mod ring;
mod settings;

use std::collections::HashMap;
use std::fs::OpenOptions;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

pub use asynch::Pending;
pub use dir::LOCK_FILE;
pub use engine::Engine;
pub use iobuf::{IoDst, IoSrc};
pub use settings::{AioSettings, EngineChoice, Overlap, Submit};

use crate::{Error, Result};
use engine::Lanes;
use lane::{Data, Target};

/// Bytes a store has moved.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Traffic {
    /// Bytes read.
    pub read: u64,
    /// Bytes written.
    pub written: u64,
}

impl std::ops::Add for Traffic {
    type Output = Traffic;
    fn add(self, o: Traffic) -> Traffic {
        Traffic {
            read: self.read + o.read,
            written: self.written + o.written,
        }
    }
}

impl std::ops::Sub for Traffic {
    type Output = Traffic;
    fn sub(self, o: Traffic) -> Traffic {
        Traffic {
            read: self.read.saturating_sub(o.read),
            written: self.written.saturating_sub(o.written),
        }
    }
}

/// What the store knows about one tensor.
#[derive(Clone)]
struct Entry {
    len: usize,
    crcs: Arc<Vec<u32>>,
}

/// Where a store's bytes go: files in its directory, or nowhere (a meta store, which keeps
/// only each tensor's length, so a size-only run of the engine prices its NVMe traffic and
/// footprint without a directory, a file or a byte moved).
enum Medium {
    /// Swap files in the store's directory.
    Files {
        direct: bool,
        lanes: Lanes,
        // Dropped last (declared last): files are removed while the lock is still held.
        _lock: dir::DirLock,
    },
    /// No files: writes record lengths, reads leave their buffers untouched.
    Meta,
}

/// Shared state, used by the caller's thread and the async workers.
struct Inner {
    dir: PathBuf,
    settings: AioSettings,
    index: RwLock<HashMap<String, Entry>>,
    /// Bytes read and written successfully since open (tensor bytes, not padding).
    moved: [AtomicU64; 2],
    medium: Medium,
}

/// A directory of swap files owned by this process for its lifetime.
///
/// Operations on different keys may run concurrently (from any thread and the async forms);
/// the caller orders operations on one key (a read racing a rewrite of the same key is a
/// caller bug, though the checksums make it an error rather than garbage).
pub struct NvmeStore {
    inner: Arc<Inner>,
    workers: asynch::Workers,
}

impl NvmeStore {
    /// Takes `dir` (created if missing; refused if another store holds it), removes tensor
    /// files a crashed run left, and starts the I/O engine `settings` ask for.
    pub fn open(dir: &Path, settings: &AioSettings) -> Result<NvmeStore> {
        settings.validate()?;
        let lock = dir::DirLock::acquire(dir)?;
        let stale = dir::remove_stale(dir);
        if stale > 0 {
            tracing::warn!(dir = %dir.display(), stale, "removed swap files of an earlier run");
        }
        let direct = dir::supports_direct(dir);
        if !direct {
            tracing::warn!(dir = %dir.display(), "file system refuses O_DIRECT; using buffered I/O");
        }
        let lanes = Lanes::start(settings, asynch::WORKERS + 1)?;
        tracing::info!(engine = lanes.engine().name(), dir = %dir.display(), "NVMe store open");
        let medium = Medium::Files {
            direct,
            lanes,
            _lock: lock,
        };
        Ok(Self::start(dir.to_path_buf(), *settings, medium))
    }

    /// A store with no directory and no files that keeps each tensor's length: writes and
    /// reads check keys and lengths as a real store does and move nothing (a read leaves its
    /// buffer as it was). What a size-only run of the engine swaps through.
    pub fn meta(settings: &AioSettings) -> Result<NvmeStore> {
        settings.validate()?;
        Ok(Self::start(
            PathBuf::from("(meta)"),
            *settings,
            Medium::Meta,
        ))
    }

    fn start(dir: PathBuf, settings: AioSettings, medium: Medium) -> NvmeStore {
        let inner = Arc::new(Inner {
            dir,
            settings,
            index: RwLock::new(HashMap::new()),
            moved: [AtomicU64::new(0), AtomicU64::new(0)],
            medium,
        });
        let workers = asynch::Workers::start(&inner);
        NvmeStore { inner, workers }
    }

    /// Whether this store moves no bytes ([`NvmeStore::meta`]).
    pub fn is_meta(&self) -> bool {
        matches!(self.inner.medium, Medium::Meta)
    }

    /// The engine in use (io_uring, the thread fallback, or none for a meta store).
    pub fn engine(&self) -> Engine {
        match &self.inner.medium {
            Medium::Files { lanes, .. } => lanes.engine(),
            Medium::Meta => Engine::Meta,
        }
    }

    /// Why the fallback was chosen, when it was.
    pub fn engine_note(&self) -> Option<&str> {
        match &self.inner.medium {
            Medium::Files { lanes, .. } => lanes.note(),
            Medium::Meta => None,
        }
    }

    /// Whether I/O bypasses the page cache (O_DIRECT).
    pub fn is_direct(&self) -> bool {
        matches!(self.inner.medium, Medium::Files { direct: true, .. })
    }

    /// The swap directory.
    pub fn dir(&self) -> &Path {
        &self.inner.dir
    }

    /// The settings in use.
    pub fn settings(&self) -> &AioSettings {
        &self.inner.settings
    }

    /// Tensor bytes read and written successfully since the store opened (synchronous and
    /// asynchronous operations alike), for traffic reports.
    pub fn bytes_moved(&self) -> Traffic {
        Traffic {
            read: self.inner.moved[0].load(Ordering::Relaxed),
            written: self.inner.moved[1].load(Ordering::Relaxed),
        }
    }

    /// Bytes stored under `key`, if present.
    pub fn len_of(&self, key: &str) -> Option<usize> {
        self.inner.index().get(key).map(|e| e.len)
    }

    /// Writes `data` under `key`, replacing what was there.
    pub fn write(&self, key: &str, data: &[u8]) -> Result<()> {
        self.inner.write(key, data)
    }

    /// Reads `key` into `dst`, whose length must equal the stored length; every block is
    /// verified against its checksum.
    pub fn read(&self, key: &str, dst: &mut [u8]) -> Result<()> {
        self.inner.read(key, dst)
    }

    /// Writes `len` bytes of `src` under `key`: [`NvmeStore::write`] for any [`IoSrc`], a
    /// size-only one included (which only a meta store accepts).
    pub fn write_from(&self, key: &str, src: &(impl IoSrc + ?Sized), len: usize) -> Result<()> {
        self.inner
            .write_from(key, src, len, "NvmeStore::write_from")
    }

    /// Reads `key`'s `len` bytes into `dst`: [`NvmeStore::read`] for any [`IoDst`], a
    /// size-only one included (which only a meta store accepts, leaving it as it is).
    pub fn read_into(&self, key: &str, dst: &mut (impl IoDst + ?Sized), len: usize) -> Result<()> {
        self.inner.read_into(key, dst, len, "NvmeStore::read_into")
    }

    /// Removes `key` and its file.
    pub fn remove(&self, key: &str) -> Result<()> {
        self.inner.remove(key)
    }

    /// Starts writing `buf[..len]` under `key` on a background thread; the buffer comes back
    /// from [`Pending::wait`].
    pub fn submit_write<B>(&self, key: &str, buf: B, len: usize) -> Pending<B>
    where
        B: IoSrc + Send + 'static,
    {
        self.workers.submit_write(key, buf, len)
    }

    /// Starts reading `key` into `buf[..len]` on a background thread.
    pub fn submit_read<B>(&self, key: &str, buf: B, len: usize) -> Pending<B>
    where
        B: IoDst + Send + 'static,
    {
        self.workers.submit_read(key, buf, len)
    }
}

impl Inner {
    fn index(&self) -> std::sync::RwLockReadGuard<'_, HashMap<String, Entry>> {
        self.index.read().unwrap_or_else(|p| p.into_inner())
    }

    fn index_mut(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<String, Entry>> {
        self.index.write().unwrap_or_else(|p| p.into_inner())
    }

    fn open_file(&self, key: &str, write: bool, direct: bool) -> Result<(std::fs::File, PathBuf)> {
        let path = self.dir.join(dir::file_name(key)?);
        let mut o = OpenOptions::new();
        o.read(true).write(write).create(write).truncate(false);
        if direct {
            o.custom_flags(libc::O_DIRECT);
        }
        let file = o.open(&path).map_err(|source| Error::Io {
            op: "open",
            path: path.display().to_string(),
            offset: 0,
            tensor: key.to_string(),
            source,
        })?;
        Ok((file, path))
    }

    fn write(&self, key: &str, data: &[u8]) -> Result<()> {
        // Forget the old contents first: a failed write must not leave stale bytes readable.
        self.index_mut().remove(key);
        let crcs = match &self.medium {
            Medium::Files { direct, lanes, .. } => self.write_file(key, data, *direct, lanes)?,
            Medium::Meta => {
                dir::file_name(key)?;
                Vec::new()
            }
        };
        self.record(key, data.len(), crcs);
        Ok(())
    }

    /// Enters `key` as written: `len` bytes with their blocks' checksums.
    fn record(&self, key: &str, len: usize, crcs: Vec<u32>) {
        let entry = Entry {
            len,
            crcs: Arc::new(crcs),
        };
        self.index_mut().insert(key.to_string(), entry);
        self.moved[1].fetch_add(len as u64, Ordering::Relaxed);
    }

    /// Writes `data` to `key`'s file; returns its blocks' checksums.
    fn write_file(&self, key: &str, data: &[u8], direct: bool, lanes: &Lanes) -> Result<Vec<u32>> {
        let (file, path) = self.open_file(key, true, direct)?;
        let bs = self.settings.block_size;
        let padded = (data.len().div_ceil(bs) * bs) as u64;
        reserve(&file, padded).map_err(|source| Error::Io {
            op: "allocate",
            path: path.display().to_string(),
            offset: 0,
            tensor: key.to_string(),
            source,
        })?;
        let mut crcs = vec![0u32; data.len().div_ceil(bs)];
        let t = self.target(&file, &path, key);
        lanes.run(
            &t,
            Data::Write {
                src: data,
                crcs: &mut crcs,
            },
        )?;
        Ok(crcs)
    }

    fn read(&self, key: &str, dst: &mut [u8]) -> Result<()> {
        let entry = self.entry(key, dst.len())?;
        let n = dst.len() as u64;
        if let Medium::Files { direct, lanes, .. } = &self.medium {
            let (file, path) = self.open_file(key, false, *direct)?;
            let t = self.target(&file, &path, key);
            lanes.run(
                &t,
                Data::Read {
                    dst,
                    crcs: &entry.crcs,
                },
            )?;
        }
        self.moved[0].fetch_add(n, Ordering::Relaxed);
        Ok(())
    }

    /// A read of `key` that moves nothing (a size-only buffer): its length checked, counted.
    fn read_len(&self, key: &str, len: usize) -> Result<()> {
        self.entry(key, len)?;
        self.moved[0].fetch_add(len as u64, Ordering::Relaxed);
        Ok(())
    }

    /// `key`'s entry, which must hold `len` bytes.
    fn entry(&self, key: &str, len: usize) -> Result<Entry> {
        let entry = self
            .index()
            .get(key)
            .cloned()
            .ok_or_else(|| Error::Invalid {
                op: "NvmeStore::read",
                detail: format!("no tensor {key:?} in {}", self.dir.display()),
            })?;
        if len != entry.len {
            return Err(Error::Length {
                op: "NvmeStore::read",
                detail: format!("tensor {key:?} holds {} bytes, buffer is {len}", entry.len),
            });
        }
        Ok(entry)
    }

    fn remove(&self, key: &str) -> Result<()> {
        self.index_mut().remove(key);
        if let Medium::Meta = self.medium {
            return Ok(());
        }
        let path = self.dir.join(dir::file_name(key)?);
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(Error::Io {
                op: "remove",
                path: path.display().to_string(),
                offset: 0,
                tensor: key.to_string(),
                source: e,
            }),
            _ => Ok(()),
        }
    }

    fn target<'a>(&self, file: &std::fs::File, path: &'a Path, key: &'a str) -> Target<'a> {
        Target {
            fd: file.as_raw_fd(),
            path,
            key,
            block: self.settings.block_size,
            submit: self.settings.submit,
            overlap: self.settings.overlap,
        }
    }
}

/// Sizes the file to exactly `len` bytes with the blocks allocated, so a full disk fails
/// here, before any data moves, rather than halfway through a tensor.
fn reserve(file: &std::fs::File, len: u64) -> std::io::Result<()> {
    file.set_len(len)?;
    if len == 0 {
        return Ok(());
    }
    // SAFETY: fallocate on a descriptor we own.
    let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len as libc::off_t) };
    if rc == 0 {
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        // The file system cannot preallocate: the write itself will report ENOSPC.
        Some(libc::EOPNOTSUPP) => Ok(()),
        _ => Err(e),
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let keys: Vec<String> = self.index_mut().keys().cloned().collect();
        for key in keys {
            let _ = self.remove(&key);
        }
        if let Medium::Files { .. } = self.medium {
            dir::remove_stale(&self.dir);
        }
    }
}
