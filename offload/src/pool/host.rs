//! One page-aligned anonymous mapping, optionally locked in RAM.

use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

use super::{Pinning, ALIGN};
use crate::sys::{self, human, MemlockLimit};
use crate::{Error, Result};

/// Mappings at least this large ask for transparent huge pages.
const HUGE_PAGE: usize = 2 << 20;

/// One page-aligned anonymous mapping, optionally locked; unmapped on drop.
pub struct HostBuffer {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is uniquely owned; access goes through &/&mut like a Box<[u8]>.
unsafe impl Send for HostBuffer {}
// SAFETY: shared access only hands out `&[u8]`.
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    /// Maps `len` bytes (rounded up to [`ALIGN`]), zeroed, and locks them if asked.
    pub fn new(len: usize, pinning: Pinning) -> Result<HostBuffer> {
        let len = len.max(1).next_multiple_of(ALIGN);
        // SAFETY: an anonymous private mapping with no address hint has no preconditions.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            let e = std::io::Error::last_os_error();
            return Err(Error::Resource(format!(
                "cannot map {} of host memory: {e}",
                human(len as u64)
            )));
        }
        let buf = HostBuffer {
            ptr: NonNull::new(ptr.cast()).expect("mmap never returns null on success"),
            len,
        };
        if len >= HUGE_PAGE {
            // Transparent huge pages keep each swap block physically contiguous, so a 1 MiB
            // O_DIRECT request is a handful of segments that the block layer passes whole and
            // merges; over scattered 4 KiB pages it exceeds the device's segment limit and
            // splits (fio moved half as many bytes per second from such buffers here). Only
            // advice: a kernel with THP off ignores it, so the result is not checked.
            // SAFETY: the range is exactly our mapping.
            unsafe { libc::madvise(ptr, len, libc::MADV_HUGEPAGE) };
        }
        if pinning == Pinning::Locked {
            // SAFETY: the range is exactly our mapping.
            if unsafe { libc::mlock(ptr, len) } != 0 {
                let e = std::io::Error::last_os_error();
                return Err(lock_error(len as u64, sys::memlock_limit(), &e));
            }
        }
        Ok(buf)
    }

    /// Size in bytes (a multiple of [`ALIGN`]).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: buffers hold at least one page.
    pub fn is_empty(&self) -> bool {
        false
    }
}

/// The refusal for a failed mlock, naming the limit and what to change.
pub(crate) fn lock_error(need: u64, limit: MemlockLimit, cause: &dyn std::fmt::Display) -> Error {
    Error::Resource(format!(
        "cannot lock {} of host memory (pin_memory = true): {cause}; RLIMIT_MEMLOCK is {limit}. \
         Raise the limit (`ulimit -l`, systemd LimitMEMLOCK=, docker --ulimit memlock=-1) to at \
         least {need} bytes, or set pin_memory = false",
        human(need)
    ))
}

impl Deref for HostBuffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: the mapping is `len` readable bytes owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for HostBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping (which also unlocks it).
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

impl AsRef<[u8]> for HostBuffer {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl AsMut<[u8]> for HostBuffer {
    fn as_mut(&mut self) -> &mut [u8] {
        self
    }
}
