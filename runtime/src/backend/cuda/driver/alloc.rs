//! The caching device allocator: stream-ordered, after PyTorch's CUDA caching allocator.
//!
//! Device memory is taken from the driver in segments and handed out in blocks:
//! - requests are rounded up to [`MIN_BLOCK`] (512 B);
//! - small requests (up to [`SMALL_MAX`], 1 MiB) are carved from [`SMALL_SEGMENT`]s (1 MiB) and
//!   split down to 512 B; large ones get segments rounded up to [`LARGE_SEGMENT_ROUND`] (2 MiB),
//!   and a cached large block is split only when more than 1 MiB would be left over;
//! - a request takes the smallest cached block of its pool that fits (best fit); a freed block
//!   merges with free neighbours of its segment;
//! - so once a training step has run, the next ones call the driver for no memory at all.
//!
//! Stream order: blocks belong to the allocator's home stream (compute). A block freed there is
//! reusable at once, because whatever the home stream does next runs after the work that used
//! it. A buffer also used on another stream is marked with [`DeviceBuffer::record_stream`]: its
//! block then waits, on drop, for an event recorded on that stream before it is reused (as
//! PyTorch's `record_stream`).
//!
//! Accounting: *live* bytes are the rounded sizes of buffers handed out and not yet dropped;
//! *reserved* bytes are the segments held from the driver. An optional limit caps live bytes: a
//! request that would take them over it fails with [`Error::DeviceMemory`] (this is the engine's
//! device-memory limit; it behaves identically on every driver, since it counts rounded
//! requests, not cache state). When the driver itself runs out, the allocator returns its whole
//! cache to the driver and tries once more before failing the same way.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};

use super::{DevPtr, Driver, Event, StreamKind};
use crate::{Error, Result};

/// Every block size is a multiple of this (and no block is smaller).
pub const MIN_BLOCK: u64 = 512;
/// Requests up to this many bytes (after rounding) are small.
pub const SMALL_MAX: u64 = 1 << 20;
/// The size of the driver allocations small blocks are carved from.
pub const SMALL_SEGMENT: u64 = 1 << 20;
/// Driver allocations for large requests are rounded up to a multiple of this.
pub const LARGE_SEGMENT_ROUND: u64 = 2 << 20;

/// Which pool a block belongs to: small and large blocks never mix, so small requests cannot
/// fragment the large segments.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pool {
    Small,
    Large,
}

impl Pool {
    fn index(self) -> usize {
        match self {
            Pool::Small => 0,
            Pool::Large => 1,
        }
    }
}

/// One block: a piece of a segment, handed out or cached.
#[derive(Debug, Clone, Copy)]
struct Block {
    size: u64,
    pool: Pool,
    allocated: bool,
    /// The neighbouring blocks of the same segment (by start address).
    prev: Option<u64>,
    next: Option<u64>,
}

/// The allocator's counters, all in bytes except where said.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AllocatorStats {
    /// Bytes handed out and not yet dropped (each buffer counted at its rounded size).
    pub live: u64,
    /// The most `live` has been since creation or [`Allocator::reset_peak`].
    pub peak_live: u64,
    /// Bytes held from the driver (live, cached and waiting for other streams).
    pub reserved: u64,
    /// The most `reserved` has been since creation or [`Allocator::reset_peak`].
    pub peak_reserved: u64,
    /// Buffers handed out and not yet dropped.
    pub live_buffers: u64,
    /// Segments held from the driver now.
    pub segments: u64,
    /// Driver allocations made so far (each one a `cuMemAlloc`).
    pub driver_allocs: u64,
    /// Driver frees made so far (by [`Allocator::empty_cache`] or an out-of-memory retry).
    pub driver_frees: u64,
    /// Times the driver ran out of memory and the cache was emptied to retry.
    pub oom_retries: u64,
}

/// A freed block waiting for other streams to finish with it.
#[derive(Debug)]
struct Pending {
    ptr: u64,
    events: Vec<Event>,
}

#[derive(Debug, Default)]
struct State {
    /// Every block of every segment, by start address.
    blocks: HashMap<u64, Block>,
    /// Cached blocks per pool, ordered by (size, address) for best fit.
    free: [BTreeSet<(u64, u64)>; 2],
    /// Segments by base address: size.
    segments: BTreeMap<u64, u64>,
    pending: Vec<Pending>,
    stats: AllocatorStats,
    limit: Option<u64>,
}

/// The caching allocator over one [`Driver`] (see the module documentation). Thread-safe; share
/// it as `Arc<Allocator>`.
#[derive(Debug)]
pub struct Allocator {
    driver: Arc<dyn Driver>,
    home: StreamKind,
    state: Mutex<State>,
}

fn round_up(x: u64, to: u64) -> u64 {
    x.div_ceil(to) * to
}

impl Allocator {
    /// An allocator over `driver` whose blocks belong to the compute stream, without a limit.
    pub fn new(driver: Arc<dyn Driver>) -> Arc<Self> {
        Allocator::with_limit(driver, None)
    }

    /// An allocator whose live bytes may not exceed `limit`.
    pub fn with_limit(driver: Arc<dyn Driver>, limit: Option<u64>) -> Arc<Self> {
        Arc::new(Allocator {
            driver,
            home: StreamKind::Compute,
            state: Mutex::new(State {
                limit,
                ..State::default()
            }),
        })
    }

    /// The driver underneath.
    pub fn driver(&self) -> &Arc<dyn Driver> {
        &self.driver
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sets (or with `None` lifts) the limit on live bytes; buffers already live stay.
    pub fn set_limit(&self, limit: Option<u64>) {
        self.state().limit = limit;
    }

    /// The limit on live bytes, if any.
    pub fn limit(&self) -> Option<u64> {
        self.state().limit
    }

    /// The counters now.
    pub fn stats(&self) -> AllocatorStats {
        self.state().stats
    }

    /// Restarts both peaks from the current live and reserved bytes.
    pub fn reset_peak(&self) {
        let mut st = self.state();
        st.stats.peak_live = st.stats.live;
        st.stats.peak_reserved = st.stats.reserved;
    }

    /// The rounded size a request of `bytes` is accounted at.
    pub fn rounded(bytes: usize) -> u64 {
        round_up((bytes as u64).max(1), MIN_BLOCK)
    }

    /// A buffer of at least `bytes` bytes (uninitialised), 256-byte aligned. Zero bytes gives an
    /// empty buffer at the null pointer without touching the pool.
    pub fn alloc(self: &Arc<Self>, bytes: usize) -> Result<DeviceBuffer> {
        if bytes == 0 {
            return Ok(DeviceBuffer {
                ptr: DevPtr::NULL,
                bytes: 0,
                rounded: 0,
                streams: 0,
                alloc: self.clone(),
            });
        }
        let mut st = self.state();
        if bytes as u64 > 1 << 60 {
            return Err(Error::DeviceMemory {
                requested: bytes as u64,
                live: st.stats.live,
                peak: st.stats.peak_live,
                limit: st.limit.unwrap_or(self.driver.info().total_memory),
                detail: "no device has this much memory".into(),
            });
        }
        let rounded = Allocator::rounded(bytes);
        self.collect_pending(&mut st, false)?;
        if let Some(limit) = st.limit {
            if st.stats.live + rounded > limit {
                return Err(Error::DeviceMemory {
                    requested: bytes as u64,
                    live: st.stats.live,
                    peak: st.stats.peak_live,
                    limit,
                    detail: format!(
                        "an allocation of {rounded} bytes ({bytes} requested, rounded up to \
                         {MIN_BLOCK}) would exceed the device memory limit"
                    ),
                });
            }
        }
        let pool = if rounded <= SMALL_MAX {
            Pool::Small
        } else {
            Pool::Large
        };
        let ptr = match st.free[pool.index()].range((rounded, 0)..).next().copied() {
            Some(entry) => {
                st.free[pool.index()].remove(&entry);
                entry.1
            }
            None => self.new_segment(&mut st, pool, rounded, bytes)?,
        };
        // Split off the rest when it is worth keeping as a block of its own.
        let size = st.blocks[&ptr].size;
        let rest = size - rounded;
        let split = match pool {
            Pool::Small => rest >= MIN_BLOCK,
            Pool::Large => rest > SMALL_MAX,
        };
        if split {
            let tail = ptr + rounded;
            let next = st.blocks[&ptr].next;
            st.blocks.insert(
                tail,
                Block {
                    size: rest,
                    pool,
                    allocated: false,
                    prev: Some(ptr),
                    next,
                },
            );
            if let Some(n) = next {
                st.blocks.get_mut(&n).expect("neighbour block").prev = Some(tail);
            }
            let b = st.blocks.get_mut(&ptr).expect("block");
            b.size = rounded;
            b.next = Some(tail);
            st.free[pool.index()].insert((rest, tail));
        }
        st.blocks.get_mut(&ptr).expect("block").allocated = true;
        st.stats.live += rounded;
        st.stats.peak_live = st.stats.peak_live.max(st.stats.live);
        st.stats.live_buffers += 1;
        self.driver.note_buffer(DevPtr(ptr), bytes as u64);
        Ok(DeviceBuffer {
            ptr: DevPtr(ptr),
            bytes,
            rounded,
            streams: 0,
            alloc: self.clone(),
        })
    }

    /// Asks the driver for a segment that fits `rounded` bytes; on out-of-memory, returns the
    /// cache to the driver and asks once more.
    fn new_segment(&self, st: &mut State, pool: Pool, rounded: u64, bytes: usize) -> Result<u64> {
        let seg = match pool {
            Pool::Small => SMALL_SEGMENT,
            Pool::Large => round_up(rounded, LARGE_SEGMENT_ROUND),
        };
        let base = match self.driver.malloc(seg as usize) {
            Ok(p) => p,
            Err(Error::DeviceMemory { .. }) => {
                st.stats.oom_retries += 1;
                let freed = self.release_cache(st)?;
                self.driver.malloc(seg as usize).map_err(|e| match e {
                    Error::DeviceMemory { detail, limit, .. } => Error::DeviceMemory {
                        requested: bytes as u64,
                        live: st.stats.live,
                        peak: st.stats.peak_live,
                        limit: st.limit.unwrap_or(limit),
                        detail: format!(
                            "the device refused a {seg}-byte segment even after the \
                                 allocator returned its {freed} cached bytes ({} bytes still \
                                 reserved): {detail}",
                            st.stats.reserved
                        ),
                    },
                    other => other,
                })?
            }
            Err(e) => return Err(e),
        };
        st.stats.driver_allocs += 1;
        st.stats.segments += 1;
        st.stats.reserved += seg;
        st.stats.peak_reserved = st.stats.peak_reserved.max(st.stats.reserved);
        st.segments.insert(base.0, seg);
        st.blocks.insert(
            base.0,
            Block {
                size: seg,
                pool,
                allocated: false,
                prev: None,
                next: None,
            },
        );
        Ok(base.0)
    }

    /// Marks the block at `ptr` free, merges it with free neighbours and caches the result.
    fn release_block(&self, st: &mut State, ptr: u64) {
        let mut start = ptr;
        let mut b = st.blocks[&ptr];
        b.allocated = false;
        if let Some(p) = b.prev {
            let pb = st.blocks[&p];
            if !pb.allocated && !st.pending.iter().any(|x| x.ptr == p) {
                st.free[pb.pool.index()].remove(&(pb.size, p));
                st.blocks.remove(&ptr);
                b = Block {
                    size: pb.size + b.size,
                    prev: pb.prev,
                    ..b
                };
                start = p;
            }
        }
        if let Some(n) = b.next {
            let nb = st.blocks[&n];
            if !nb.allocated && !st.pending.iter().any(|x| x.ptr == n) {
                st.free[nb.pool.index()].remove(&(nb.size, n));
                st.blocks.remove(&n);
                b.size += nb.size;
                b.next = nb.next;
            }
        }
        if let Some(n) = b.next {
            st.blocks.get_mut(&n).expect("neighbour block").prev = Some(start);
        }
        st.blocks.insert(start, b);
        st.free[b.pool.index()].insert((b.size, start));
    }

    /// Moves blocks whose other-stream work has finished (all of them, waiting, with `wait`)
    /// back into the cache.
    fn collect_pending(&self, st: &mut State, wait: bool) -> Result<()> {
        let mut i = 0;
        while i < st.pending.len() {
            let done = if wait {
                for &e in &st.pending[i].events {
                    self.driver.event_synchronize(e)?;
                }
                true
            } else {
                let mut all = true;
                for &e in &st.pending[i].events {
                    all &= self.driver.event_query(e)?;
                }
                all
            };
            if done {
                let p = st.pending.swap_remove(i);
                for e in p.events {
                    self.driver.event_destroy(e)?;
                }
                self.release_block(st, p.ptr);
            } else {
                i += 1;
            }
        }
        Ok(())
    }

    /// Returns every segment that is entirely free to the driver; the bytes returned.
    fn release_cache(&self, st: &mut State) -> Result<u64> {
        self.collect_pending(st, true)?;
        let whole: Vec<(u64, u64)> = st
            .segments
            .iter()
            .filter(|(base, size)| {
                let b = st.blocks[base];
                !b.allocated && b.size == **size
            })
            .map(|(&b, &s)| (b, s))
            .collect();
        let mut freed = 0;
        for (base, size) in whole {
            let pool = st.blocks[&base].pool;
            st.free[pool.index()].remove(&(size, base));
            st.blocks.remove(&base);
            st.segments.remove(&base);
            // SAFETY: the segment is entirely free (no buffer refers to it) and came from this
            // driver's malloc; the driver waits for queued work before freeing.
            unsafe { self.driver.free(DevPtr(base)) }?;
            st.stats.reserved -= size;
            st.stats.segments -= 1;
            st.stats.driver_frees += 1;
            freed += size;
        }
        Ok(freed)
    }

    /// Returns every cached segment to the driver (segments holding a live buffer stay).
    pub fn empty_cache(&self) -> Result<()> {
        let mut st = self.state();
        self.release_cache(&mut st).map(|_| ())
    }

    /// Called by [`DeviceBuffer`]'s drop.
    fn give_back(&self, ptr: u64, rounded: u64, streams: u8) -> Result<()> {
        let mut st = self.state();
        st.stats.live -= rounded;
        st.stats.live_buffers -= 1;
        let mut events = Vec::new();
        for s in StreamKind::ALL {
            if s != self.home && streams & (1 << s.index()) != 0 {
                let e = self.driver.event_create()?;
                self.driver.event_record(e, s)?;
                events.push(e);
            }
        }
        if events.is_empty() {
            self.release_block(&mut st, ptr);
        } else {
            st.blocks.get_mut(&ptr).expect("block").allocated = false;
            st.pending.push(Pending { ptr, events });
        }
        Ok(())
    }
}

impl Drop for Allocator {
    fn drop(&mut self) {
        let st = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        let mut st = std::mem::take(st);
        if let Err(e) = self.release_cache(&mut st) {
            tracing::error!("device allocator: returning its cache to the driver failed: {e}");
        }
    }
}

/// A device buffer from an [`Allocator`]; its block goes back to the allocator on drop.
#[derive(Debug)]
pub struct DeviceBuffer {
    ptr: DevPtr,
    bytes: usize,
    rounded: u64,
    /// Streams other than the home stream that used it (bit per [`StreamKind::index`]).
    streams: u8,
    alloc: Arc<Allocator>,
}

impl DeviceBuffer {
    /// The device address of its first byte (null for an empty buffer).
    pub fn ptr(&self) -> DevPtr {
        self.ptr
    }

    /// The bytes requested.
    pub fn len(&self) -> usize {
        self.bytes
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// The bytes it is accounted at (the request rounded up to [`MIN_BLOCK`]).
    pub fn rounded_len(&self) -> u64 {
        self.rounded
    }

    /// The allocator it came from.
    pub fn allocator(&self) -> &Arc<Allocator> {
        &self.alloc
    }

    /// Marks the buffer as used by work on stream `s`: when it is dropped, its memory is
    /// reused only after the work queued on `s` by then has finished.
    pub fn record_stream(&mut self, s: StreamKind) {
        self.streams |= 1 << s.index();
    }

    /// Copies `src` into the start of the buffer on stream `s` (`src` reusable on return).
    pub fn copy_from_host(&self, src: &[u8], s: StreamKind) -> Result<()> {
        self.check_len("copy_from_host", src.len())?;
        self.alloc.driver.copy_htod(src, self.ptr, s)
    }

    /// Copies the start of the buffer into `dst` on stream `s` (present on return).
    pub fn copy_to_host(&self, dst: &mut [u8], s: StreamKind) -> Result<()> {
        self.check_len("copy_to_host", dst.len())?;
        self.alloc.driver.copy_dtoh(self.ptr, dst, s)
    }

    fn check_len(&self, op: &'static str, len: usize) -> Result<()> {
        if len > self.bytes {
            return Err(Error::Shape {
                op,
                expected: format!("at most {} bytes", self.bytes),
                got: format!("{len} bytes"),
            });
        }
        Ok(())
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.rounded == 0 {
            return;
        }
        if let Err(e) = self.alloc.give_back(self.ptr.0, self.rounded, self.streams) {
            tracing::error!("device allocator: returning {} failed: {e}", self.ptr);
        }
    }
}
