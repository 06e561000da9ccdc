//! Swap pipelines over an [`NvmeStore`]: [`Prefetch`] reads an ordered list of tensors ahead
//! of use, [`WriteBehind`] writes tensors back after use, both into and out of a
//! [`BufferPool`] so the bytes in flight are bounded by the pool and nothing is allocated
//! per step. Reads and writes run on the store's I/O threads while the caller computes.

use std::collections::VecDeque;

use crate::pool::{BufferPool, PooledBuffer};
use crate::store::{NvmeStore, Pending};
use crate::{Error, Result};

/// A tensor swapped in: its key, and its bytes in `buf[..len]`.
pub struct Swapped {
    /// The tensor key.
    pub key: String,
    /// The pool buffer holding it.
    pub buf: PooledBuffer,
    /// Bytes of the tensor (the buffer may be longer).
    pub len: usize,
}

impl Swapped {
    /// The tensor's bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.buf[..self.len]
    }

    /// The tensor's bytes, writable.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.buf[..self.len]
    }
}

/// Reads tensors in a fixed order, keeping up to `depth` reads in flight ahead of the caller.
pub struct Prefetch<'s> {
    store: &'s NvmeStore,
    pool: BufferPool,
    keys: Vec<(String, usize)>,
    next: usize,
    depth: usize,
    inflight: VecDeque<(String, usize, Pending<PooledBuffer>)>,
}

impl<'s> Prefetch<'s> {
    /// Plans reads of `keys` in order. Every key must be in the store and fit a pool buffer;
    /// `depth` (at least 1) caps reads in flight, and the pool caps them too.
    pub fn new(
        store: &'s NvmeStore,
        pool: &BufferPool,
        keys: Vec<String>,
        depth: usize,
    ) -> Result<Self> {
        let keys = keys
            .into_iter()
            .map(|k| {
                let len = store.len_of(&k).ok_or_else(|| Error::Invalid {
                    op: "Prefetch::new",
                    detail: format!("no tensor {k:?} in {}", store.dir().display()),
                })?;
                if len > pool.buffer_size() {
                    return Err(Error::Length {
                        op: "Prefetch::new",
                        detail: format!(
                            "tensor {k:?} is {len} bytes, pool buffers {}",
                            pool.buffer_size()
                        ),
                    });
                }
                Ok((k, len))
            })
            .collect::<Result<Vec<_>>>()?;
        let mut p = Prefetch {
            store,
            pool: pool.clone(),
            keys,
            next: 0,
            depth: depth.max(1),
            inflight: VecDeque::new(),
        };
        p.top_up();
        Ok(p)
    }

    /// Starts reads while there is depth and a free buffer; never blocks.
    fn top_up(&mut self) {
        while self.inflight.len() < self.depth && self.next < self.keys.len() {
            let Some(buf) = self.pool.try_acquire() else {
                return;
            };
            self.start(buf);
        }
    }

    fn start(&mut self, buf: PooledBuffer) {
        let (key, len) = self.keys[self.next].clone();
        self.next += 1;
        let pending = self.store.submit_read(&key, buf, len);
        self.inflight.push_back((key, len, pending));
    }
}

impl Iterator for Prefetch<'_> {
    type Item = Result<Swapped>;

    /// The next tensor in order, waiting for its read; then starts the following reads so
    /// they overlap the caller's work on this one.
    fn next(&mut self) -> Option<Result<Swapped>> {
        if self.inflight.is_empty() && self.next < self.keys.len() {
            // Nothing in flight and no free buffer: wait for one (a write-behind returns it).
            let buf = self.pool.acquire();
            self.start(buf);
        }
        let (key, len, pending) = self.inflight.pop_front()?;
        let got = pending.wait().map(|buf| Swapped { key, buf, len });
        self.top_up();
        Some(got)
    }
}

impl Drop for Prefetch<'_> {
    fn drop(&mut self) {
        // Reads still in flight write into pool buffers: let them land before the buffers
        // go back to the pool.
        for (_, _, p) in self.inflight.drain(..) {
            let _ = p.wait();
        }
    }
}

/// Writes tensors back after use, keeping up to `max_inflight` writes outstanding; errors
/// surface at the next [`WriteBehind::push`] or at [`WriteBehind::flush`].
pub struct WriteBehind<'s> {
    store: &'s NvmeStore,
    max_inflight: usize,
    inflight: VecDeque<(String, Pending<PooledBuffer>)>,
}

impl<'s> WriteBehind<'s> {
    /// A write-behind queue of at most `max_inflight` (at least 1) writes.
    pub fn new(store: &'s NvmeStore, max_inflight: usize) -> Self {
        WriteBehind {
            store,
            max_inflight: max_inflight.max(1),
            inflight: VecDeque::new(),
        }
    }

    /// Starts writing `buf[..len]` under `key`; waits for the oldest write when the queue is
    /// full. The buffer returns to its pool when its write finishes.
    pub fn push(&mut self, key: &str, buf: PooledBuffer, len: usize) -> Result<()> {
        let pending = self.store.submit_write(key, buf, len);
        self.inflight.push_back((key.to_string(), pending));
        while self.inflight.len() > self.max_inflight {
            self.wait_oldest()?;
        }
        Ok(())
    }

    fn wait_oldest(&mut self) -> Result<()> {
        match self.inflight.pop_front() {
            Some((_, p)) => p.wait().map(drop),
            None => Ok(()),
        }
    }

    /// Waits for every outstanding write; returns the first error (after waiting for all).
    pub fn flush(&mut self) -> Result<()> {
        let mut first = Ok(());
        while !self.inflight.is_empty() {
            if let Err(e) = self.wait_oldest() {
                if first.is_ok() {
                    first = Err(e);
                }
            }
        }
        first
    }
}

impl Drop for WriteBehind<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.flush() {
            tracing::error!("write-behind dropped without flush, a write failed: {e}");
        }
    }
}
