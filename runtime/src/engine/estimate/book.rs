//! The replay's ledger as the device's allocator sees it: every device buffer counted at the
//! size the device really takes for it ([`MemoryModel::round`]: the CUDA caching allocator's
//! 512-byte blocks; exact on the CPU, so CPU figures are the engine ledger's own).

use crate::backend::MemoryModel;
use crate::engine::ledger::{Category, Ledger, Location};

/// A [`Ledger`] whose device entries are rounded to the device's allocation blocks.
pub(super) struct Book {
    ledger: Ledger,
    mem: MemoryModel,
}

impl Book {
    /// An empty book for a device described by `mem`.
    pub(super) fn new(mem: MemoryModel) -> Self {
        Book {
            ledger: Ledger::default(),
            mem,
        }
    }

    fn size(&self, loc: Location, bytes: u64) -> u64 {
        match loc {
            Location::Device => self.mem.round(bytes),
            Location::Host | Location::Nvme => bytes,
        }
    }

    /// One buffer of `bytes` comes alive at `loc`.
    pub(super) fn alloc(&mut self, loc: Location, cat: Category, bytes: u64) {
        let b = self.size(loc, bytes);
        self.ledger.alloc(loc, cat, b);
    }

    /// One buffer of `bytes` at `loc` dies.
    pub(super) fn free(&mut self, loc: Location, cat: Category, bytes: u64) {
        let b = self.size(loc, bytes);
        self.ledger.free(loc, cat, b);
    }

    /// The peaks so far.
    pub(super) fn ledger(&self) -> &Ledger {
        &self.ledger
    }
}
