//! Host buffer pools: `count` buffers of `size` bytes, allocated once, page-aligned (so they
//! satisfy O_DIRECT's 4096-byte alignment) and, when asked, locked in RAM.
//!
//! Buffers are lent with [`BufferPool::acquire`] (blocking while all are out, which is what
//! bounds the swap pipelines) and come back when the [`PooledBuffer`] drops. Nothing is
//! allocated per step.

mod host;

use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

pub use host::HostBuffer;

use crate::sys::{self, MemlockLimit};
use crate::{Error, Result};
use host::lock_error;

/// Alignment of every buffer: O_DIRECT needs the logical block size, at most one page.
pub const ALIGN: usize = 4096;

/// Whether pool memory is locked in RAM (DeepSpeed's `pin_memory`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pinning {
    /// mlock'ed: never swapped out, safe for DMA.
    Locked,
    /// Ordinary (still page-aligned) memory.
    Pageable,
}

struct Shared {
    free: Mutex<Vec<HostBuffer>>,
    returned: Condvar,
    count: usize,
    size: usize,
    pinning: Pinning,
}

/// A fixed set of equally sized host buffers shared between threads.
#[derive(Clone)]
pub struct BufferPool {
    shared: Arc<Shared>,
}

impl BufferPool {
    /// Allocates `count` buffers of `size` bytes (rounded up to [`ALIGN`]). With
    /// [`Pinning::Locked`] the whole pool is checked against `RLIMIT_MEMLOCK` first, so an
    /// impossible pool is refused up front with the numbers rather than half-built.
    pub fn new(count: usize, size: usize, pinning: Pinning) -> Result<BufferPool> {
        if count == 0 || size == 0 {
            return Err(Error::Invalid {
                op: "BufferPool::new",
                detail: format!("buffer_count ({count}) and buffer_size ({size}) must be positive"),
            });
        }
        let size = size.next_multiple_of(ALIGN);
        let total = (count as u64).saturating_mul(size as u64);
        if pinning == Pinning::Locked {
            check_lock_budget(total, sys::memlock_limit())?;
        }
        let free = (0..count)
            .map(|_| HostBuffer::new(size, pinning))
            .collect::<Result<Vec<_>>>()?;
        let shared = Shared {
            free: Mutex::new(free),
            returned: Condvar::new(),
            count,
            size,
            pinning,
        };
        Ok(BufferPool {
            shared: Arc::new(shared),
        })
    }

    /// Bytes per buffer.
    pub fn buffer_size(&self) -> usize {
        self.shared.size
    }

    /// Buffers in the pool.
    pub fn buffer_count(&self) -> usize {
        self.shared.count
    }

    /// Whether the buffers are locked.
    pub fn pinning(&self) -> Pinning {
        self.shared.pinning
    }

    /// Buffers not lent out right now.
    pub fn available(&self) -> usize {
        self.lock().len()
    }

    /// Borrows a buffer, waiting while all are lent out.
    pub fn acquire(&self) -> PooledBuffer {
        let mut free = self.lock();
        loop {
            if let Some(buf) = free.pop() {
                return self.lend(buf);
            }
            free = self
                .shared
                .returned
                .wait(free)
                .unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Borrows a buffer if one is free now.
    pub fn try_acquire(&self) -> Option<PooledBuffer> {
        let buf = self.lock().pop()?;
        Some(self.lend(buf))
    }

    fn lend(&self, buf: HostBuffer) -> PooledBuffer {
        PooledBuffer {
            buf: Some(buf),
            pool: self.shared.clone(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Vec<HostBuffer>> {
        // A panic while holding the lock cannot leave the Vec inconsistent: push/pop only.
        self.shared.free.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Refuses a locked allocation of `need` bytes that the limit cannot hold.
pub(crate) fn check_lock_budget(need: u64, limit: MemlockLimit) -> Result<()> {
    match limit {
        MemlockLimit::Bytes(l) if need > l => Err(lock_error(
            need,
            limit,
            &"the pool exceeds the locked-memory limit",
        )),
        _ => Ok(()),
    }
}

/// A buffer borrowed from a [`BufferPool`]; returns itself on drop.
pub struct PooledBuffer {
    buf: Option<HostBuffer>,
    pool: Arc<Shared>,
}

impl Deref for PooledBuffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.buf.as_deref().expect("present until drop")
    }
}

impl DerefMut for PooledBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.buf.as_deref_mut().expect("present until drop")
    }
}

impl Drop for PooledBuffer {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            let mut free = self.pool.free.lock().unwrap_or_else(|p| p.into_inner());
            free.push(buf);
            self.pool.returned.notify_one();
        }
    }
}

impl AsRef<[u8]> for PooledBuffer {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl AsMut<[u8]> for PooledBuffer {
    fn as_mut(&mut self) -> &mut [u8] {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_aligned_reused_and_bounded() {
        let pool = BufferPool::new(2, 5000, Pinning::Locked).unwrap();
        assert_eq!(pool.buffer_size(), 8192);
        let mut a = pool.acquire();
        let b = pool.acquire();
        assert_eq!(a.as_ptr() as usize % ALIGN, 0);
        assert_eq!(b.as_ptr() as usize % ALIGN, 0);
        assert!(pool.try_acquire().is_none(), "pool must be bounded");
        a[0] = 7;
        let addr = a.as_ptr();
        drop(a);
        let again = pool.acquire();
        assert_eq!(
            again.as_ptr(),
            addr,
            "a returned buffer is reused, not reallocated"
        );
        assert_eq!(pool.available(), 0);
    }

    fn locked_kib() -> u64 {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let line = status.lines().find(|l| l.starts_with("VmLck:")).unwrap();
        line.split_whitespace().nth(1).unwrap().parse().unwrap()
    }

    #[test]
    fn locked_pools_are_really_locked_and_pageable_ones_are_not() {
        // Other tests here lock (and free) at most 16 KiB meanwhile, hence the margin.
        let before = locked_kib();
        let locked = BufferPool::new(4, 256 << 10, Pinning::Locked).unwrap();
        assert!(
            locked_kib() + 64 >= before + 1024,
            "1 MiB pool not in VmLck"
        );
        assert_eq!(locked.pinning(), Pinning::Locked);
        let plain = BufferPool::new(4, 256 << 10, Pinning::Pageable).unwrap();
        assert_eq!(plain.buffer_count(), 4);
        assert_eq!(plain.pinning(), Pinning::Pageable);
    }

    #[test]
    fn acquire_waits_for_a_return() {
        let pool = BufferPool::new(1, 4096, Pinning::Pageable).unwrap();
        let held = pool.acquire();
        let p2 = pool.clone();
        let t = std::thread::spawn(move || p2.acquire().len());
        std::thread::sleep(std::time::Duration::from_millis(20));
        drop(held);
        assert_eq!(t.join().unwrap(), 4096);
    }

    #[test]
    fn over_limit_lock_is_refused_with_the_numbers() {
        let e = check_lock_budget(64 << 20, MemlockLimit::Bytes(8 << 20)).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("RLIMIT_MEMLOCK is 8388608 bytes"), "{msg}");
        assert!(
            msg.contains("67108864 bytes") && msg.contains("pin_memory = false"),
            "{msg}"
        );
        assert!(check_lock_budget(64 << 20, MemlockLimit::Unlimited).is_ok());
        assert!(BufferPool::new(0, 4096, Pinning::Pageable).is_err());
    }
}
