//! The caching allocator on the emulated driver: reuse, counts, limits, splitting and
//! merging, cross-stream lifetimes, threads.
#![cfg(feature = "cuda")]

mod cuda_driver_common;

use std::sync::Arc;

use cuda_driver_common::{emu, emu_with_memory, on_real_device, S};
use ferrozero_runtime::backend::cuda::driver::{
    Allocator, DeviceBuffer, Driver, StreamKind, LARGE_SEGMENT_ROUND, SMALL_SEGMENT,
};
use ferrozero_runtime::Error;

// ---------------------------------------------------------------------------------------------
// The caching allocator on the emulated driver.

fn allocator_reuses_blocks_without_driver_calls_once_warm(d: &Arc<dyn Driver>) {
    let base_allocated = d.allocated();
    let alloc = Allocator::new(d.clone());
    let sizes = [100usize, 4096, 70_000, 3 << 20, 10 << 20, 512, 1 << 20];
    let step = |alloc: &Arc<Allocator>| {
        let bufs: Vec<DeviceBuffer> = sizes.iter().map(|&s| alloc.alloc(s).unwrap()).collect();
        for b in &bufs {
            assert_eq!(b.ptr().0 % 256, 0);
            assert!(b.rounded_len() >= b.len() as u64 && b.rounded_len() % 512 == 0);
        }
        drop(bufs);
    };
    step(&alloc);
    let warm = alloc.stats();
    assert!(warm.driver_allocs > 0);
    for _ in 0..5 {
        step(&alloc);
    }
    let after = alloc.stats();
    assert_eq!(
        after.driver_allocs, warm.driver_allocs,
        "no cuMemAlloc once warm"
    );
    assert_eq!(after.reserved, warm.reserved);
    assert_eq!(after.live, 0);
    assert_eq!(after.live_buffers, 0);
    assert_eq!(d.allocated(), base_allocated + after.reserved);

    alloc.empty_cache().unwrap();
    let empty = alloc.stats();
    assert_eq!(empty.reserved, 0);
    assert_eq!(empty.segments, 0);
    assert_eq!(empty.driver_frees, empty.driver_allocs);
    assert_eq!(d.allocated(), base_allocated);
}

fn allocator_counts_live_and_peak_bytes(d: &Arc<dyn Driver>) {
    let alloc = Allocator::new(d.clone());
    let a = alloc.alloc(1000).unwrap(); // 1024
    let b = alloc.alloc(3 << 20).unwrap(); // 3 MiB
    let s = alloc.stats();
    assert_eq!(s.live, 1024 + (3 << 20));
    assert_eq!(s.peak_live, s.live);
    assert_eq!(s.reserved, SMALL_SEGMENT + 2 * LARGE_SEGMENT_ROUND);
    assert_eq!(s.live_buffers, 2);
    drop(b);
    let s = alloc.stats();
    assert_eq!(s.live, 1024);
    assert_eq!(s.peak_live, 1024 + (3 << 20));
    alloc.reset_peak();
    let s = alloc.stats();
    assert_eq!(s.peak_live, 1024);
    assert_eq!(s.peak_reserved, s.reserved);
    let zero = alloc.alloc(0).unwrap();
    assert!(zero.is_empty() && zero.ptr().is_null());
    assert_eq!(alloc.stats().live, 1024);
    drop((a, zero));
    assert_eq!(alloc.stats().live, 0);
}

fn allocator_limit_fails_with_every_number(d: &Arc<dyn Driver>) {
    let alloc = Allocator::with_limit(d.clone(), Some(10_000));
    let a = alloc.alloc(6000).unwrap(); // 6144
    let err = alloc.alloc(4000).unwrap_err(); // 4096: 10240 > 10000
    match &err {
        Error::DeviceMemory {
            requested,
            live,
            peak,
            limit,
            ..
        } => {
            assert_eq!(
                (*requested, *live, *peak, *limit),
                (4000, 6144, 6144, 10_000)
            );
        }
        other => panic!("expected DeviceMemory, got {other:?}"),
    }
    let msg = err.to_string();
    for n in ["4000", "4096", "6144", "10000"] {
        assert!(msg.contains(n), "{n} missing from: {msg}");
    }
    let b = alloc.alloc(3500).unwrap(); // 3584: 9728 fits
    drop(b);
    alloc.set_limit(None);
    assert!(matches!(
        alloc.alloc(usize::MAX),
        Err(Error::DeviceMemory { .. })
    ));
    let c = alloc.alloc(1 << 20).unwrap();
    assert_eq!(alloc.limit(), None);
    drop((a, c));
}

fn allocator_splits_best_fits_and_merges(d: &Arc<dyn Driver>) {
    let base_allocated = d.allocated();
    let alloc = Allocator::new(d.clone());
    // Three small blocks carved from one 1 MiB segment, in address order.
    let a = alloc.alloc(1024).unwrap();
    let b = alloc.alloc(2048).unwrap();
    let c = alloc.alloc(512).unwrap();
    assert_eq!(alloc.stats().segments, 1);
    assert_eq!(b.ptr().0, a.ptr().0 + 1024);
    assert_eq!(c.ptr().0, b.ptr().0 + 2048);
    let (pa, pb) = (a.ptr(), b.ptr());
    // Freeing a and b merges them: a 3 KiB request fits exactly where a was.
    drop(b);
    drop(a);
    let ab = alloc.alloc(3072).unwrap();
    assert_eq!(ab.ptr(), pa);
    // Best fit: a 2 KiB hole (after ab is split off again) is preferred over the segment's tail.
    drop(ab);
    let x = alloc.alloc(1024).unwrap();
    assert_eq!(x.ptr(), pa);
    let y = alloc.alloc(2048).unwrap();
    assert_eq!(y.ptr(), pb, "the 2 KiB hole, not the large tail");
    drop((x, y, c));
    assert_eq!(alloc.stats().segments, 1);

    // Large: a 6 MiB segment serves a later 3 MiB request by splitting (more than 1 MiB
    // left), and a 5.5 MiB request takes a 6 MiB block whole (less than 1 MiB left).
    let big = alloc.alloc(6 << 20).unwrap();
    let pbig = big.ptr();
    drop(big);
    let allocs = alloc.stats().driver_allocs;
    let half = alloc.alloc(3 << 20).unwrap();
    assert_eq!(half.ptr(), pbig);
    let rest = alloc.alloc(2 << 20).unwrap();
    assert_eq!(rest.ptr().0, pbig.0 + (3 << 20), "the split-off tail");
    assert_eq!(alloc.stats().driver_allocs, allocs, "both from the cache");
    drop((half, rest));
    let whole = alloc.alloc((5 << 20) + (512 << 10)).unwrap();
    assert_eq!(whole.ptr(), pbig);
    drop(whole);
    let small_after = alloc.alloc(100).unwrap();
    assert_ne!(
        small_after.ptr(),
        pbig,
        "small requests never take large blocks"
    );
    drop(small_after);
    alloc.empty_cache().unwrap();
    assert_eq!(d.allocated(), base_allocated);
}

#[test]
fn allocator_empties_its_cache_and_retries_when_the_device_is_full() {
    let d = emu_with_memory(8 << 20);
    let alloc = Allocator::new(d.clone());
    drop(alloc.alloc(100 << 10).unwrap()); // a cached 1 MiB small segment
    drop(alloc.alloc(2 << 20).unwrap()); // a cached 2 MiB large segment
    assert_eq!(d.allocated(), 3 << 20);
    // 7.5 MiB needs an 8 MiB segment: only after the cache goes back.
    let big = alloc.alloc((7 << 20) + (512 << 10)).unwrap();
    let s = alloc.stats();
    assert_eq!(s.oom_retries, 1);
    assert_eq!(s.driver_frees, 2);
    assert_eq!(s.reserved, 8 << 20);
    // Now nothing more fits, even after emptying the (empty) cache.
    let err = alloc.alloc(1 << 20).unwrap_err();
    match &err {
        Error::DeviceMemory {
            live,
            limit,
            detail,
            ..
        } => {
            assert_eq!(*live, (7 << 20) + (512 << 10));
            assert_eq!(*limit, 8 << 20);
            assert!(detail.contains("CUDA_ERROR_OUT_OF_MEMORY"), "{detail}");
        }
        other => panic!("expected DeviceMemory, got {other:?}"),
    }
    drop(big);
}

fn allocator_holds_blocks_used_on_other_streams_until_their_event(d: &Arc<dyn Driver>) {
    let alloc = Allocator::new(d.clone());
    let mut a = alloc.alloc(4096).unwrap();
    let pa = a.ptr();
    a.record_stream(StreamKind::HostToDevice);
    drop(a);
    // The emulator's events complete at once, so the next request reuses the block.
    let b = alloc.alloc(4096).unwrap();
    assert_eq!(b.ptr(), pa);
    drop(b);
    let mut c = alloc.alloc(4096).unwrap();
    c.record_stream(StreamKind::DeviceToHost);
    drop(c);
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.stats().reserved, 0);
}

fn allocator_is_thread_safe_and_buffers_cross_threads(d: &Arc<dyn Driver>) {
    let base_allocated = d.allocated();
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<DeviceBuffer>();
    assert_send_sync::<Allocator>();
    let alloc = Allocator::new(d.clone());
    let handles: Vec<_> = (0..4)
        .map(|t| {
            let alloc = alloc.clone();
            std::thread::spawn(move || {
                let mut kept = Vec::new();
                for i in 0..200usize {
                    let bytes = 1 + (i * 7919 + t * 104_729) % (1 << 18) * (1 + i % 5);
                    let b = alloc.alloc(bytes).unwrap();
                    let fill = vec![(i % 251) as u8; bytes.min(4096)];
                    b.copy_from_host(&fill, S).unwrap();
                    let mut back = vec![0u8; fill.len()];
                    b.copy_to_host(&mut back, S).unwrap();
                    assert_eq!(back, fill);
                    if i % 5 == 0 {
                        kept.push(b);
                    }
                }
                kept
            })
        })
        .collect();
    let kept: Vec<Vec<DeviceBuffer>> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let live: u64 = kept.iter().flatten().map(|b| b.rounded_len()).sum();
    assert_eq!(alloc.stats().live, live);
    // Buffers are dropped on another thread than the one that allocated them.
    std::thread::spawn(move || drop(kept)).join().unwrap();
    let s = alloc.stats();
    assert_eq!((s.live, s.live_buffers), (0, 0));
    assert!(s.reserved >= s.live);
    alloc.empty_cache().unwrap();
    assert_eq!(d.allocated(), base_allocated);
    // A buffer bigger than the host slice is fine; a slice bigger than the buffer is not.
    let b = alloc.alloc(10).unwrap();
    assert!(matches!(
        b.copy_from_host(&[0u8; 11], S),
        Err(Error::Shape { .. })
    ));
}

// ---------------------------------------------------------------------------------------------
// The shared checks on the emulator (`real_device_passes_the_same_checks` runs them on a GPU).

#[test]
fn emulated_allocator_reuses_blocks_without_driver_calls_once_warm() {
    allocator_reuses_blocks_without_driver_calls_once_warm(&emu());
}

#[test]
fn emulated_allocator_counts_live_and_peak_bytes() {
    allocator_counts_live_and_peak_bytes(&emu());
}

#[test]
fn emulated_allocator_limit_fails_with_every_number() {
    allocator_limit_fails_with_every_number(&emu());
}

#[test]
fn emulated_allocator_splits_best_fits_and_merges() {
    allocator_splits_best_fits_and_merges(&emu());
}

#[test]
fn emulated_allocator_holds_blocks_used_on_other_streams_until_their_event() {
    allocator_holds_blocks_used_on_other_streams_until_their_event(&emu());
}

#[test]
fn emulated_allocator_is_thread_safe_and_buffers_cross_threads() {
    allocator_is_thread_safe_and_buffers_cross_threads(&emu());
}

#[test]
fn real_device_passes_the_allocator_checks() {
    on_real_device(&[
        (
            "allocator_reuses_blocks_without_driver_calls_once_warm",
            allocator_reuses_blocks_without_driver_calls_once_warm,
        ),
        (
            "allocator_counts_live_and_peak_bytes",
            allocator_counts_live_and_peak_bytes,
        ),
        (
            "allocator_limit_fails_with_every_number",
            allocator_limit_fails_with_every_number,
        ),
        (
            "allocator_splits_best_fits_and_merges",
            allocator_splits_best_fits_and_merges,
        ),
        (
            "allocator_holds_blocks_used_on_other_streams_until_their_event",
            allocator_holds_blocks_used_on_other_streams_until_their_event,
        ),
        (
            "allocator_is_thread_safe_and_buffers_cross_threads",
            allocator_is_thread_safe_and_buffers_cross_threads,
        ),
    ]);
}
