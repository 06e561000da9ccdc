//! The I/O engine and its lanes: chosen once at start-up (io_uring when the kernel allows
//! it, else blocking pread/pwrite on threads) and reported by name.
//!
//! One tensor operation takes `per_op` lanes at once (all or none, so concurrent operations
//! cannot deadlock holding half a set) and splits its blocks into that many contiguous runs.

use std::sync::{Condvar, Mutex};

use io_uring::IoUring;

use super::lane::{Data, Lane, Target};
use super::settings::{AioSettings, EngineChoice};
use crate::pool::{HostBuffer, Pinning};
use crate::{Error, Result};

/// The engine a store runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    /// io_uring, `queue_depth` requests in flight per lane.
    IoUring,
    /// Blocking pread/pwrite, `queue_depth` threads per lane set.
    Threads,
    /// None: a meta store moves no bytes.
    Meta,
}

impl Engine {
    /// The name reported by benchmarks and logs: `io_uring` or `threads`.
    pub fn name(self) -> &'static str {
        match self {
            Engine::IoUring => "io_uring",
            Engine::Threads => "threads",
            Engine::Meta => "meta",
        }
    }
}

/// The store's lanes and the engine they run.
pub(super) struct Lanes {
    engine: Engine,
    note: Option<String>,
    per_op: usize,
    free: Mutex<Vec<Lane>>,
    returned: Condvar,
}

impl Lanes {
    /// Builds lanes for `users` concurrent operations.
    pub(super) fn start(s: &AioSettings, users: usize) -> Result<Lanes> {
        let (engine, note) = match s.engine {
            EngineChoice::Threads => (Engine::Threads, None),
            EngineChoice::IoUring => {
                probe_uring(s.queue_depth).map_err(|e| {
                    Error::Resource(format!("io_uring was requested but is unavailable: {e}"))
                })?;
                (Engine::IoUring, None)
            }
            EngineChoice::Auto => match probe_uring(s.queue_depth) {
                Ok(()) => (Engine::IoUring, None),
                Err(e) => {
                    let note =
                        format!("io_uring unavailable ({e}); using the pread/pwrite threads");
                    tracing::warn!("{note}");
                    (Engine::Threads, Some(note))
                }
            },
        };
        let (per_op, depth) = match engine {
            Engine::IoUring => (s.intra_op_parallelism, s.queue_depth),
            // Lanes are never started for a meta store; it has none.
            Engine::Threads | Engine::Meta => (s.intra_op_parallelism * s.queue_depth, 1),
        };
        let mut free = Vec::with_capacity(per_op * users);
        for _ in 0..per_op * users {
            let ring = match engine {
                Engine::IoUring => Some(new_ring(depth).map_err(|e| {
                    Error::Resource(format!("cannot create an io_uring of depth {depth}: {e}"))
                })?),
                Engine::Threads | Engine::Meta => None,
            };
            let bounce = (0..depth)
                .map(|_| HostBuffer::new(s.block_size, Pinning::Pageable))
                .collect::<Result<Vec<_>>>()?;
            free.push(Lane { ring, bounce });
        }
        Ok(Lanes {
            engine,
            note,
            per_op,
            free: Mutex::new(free),
            returned: Condvar::new(),
        })
    }

    pub(super) fn engine(&self) -> Engine {
        self.engine
    }

    pub(super) fn note(&self) -> Option<&str> {
        self.note.as_deref()
    }

    /// Runs one tensor operation across up to `per_op` lanes.
    pub(super) fn run(&self, t: &Target<'_>, data: Data<'_>) -> Result<()> {
        let blocks = data.len().div_ceil(t.block);
        if blocks == 0 {
            return Ok(());
        }
        let want = self.per_op.min(blocks);
        let mut lanes = self.take(want);
        let result = run_parts(&mut lanes, t, data, blocks.div_ceil(want));
        self.give_back(lanes);
        result
    }

    fn take(&self, n: usize) -> Vec<Lane> {
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        while free.len() < n {
            free = self.returned.wait(free).unwrap_or_else(|p| p.into_inner());
        }
        let at = free.len() - n;
        free.split_off(at)
    }

    fn give_back(&self, lanes: Vec<Lane>) {
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        free.extend(lanes);
        self.returned.notify_all();
    }
}

/// Splits `data` into runs of `per` blocks, one per lane, and runs them in parallel.
fn run_parts(lanes: &mut [Lane], t: &Target<'_>, data: Data<'_>, per: usize) -> Result<()> {
    let step = per * t.block;
    let mut parts = Vec::with_capacity(lanes.len());
    match data {
        Data::Write { mut src, mut crcs } => {
            while !src.is_empty() {
                let (s, rest) = src.split_at(step.min(src.len()));
                let (c, crest) = std::mem::take(&mut crcs).split_at_mut(s.len().div_ceil(t.block));
                parts.push(Data::Write { src: s, crcs: c });
                (src, crcs) = (rest, crest);
            }
        }
        Data::Read { mut dst, mut crcs } => {
            while !dst.is_empty() {
                let at = step.min(dst.len());
                let (d, rest) = std::mem::take(&mut dst).split_at_mut(at);
                let (c, crest) = crcs.split_at(d.len().div_ceil(t.block));
                parts.push(Data::Read { dst: d, crcs: c });
                (dst, crcs) = (rest, crest);
            }
        }
    }
    if parts.len() == 1 {
        let part = parts.pop().expect("one part");
        return lanes[0].run(t, 0, part);
    }
    std::thread::scope(|scope| {
        let handles: Vec<_> = lanes
            .iter_mut()
            .zip(parts)
            .enumerate()
            .map(|(i, (lane, part))| scope.spawn(move || lane.run(t, i * per, part)))
            .collect();
        // Join all before reporting, so no lane is still moving bytes when we return.
        let results: Vec<Result<()>> = handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect();
        results.into_iter().collect()
    })
}

/// A ring of at least `depth` entries. With COOP_TASKRUN (Linux 5.19+) completions are
/// posted when the lane next enters the kernel, which it does to wait anyway, instead of
/// interrupting it with an inter-processor interrupt mid-checksum; kernels that do not know
/// the flag refuse it with EINVAL and get a plain ring.
fn new_ring(depth: usize) -> std::io::Result<IoUring> {
    let entries = depth.next_power_of_two() as u32;
    match IoUring::builder().setup_coop_taskrun().build(entries) {
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => IoUring::new(entries),
        r => r,
    }
}

/// Whether this kernel lets us create and use a ring (seccomp and some containers deny it).
fn probe_uring(depth: usize) -> std::io::Result<()> {
    let mut ring = new_ring(depth)?;
    let nop = io_uring::opcode::Nop::new().build().user_data(7);
    // SAFETY: a NOP references no memory.
    unsafe { ring.submission().push(&nop) }.map_err(std::io::Error::other)?;
    ring.submit_and_wait(1)?;
    let res = ring
        .completion()
        .next()
        .map(|c| c.result())
        .unwrap_or(-libc::EIO);
    if res < 0 {
        return Err(std::io::Error::from_raw_os_error(-res));
    }
    Ok(())
}
