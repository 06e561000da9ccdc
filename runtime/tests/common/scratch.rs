//! Swap and checkpoint directories that are removed when the test ends, pass or fail: NVMe
//! swap files are preallocated, and a CI disk filled by earlier runs' leftovers fails
//! unrelated tests with "No space left on device".

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

/// A temporary root; every `dir()` is a fresh path under it, and dropping the root removes all.
pub struct Scratch {
    root: tempfile::TempDir,
    next: AtomicUsize,
}

impl Scratch {
    /// A new root under the system's temporary directory, named for the test binary.
    pub fn new() -> Self {
        let root = tempfile::Builder::new()
            .prefix("fz-test-")
            .tempdir()
            .expect("create a temporary directory");
        Scratch {
            root,
            next: AtomicUsize::new(0),
        }
    }

    /// A path that does not exist yet (each engine owns and locks its own swap directory).
    pub fn dir(&self) -> PathBuf {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        self.root.path().join(format!("d{n}"))
    }
}
