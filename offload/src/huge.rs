//! Transparent huge pages for large host buffers that stream through the CPU (optimizer
//! state, gradients): a 2 MiB page lets the hardware prefetchers run on across what would be
//! 512 page boundaries (they stop at every 4 KiB one) and needs one TLB entry instead of 512.
//! On kernels whose THP mode is `madvise` (the default of many distributions, and this
//! project's machines) nothing gets huge pages unless asked.

/// Buffers smaller than this are left alone: they hold less than one huge page's worth.
pub const HUGE_PAGE: usize = 2 << 20;

/// Asks the kernel to back the whole 2 MiB-aligned pages inside `[ptr, ptr + len)` with
/// transparent huge pages. Only advice: small ranges are skipped and a failure (THP off, an
/// old kernel, an unmapped range) is ignored, since memory works the same either way; the
/// advice changes no byte and no mapping, so any address range is safe to pass. Advise before
/// the pages are first touched, so that the first fault already maps a huge page.
pub fn advise_huge_pages(ptr: *const u8, len: usize) {
    let start = (ptr as usize).next_multiple_of(HUGE_PAGE);
    let end = (ptr as usize).saturating_add(len) & !(HUGE_PAGE - 1);
    if end <= start {
        return;
    }
    // SAFETY: MADV_HUGEPAGE only changes how the kernel backs the range, never its contents
    // or whether it is mapped.
    unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
}

/// A `Vec` of `len` copies of `zero` whose large body asks for huge pages before it is first
/// written (the advice goes on the reserved capacity, then the elements are filled in).
pub fn filled_vec<T: Clone>(len: usize, zero: T) -> Vec<T> {
    let mut v: Vec<T> = Vec::with_capacity(len);
    advise_huge_pages(
        v.as_ptr().cast(),
        len.saturating_mul(std::mem::size_of::<T>()),
    );
    v.resize(len, zero);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advice_keeps_contents_and_tolerates_any_range() {
        let mut v: Vec<f32> = filled_vec(3 * HUGE_PAGE / 4 + 7, 0.25);
        assert_eq!(v.len(), 3 * HUGE_PAGE / 4 + 7);
        assert!(v.iter().all(|&x| x == 0.25));
        v[12345] = 1.5;
        advise_huge_pages(v.as_ptr().cast(), v.len() * 4);
        assert_eq!(v[12345], 1.5);
        advise_huge_pages(std::ptr::null(), 0);
        assert!(filled_vec::<u16>(0, 0).is_empty());
    }
}
