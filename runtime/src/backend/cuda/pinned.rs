//! Page-locked host buffers for staging device views: what the offloaded optimizer step copies
//! down (gradients) and up (the low-precision copy) every step. Host vectors are registered
//! with the driver once and kept, shaped as the views they stage, so each step copies through
//! the same page-locked memory at the bus's speed instead of through fresh pageable pages that
//! the driver bounces through its own buffers.
//!
//! Registration is best effort: a buffer the driver will not register (a small one sharing a
//! page with a registered neighbour, a locked-memory limit) stages pageable, as before, and
//! gives the same bytes. Registered buffers are unregistered before they are freed, always.

use std::collections::{HashSet, VecDeque};
use std::sync::{Arc, Mutex};

use super::driver::Driver;
use crate::tensor::in_flight::HostPin;
use crate::tensor::{spare, DType, FlatBuf};

/// Buffers held for reuse.
const MAX_BUFFERS: usize = 32;
/// Bytes held for reuse (beyond one buffer, which is always kept): the bound the thread's
/// spare cache had when staging went through it, so page-locking adds no host memory.
const MAX_BYTES: u64 = 2 << 30;

/// The pool of one opened device.
#[derive(Debug)]
pub(crate) struct PinnedPool {
    driver: Arc<dyn Driver>,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// Registered buffers not lent out, oldest first.
    held: VecDeque<FlatBuf>,
    /// Start addresses of every registered buffer of this pool, held or lent.
    registered: HashSet<usize>,
    /// Their bytes.
    registered_bytes: u64,
}

fn start(b: &FlatBuf) -> usize {
    b.as_ref().bytes().as_ptr() as usize
}

impl PinnedPool {
    pub(crate) fn new(driver: Arc<dyn Driver>) -> Self {
        PinnedPool {
            driver,
            state: Mutex::new(State::default()),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A buffer of `len` elements of `dtype` with unspecified contents, page-locked when the
    /// driver allows.
    pub(crate) fn take(&self, dtype: DType, len: usize) -> FlatBuf {
        let mut st = self.state();
        if let Some(i) = st
            .held
            .iter()
            .position(|b| b.dtype() == dtype && b.len() == len)
        {
            if let Some(b) = st.held.remove(i) {
                return b;
            }
        }
        let mut b = spare::take(dtype, len);
        // Smaller buffers are not worth a registration (a driver call each way); the
        // estimator prices the pool by the same rule.
        if crate::tensor::in_flight::staging_page_locked(b.bytes()) {
            let bytes = b.as_mut().bytes_mut();
            // SAFETY: the buffer stays allocated while registered: `give` keeps it or
            // unregisters it before dropping it, and the pool unregisters what it holds when
            // dropped.
            match unsafe { self.driver.host_register(bytes.as_mut_ptr(), bytes.len()) } {
                Ok(()) => {
                    st.registered.insert(start(&b));
                    st.registered_bytes += b.bytes();
                }
                Err(e) => tracing::debug!("staging buffer left pageable: {e}"),
            }
        }
        b
    }

    /// Bytes of this pool's registered buffers, held or lent.
    pub(crate) fn registered_bytes(&self) -> u64 {
        self.state().registered_bytes
    }

    /// Takes back a buffer from [`PinnedPool::take`] for reuse.
    pub(crate) fn give(&self, b: FlatBuf) {
        let mut st = self.state();
        if !st.registered.contains(&start(&b)) {
            drop(st);
            spare::give(b);
            return;
        }
        st.held.push_back(b);
        let held = |s: &State| s.held.iter().map(FlatBuf::bytes).sum::<u64>();
        while st.held.len() > MAX_BUFFERS || (st.held.len() > 1 && held(&st) > MAX_BYTES) {
            if let Some(old) = st.held.pop_front() {
                self.release(&mut st, old);
            }
        }
    }

    /// Unregisters and frees `b`.
    fn release(&self, st: &mut State, mut b: FlatBuf) {
        st.registered.remove(&start(&b));
        st.registered_bytes -= b.bytes();
        // SAFETY: a buffer comes back only when no copy uses it: synchronous copies have
        // returned, and a `HostCopy` waits for its copy's event before giving it back.
        if let Err(e) = unsafe {
            self.driver
                .host_unregister(b.as_mut().bytes_mut().as_mut_ptr())
        } {
            // Freeing memory the driver still holds locked would leave it locked; keep it.
            tracing::warn!("staging buffer could not be unregistered, kept: {e}");
            std::mem::forget(b);
        }
    }
}

impl Drop for PinnedPool {
    fn drop(&mut self) {
        let mut st = self.state();
        while let Some(b) = st.held.pop_front() {
            self.release(&mut st, b);
        }
    }
}

/// Registers `b` with `dev`'s driver for as long as the returned guard lives (a stage-3
/// parameter store in host memory, registered once); `None` when the driver refuses.
pub(crate) fn pin(dev: &Arc<super::device::CudaDevice>, b: &mut FlatBuf) -> Option<HostPin> {
    let bytes = b.as_mut().bytes_mut();
    let (ptr, len) = (bytes.as_mut_ptr(), bytes.len());
    if len == 0 {
        return None;
    }
    // SAFETY: the guard's owner drops it before freeing `b` (its contract), and the guard
    // unregisters.
    if let Err(e) = unsafe { dev.driver().host_register(ptr, len) } {
        tracing::debug!("host buffer of {len} bytes left pageable: {e}");
        return None;
    }
    let (dev, at) = (dev.clone(), ptr as usize);
    let release = move || {
        // SAFETY: registered above; the owner waits for copies from it before dropping.
        if let Err(e) = unsafe { dev.driver().host_unregister(at as *mut u8) } {
            tracing::warn!("host buffer could not be unregistered: {e}");
        }
    };
    Some(HostPin::new(len as u64, Box::new(release)))
}

/// [`pin`] for a size-only host buffer: nothing registered (there are no bytes), its bytes
/// counted as [`pin`] counts a registration the driver accepts.
pub(crate) fn pin_meta(
    dev: &Arc<super::device::CudaDevice>,
    b: &crate::tensor::meta::MetaBuf,
) -> Option<HostPin> {
    if !dev.info().sizes_only || b.bytes() == 0 {
        return None;
    }
    Some(HostPin::new(b.bytes() as u64, Box::new(|| {})))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::driver::{EmuDriver, EmuOptions};
    use crate::backend::cuda::{CudaBackend, CudaDevice};
    use crate::backend::MemoryOps;
    use crate::tensor::staging::{write_host, Staged, StagedMut};
    use crate::tensor::{BufMut, BufRef, View, ViewMut};

    /// Buffers are registered once and reused by shape; the pool holds at most `MAX_BUFFERS`,
    /// unregistering what it evicts; small buffers are never registered; dropping the pool
    /// unregisters the rest.
    #[test]
    fn buffers_are_registered_once_reused_and_released() {
        let drv = Arc::new(EmuDriver::new(EmuOptions::default()).unwrap());
        let pool = PinnedPool::new(drv.clone());
        let n = 1 << 18; // 1 MiB of f32: just worth registering
        let a = pool.take(DType::F32, n);
        let at = start(&a);
        assert_eq!(drv.registered_host_bytes(), n * 4);
        pool.give(a);
        let again = pool.take(DType::F32, n);
        assert_eq!(start(&again), at, "same shape, same registered buffer");
        pool.give(again);
        let small = pool.take(DType::F32, 1000);
        assert_eq!(
            drv.registered_host_bytes(),
            n * 4,
            "small buffers stay pageable"
        );
        pool.give(small);
        // 32 MiB and more: glibc maps each afresh whatever other tests freed before (a freed
        // mapping raises its threshold for mapping), so no two share a page and every one is
        // registered; zeroed f32 is mapped lazily, so nothing is touched.
        let many: Vec<FlatBuf> = (0..MAX_BUFFERS + 3)
            .map(|i| pool.take(DType::F32, (1 << 23) + i))
            .collect();
        for b in many {
            pool.give(b);
        }
        let st = pool.state();
        assert_eq!(st.held.len(), MAX_BUFFERS);
        assert_eq!(st.registered.len(), MAX_BUFFERS);
        let held: usize = st.held.iter().map(|b| b.bytes() as usize).sum();
        drop(st);
        assert_eq!(drv.registered_host_bytes(), held);
        drop(pool);
        assert_eq!(drv.registered_host_bytes(), 0);
    }

    fn host_ptr(s: &Staged<'_>) -> *const u8 {
        match s.view() {
            View::Host(b) => b.bytes().as_ptr(),
            View::Cuda(_) | View::Meta(_) => panic!("staged in host memory"),
        }
    }

    /// Device views stage through the device's registered buffers, the same ones step after
    /// step; a write-only staging uploads what was written, a read-write one round-trips, and
    /// the buffers are unregistered when the device goes.
    #[test]
    fn device_views_stage_through_registered_buffers() {
        let drv = Arc::new(EmuDriver::new(EmuOptions::default()).unwrap());
        let be = CudaBackend::new(CudaDevice::new(drv.clone(), None), DType::F32);
        let n = 1 << 19; // 2 MiB of f32: worth registering
        let vals: Vec<f32> = (0..n).map(|i| i as f32).collect();
        let mut dev = be.upload(BufRef::F32(&vals)).unwrap();
        let first = {
            let st = Staged::new(dev.view()).unwrap();
            let View::Host(BufRef::F32(h)) = st.view() else {
                panic!("staged in host f32")
            };
            assert_eq!(h, &vals[..]);
            assert_eq!(drv.registered_host_bytes(), n * 4);
            host_ptr(&st)
        };
        let again = Staged::new(dev.view()).unwrap();
        assert_eq!(host_ptr(&again), first, "the registered buffer is reused");
        drop(again);
        let mut st = StagedMut::overwrite(dev.view_mut());
        let ViewMut::Host(BufMut::F32(h)) = st.view_mut() else {
            panic!("staged in host f32")
        };
        h.fill(7.0);
        st.finish().unwrap();
        assert!(dev.to_vec_f32().unwrap().iter().all(|&x| x == 7.0));
        let mut st = StagedMut::new(dev.view_mut()).unwrap();
        let ViewMut::Host(BufMut::F32(h)) = st.view_mut() else {
            panic!("staged in host f32")
        };
        assert!(h.iter().all(|&x| x == 7.0), "read-write staging downloads");
        h[3] = 1.5;
        drop(st); // not finished: nothing uploaded, the buffer still goes back
        assert_eq!(dev.to_vec_f32().unwrap()[3], 7.0);
        write_host(dev.view_mut(), |b| {
            if let BufMut::F32(h) = b {
                h[3] = 1.5;
            }
            Ok(())
        })
        .unwrap();
        assert_eq!(dev.to_vec_f32().unwrap()[3], 1.5);
        assert_eq!(
            drv.registered_host_bytes(),
            n * 4,
            "one buffer, reused throughout"
        );
        drop(dev);
        drop(be);
        assert_eq!(
            drv.registered_host_bytes(),
            0,
            "unregistered with the device"
        );
    }
}
