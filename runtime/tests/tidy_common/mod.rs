//! Helpers shared by the `tidy_*` tests, which read the runtime's sources as text.

use std::path::{Path, PathBuf};

/// Every `.rs` file at or below `p`, in sorted order (so failures list in a stable order).
pub fn rust_files(p: &Path, out: &mut Vec<PathBuf>) {
    if p.is_dir() {
        let mut entries: Vec<_> = std::fs::read_dir(p)
            .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
            .flatten()
            .map(|e| e.path())
            .collect();
        entries.sort();
        for e in entries {
            rust_files(&e, out);
        }
    } else if p.extension().is_some_and(|x| x == "rs") {
        out.push(p.to_path_buf());
    }
}
