//! The per-rank memory ledger: every buffer the engine allocates is counted by location and
//! category, with current and peak bytes.
//!
//! On a CPU-only run "device" means the working set that would sit in GPU memory, so a user
//! can rehearse a GPU memory budget on a CPU machine.
//!
//! The ledger also enforces `device_memory_limit` on every backend: an allocation that takes
//! the device total past the cap is recorded as a breach, and the engine turns the first
//! breach into [`Error::DeviceMemory`] at its next check (after each unit's forward and
//! backward, after the step). Recording instead of refusing keeps `alloc` infallible at its
//! many call sites; the bytes it counts are host memory on the CPU and already refused by the
//! caching allocator on a GPU, so nothing is lost between the breach and the check.

use serde::Serialize;

use crate::{Error, Result};

/// Where bytes live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum Location {
    /// Accelerator memory (on CPU runs: the working set).
    Device,
    /// Host memory holding offloaded state.
    Host,
    /// NVMe swap files.
    Nvme,
}

/// What the bytes are for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum Category {
    /// Low-precision (or f32) parameter copies used by compute.
    Parameters,
    /// Gradient accumulators.
    Gradients,
    /// fp32 master weights and optimizer moments.
    OptimizerState,
    /// Saved activations and unit boundary tensors.
    Activations,
    /// Gradient-reduction and all-gather staging buffers.
    CommBuffers,
    /// Gathered (ZeRO-3) and converted working copies of a unit's parameters.
    Prefetch,
}

impl Category {
    /// Every category, in report order.
    pub const ALL: [Category; 6] = [
        Category::Parameters,
        Category::Gradients,
        Category::OptimizerState,
        Category::Activations,
        Category::CommBuffers,
        Category::Prefetch,
    ];

    /// The snake-case name reports and metrics use (`optimizer_state`).
    pub fn name(self) -> &'static str {
        match self {
            Category::Parameters => "parameters",
            Category::Gradients => "gradients",
            Category::OptimizerState => "optimizer_state",
            Category::Activations => "activations",
            Category::CommBuffers => "comm_buffers",
            Category::Prefetch => "prefetch",
        }
    }
}

const LOCS: usize = 3;
const CATS: usize = 6;

fn loc_index(l: Location) -> usize {
    match l {
        Location::Device => 0,
        Location::Host => 1,
        Location::Nvme => 2,
    }
}

fn cat_index(c: Category) -> usize {
    Category::ALL.iter().position(|&x| x == c).unwrap_or(0)
}

/// Current and peak bytes per (location, category), plus peak totals per location.
#[derive(Debug, Clone, Default)]
pub struct Ledger {
    current: [[u64; CATS]; LOCS],
    peak: [[u64; CATS]; LOCS],
    total: [u64; LOCS],
    peak_total: [u64; LOCS],
    /// The cap on device bytes (`device_memory_limit`).
    limit: Option<u64>,
    /// The first allocation that went past `limit`.
    breach: Option<Breach>,
    /// Page-locked host bytes (a property of host memory, not a location of its own).
    page_locked: PageLocked,
}

/// Host bytes page-locked with the device's driver: resident host RAM that cannot be swapped
/// (not charged against `RLIMIT_MEMLOCK`: the driver pins without `locked_vm`), so they are
/// counted apart from where the bytes are for.
#[derive(Debug, Clone, Copy, Default)]
struct PageLocked {
    /// Registered by the engine itself (the stage-3 host parameter store, the host gradient
    /// accumulators).
    engine: u64,
    /// Registered by the device for its copies, as it last reported them.
    device: u64,
    peak: u64,
}

/// An allocation that took the device total past the cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Breach {
    /// What the bytes were for.
    pub category: Category,
    /// Bytes asked for.
    pub requested: u64,
    /// Device bytes held before the request.
    pub live: u64,
    /// The cap.
    pub limit: u64,
}

/// A snapshot of the ledger for reports and logs.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LedgerReport {
    /// Peak total bytes on the device.
    pub peak_device_bytes: u64,
    /// Peak total bytes in host memory (offloaded state).
    pub peak_host_bytes: u64,
    /// Peak total bytes on NVMe.
    pub peak_nvme_bytes: u64,
    /// Current total bytes on the device.
    pub current_device_bytes: u64,
    /// Peak bytes per category on the device, in [`Category::ALL`] order.
    pub peak_device_by_category: Vec<(Category, u64)>,
    /// Peak bytes per category in host memory.
    pub peak_host_by_category: Vec<(Category, u64)>,
    /// The cap on device bytes, if one is set: `peak_device_bytes <= device_memory_limit`
    /// is the proof that it held.
    pub device_memory_limit: Option<u64>,
    /// Peak page-locked host bytes (the engine's registrations and the device's staging).
    pub peak_page_locked_bytes: u64,
}

impl Ledger {
    /// An empty ledger whose device total may not exceed `limit`.
    pub fn with_device_limit(limit: Option<u64>) -> Self {
        Ledger {
            limit,
            ..Ledger::default()
        }
    }

    /// The first breach of the cap, as the same error a GPU's allocator gives.
    pub fn check_limit(&self) -> Result<()> {
        let Some(b) = self.breach else {
            return Ok(());
        };
        Err(Error::DeviceMemory {
            requested: b.requested,
            live: b.live,
            peak: self.peak_total(Location::Device),
            limit: b.limit,
            detail: format!(
                "{:?} took this rank's device memory past device_memory_limit (counted by the \
                 engine's ledger; raise the limit, offload, or shard further)",
                b.category
            ),
        })
    }

    /// Counts host bytes the engine page-locked (`bytes` negative: released).
    pub fn lock_host(&mut self, bytes: i64) {
        let p = &mut self.page_locked;
        p.engine = p.engine.saturating_add_signed(bytes);
        p.peak = p.peak.max(p.engine + p.device);
    }

    /// Records the device's own page-locked bytes as it reports them now.
    pub fn observe_device_locked(&mut self, bytes: u64) {
        let p = &mut self.page_locked;
        p.device = bytes;
        p.peak = p.peak.max(p.engine + p.device);
    }

    /// Page-locked host bytes the engine registered itself (not the device's own), now.
    pub fn engine_locked(&self) -> u64 {
        self.page_locked.engine
    }

    /// Page-locked host bytes now and at the peak.
    pub fn page_locked(&self) -> (u64, u64) {
        let p = &self.page_locked;
        (p.engine + p.device, p.peak)
    }

    /// Counts an allocation (a device one past the cap is recorded as a breach).
    pub fn alloc(&mut self, loc: Location, cat: Category, bytes: u64) {
        let (l, c) = (loc_index(loc), cat_index(cat));
        if let (Location::Device, Some(limit), None) = (loc, self.limit, self.breach) {
            if self.total[l] + bytes > limit {
                self.breach = Some(Breach {
                    category: cat,
                    requested: bytes,
                    live: self.total[l],
                    limit,
                });
            }
        }
        self.current[l][c] += bytes;
        self.total[l] += bytes;
        self.peak[l][c] = self.peak[l][c].max(self.current[l][c]);
        self.peak_total[l] = self.peak_total[l].max(self.total[l]);
    }

    /// Counts a release; releasing more than is held is a bookkeeping bug, clamped to zero.
    pub fn free(&mut self, loc: Location, cat: Category, bytes: u64) {
        let (l, c) = (loc_index(loc), cat_index(cat));
        debug_assert!(
            self.current[l][c] >= bytes,
            "ledger underflow {loc:?} {cat:?}"
        );
        let b = bytes.min(self.current[l][c]);
        self.current[l][c] -= b;
        self.total[l] -= b;
    }

    /// Current bytes in one cell.
    pub fn current(&self, loc: Location, cat: Category) -> u64 {
        self.current[loc_index(loc)][cat_index(cat)]
    }

    /// Peak bytes in one cell.
    pub fn peak(&self, loc: Location, cat: Category) -> u64 {
        self.peak[loc_index(loc)][cat_index(cat)]
    }

    /// Peak total bytes at a location.
    pub fn peak_total(&self, loc: Location) -> u64 {
        self.peak_total[loc_index(loc)]
    }

    /// Current total bytes at a location.
    pub fn current_total(&self, loc: Location) -> u64 {
        self.total[loc_index(loc)]
    }

    /// A snapshot.
    pub fn report(&self) -> LedgerReport {
        let by = |loc| {
            Category::ALL
                .iter()
                .map(|&c| (c, self.peak(loc, c)))
                .collect()
        };
        LedgerReport {
            peak_device_bytes: self.peak_total(Location::Device),
            peak_host_bytes: self.peak_total(Location::Host),
            peak_nvme_bytes: self.peak_total(Location::Nvme),
            current_device_bytes: self.current_total(Location::Device),
            peak_device_by_category: by(Location::Device),
            peak_host_by_category: by(Location::Host),
            device_memory_limit: self.limit,
            peak_page_locked_bytes: self.page_locked.peak,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peaks_track_the_high_water_mark() {
        let mut l = Ledger::default();
        l.alloc(Location::Device, Category::Parameters, 100);
        l.alloc(Location::Device, Category::Prefetch, 50);
        l.free(Location::Device, Category::Prefetch, 50);
        l.alloc(Location::Device, Category::Activations, 30);
        assert_eq!(l.peak_total(Location::Device), 150);
        assert_eq!(l.current_total(Location::Device), 130);
        assert_eq!(l.peak(Location::Device, Category::Prefetch), 50);
        assert_eq!(l.current(Location::Device, Category::Prefetch), 0);
        assert_eq!(l.peak_total(Location::Host), 0);
    }

    #[test]
    fn the_cap_records_the_first_breach_and_names_it() {
        let mut l = Ledger::with_device_limit(Some(100));
        l.alloc(Location::Device, Category::Parameters, 60);
        l.alloc(Location::Host, Category::OptimizerState, 1000);
        l.alloc(Location::Device, Category::Gradients, 40);
        assert!(l.check_limit().is_ok(), "exactly at the cap fits");
        l.free(Location::Device, Category::Gradients, 40);
        l.alloc(Location::Device, Category::Activations, 41);
        l.alloc(Location::Device, Category::Prefetch, 500);
        match l.check_limit() {
            Err(Error::DeviceMemory {
                requested,
                live,
                limit,
                detail,
                ..
            }) => {
                assert_eq!((requested, live, limit), (41, 60, 100));
                assert!(detail.contains("Activations"), "{detail}");
                assert!(detail.contains("device_memory_limit"), "{detail}");
            }
            other => panic!("expected a device-memory error, got {other:?}"),
        }
        assert_eq!(l.report().device_memory_limit, Some(100));
    }
}
