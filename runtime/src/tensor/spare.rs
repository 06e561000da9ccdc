//! A per-thread cache of large buffers, so the engine's per-step transients (micro-step
//! gradients, gathered parameters, f32 working copies, reduction outputs) and the layers'
//! activations reuse memory instead of asking the kernel for fresh pages, and zeroing them,
//! every time.
//!
//! glibc serves every allocation above 32 MiB with a fresh `mmap` and returns it with
//! `munmap`, so without this each step page-faults (and zero-fills) every transient again:
//! measured on the 336M-parameter NVMe run, page faults were 44% of all CPU time; and below
//! that, `calloc` of a reused heap chunk is a `memset` (2% of a GPT step on this machine).
//! This is the role PyTorch's caching allocator plays. It is per thread because every rank
//! is a thread and each thread reuses its own buffers; it holds at most [`MAX_BUFFERS`]
//! buffers of at least [`MIN_BYTES`] each and [`MAX_BYTES`] in all, oldest evicted first: at
//! most what was live at once, since only buffers that died come back. The ledger counts
//! buffers in use, not what this cache holds.

use std::cell::RefCell;
use std::collections::VecDeque;

use super::storage::copy_view;
use super::{BufRef, DType, FlatBuf, View, ViewMut};

/// Buffers smaller than this are left to the allocator, which serves them well.
pub const MIN_BYTES: usize = 1 << 20;
/// Buffers held per thread.
pub const MAX_BUFFERS: usize = 128;
/// Bytes held per thread (beyond one buffer, which is always kept).
pub const MAX_BYTES: u64 = 2 << 30;

thread_local! {
    static CACHE: RefCell<VecDeque<FlatBuf>> = const { RefCell::new(VecDeque::new()) };
}

/// A cached buffer of exactly this shape, if one is held.
pub fn reuse(dtype: DType, len: usize) -> Option<FlatBuf> {
    if len * dtype.size() < MIN_BYTES {
        return None;
    }
    CACHE.with(|c| {
        let mut c = c.borrow_mut();
        let i = c
            .iter()
            .position(|b| b.dtype() == dtype && b.len() == len)?;
        c.remove(i)
    })
}

/// A buffer of `len` elements with unspecified contents (the caller overwrites every one).
pub fn take(dtype: DType, len: usize) -> FlatBuf {
    use half::vec::HalfBitsVecExt;
    // Zeros as bits: `calloc` maps fresh pages without writing them (a half-precision zero
    // is not one the allocator knows to map lazily), so a buffer a size-only device stages
    // through and never writes costs no resident memory.
    reuse(dtype, len).unwrap_or_else(|| match dtype {
        DType::F32 => FlatBuf::F32(vec![0.0; len]),
        DType::Bf16 => FlatBuf::Bf16(vec![0u16; len].reinterpret_into()),
        DType::F16 => FlatBuf::F16(vec![0u16; len].reinterpret_into()),
    })
}

/// A copy of `src` in a cached buffer when one of its shape is held.
pub fn copy_of(src: BufRef<'_>) -> FlatBuf {
    let Some(mut d) = reuse(src.dtype(), src.len()) else {
        return FlatBuf::from_ref(src);
    };
    // Same dtype and length by construction, so the copy cannot fail.
    match copy_view(View::Host(src), ViewMut::Host(d.as_mut())) {
        Ok(()) => d,
        Err(_) => FlatBuf::from_ref(src),
    }
}

/// An f32 vector of `len` elements with unspecified contents.
pub fn take_f32(len: usize) -> Vec<f32> {
    match take(DType::F32, len) {
        FlatBuf::F32(v) => v,
        _ => unreachable!("take(F32) returns an F32 buffer"),
    }
}

/// A zero-filled f32 vector.
pub fn zeros_f32(len: usize) -> Vec<f32> {
    let mut v = take_f32(len);
    v.fill(0.0);
    v
}

/// Hands a buffer back for reuse (small ones are simply dropped).
pub fn give(b: FlatBuf) {
    if b.bytes() < MIN_BYTES as u64 {
        return;
    }
    CACHE.with(|c| {
        let mut c = c.borrow_mut();
        c.push_back(b);
        let held = |c: &VecDeque<FlatBuf>| c.iter().map(FlatBuf::bytes).sum::<u64>();
        while c.len() > MAX_BUFFERS || (c.len() > 1 && held(&c) > MAX_BYTES) {
            c.pop_front();
        }
    });
}

/// Hands an f32 vector back for reuse.
pub fn give_f32(v: Vec<f32>) {
    give(FlatBuf::F32(v));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_reused_zeroed_and_bounded() {
        let n = MIN_BYTES; // f32: 4 MiB
        let mut a = zeros_f32(n);
        a[5] = 3.0;
        let ptr = a.as_ptr();
        give_f32(a);
        let b = zeros_f32(n);
        assert_eq!(b.as_ptr(), ptr, "the same allocation comes back");
        assert!(
            b.iter().all(|&x| x == 0.0),
            "zeros_f32 clears a reused buffer"
        );
        give_f32(b);
        for i in 0..MAX_BUFFERS + 2 {
            give(FlatBuf::F32(vec![0.0; MIN_BYTES / 4 + i]));
        }
        let held = CACHE.with(|c| c.borrow().len());
        assert_eq!(held, MAX_BUFFERS);
        let x = FlatBuf::F32((0..MIN_BYTES / 4 + 5).map(|i| i as f32).collect());
        assert_eq!(copy_of(x.as_ref()), x, "a copy through a cached buffer");
        let held = CACHE.with(|c| c.borrow().len());
        assert_eq!(
            held,
            MAX_BUFFERS - 1,
            "the copy took its buffer from the cache"
        );
        give_f32(vec![0.0; 10]);
        assert_eq!(
            CACHE.with(|c| c.borrow().len()),
            held,
            "small ones are dropped"
        );
    }
}
