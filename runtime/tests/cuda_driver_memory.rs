//! The emulated driver's memory (checks, copies, registration), streams' events and its
//! kernel registry, as a GPU would behave; and the real driver's refusal to open without one.
#![cfg(feature = "cuda")]

mod cuda_driver_common;

use std::sync::Arc;

use cuda_driver_common::{device_err, emu, emu_with_memory, on_real_device, S};
use ferrozero_runtime::backend::cuda::driver::{self, DevPtr, Driver, StreamKind};
use ferrozero_runtime::Error;

// ---------------------------------------------------------------------------------------------
// The real driver on a machine without a GPU.

#[test]
fn real_driver_says_why_there_is_no_device() {
    match driver::open(0) {
        Ok(d) => {
            // A machine with a GPU: then it must be a real one.
            assert!(!d.info().emulated);
            eprintln!("opened a real device: {}", d.info());
        }
        Err(e) => {
            let msg = e.to_string();
            assert!(matches!(e, Error::Unavailable { .. }), "{msg}");
            assert!(msg.contains("no CUDA device"), "{msg}");
            eprintln!("{msg}");
            assert!(driver::device_count().is_err() || driver::device_count().unwrap() == 0);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Emulated memory.

/// Host memory registered for copies: copies through it round-trip, a second registration of
/// the same pages and an unregistration of unregistered memory are refused with CUDA's names.
fn host_registration_round_trips(d: &Arc<dyn Driver>) {
    let mut a = vec![0u8; 3 << 20];
    let p = a.as_mut_ptr();
    // SAFETY: `a` outlives its registration (unregistered below).
    unsafe { d.host_register(p, a.len()) }.unwrap();
    let again = unsafe { d.host_register(p, a.len()) }.unwrap_err();
    assert!(again.to_string().contains("ALREADY_REGISTERED"), "{again}");
    let dp = d.malloc(a.len()).unwrap();
    for (i, x) in a.iter_mut().enumerate() {
        *x = (i % 251) as u8;
    }
    d.copy_htod(&a, dp, S).unwrap();
    let mut back = vec![0u8; a.len()];
    d.copy_dtoh(dp, &mut back, S).unwrap();
    assert!(back == a, "round trip through registered memory");
    a.fill(0);
    d.copy_dtoh(dp, &mut a, S).unwrap();
    assert!(a.iter().enumerate().all(|(i, &x)| x == (i % 251) as u8));
    unsafe { d.host_unregister(p) }.unwrap();
    let none = unsafe { d.host_unregister(p) }.unwrap_err();
    assert!(none.to_string().contains("NOT_REGISTERED"), "{none}");
    unsafe { d.free(dp) }.unwrap();
}

fn memory_is_aligned_and_round_trips(d: &Arc<dyn Driver>) {
    let base_allocated = d.allocated();
    let p = d.malloc(1000).unwrap();
    assert_eq!(p.0 % 256, 0, "cudaMalloc alignment");
    if d.info().emulated {
        let mut fresh = vec![0u8; 1000];
        d.copy_dtoh(p, &mut fresh, S).unwrap();
        assert!(
            fresh.iter().all(|&b| b == 0xFF),
            "fresh memory reads as NaN bytes"
        );
    }

    let data: Vec<u8> = (0..1000u32).map(|i| (i * 7 % 251) as u8).collect();
    d.copy_htod(&data, p, StreamKind::HostToDevice).unwrap();
    let mut back = vec![0u8; 1000];
    d.copy_dtoh(p, &mut back, StreamKind::DeviceToHost).unwrap();
    assert_eq!(back, data);

    d.memset_zero(p.offset(100), 50, S).unwrap();
    d.copy_dtoh(p, &mut back, S).unwrap();
    assert!(back[100..150].iter().all(|&b| b == 0));
    assert_eq!(back[..100], data[..100]);
    assert_eq!(back[150..], data[150..]);

    let q = d.malloc(600).unwrap();
    d.copy_dtod(p.offset(400), q, 600, S).unwrap();
    let mut part = vec![0u8; 600];
    d.copy_dtoh(q, &mut part, S).unwrap();
    assert_eq!(part, data[400..]);

    // Asynchronous forms, ordered across streams with an event.
    let src = vec![9u8; 64];
    unsafe { d.copy_htod_async(&src[..], q, StreamKind::HostToDevice) }.unwrap();
    let uploaded = d.event_create().unwrap();
    d.event_record(uploaded, StreamKind::HostToDevice).unwrap();
    d.stream_wait_event(StreamKind::DeviceToHost, uploaded)
        .unwrap();
    let mut dst = vec![0u8; 64];
    unsafe { d.copy_dtoh_async(q, &mut dst[..], StreamKind::DeviceToHost) }.unwrap();
    d.synchronize(StreamKind::DeviceToHost).unwrap();
    assert_eq!(dst, src);
    d.event_destroy(uploaded).unwrap();

    assert_eq!(d.allocated(), base_allocated + 1600);
    unsafe { d.free(p) }.unwrap();
    unsafe { d.free(q) }.unwrap();
    assert_eq!(d.allocated(), base_allocated);
}

fn memory_rejects_what_a_gpu_would_fault_on(d: &Arc<dyn Driver>) {
    let p = d.malloc(256).unwrap();
    let buf = vec![0u8; 257];

    // One byte past the end.
    let (op, detail) = device_err(d.copy_htod(&buf, p, S));
    assert_eq!(op, "cuMemcpyHtoDAsync");
    assert!(
        detail.contains("runs 1 bytes past the end of the 256-byte allocation"),
        "{detail}"
    );
    let mut out = vec![0u8; 16];
    let (op, _) = device_err(d.copy_dtoh(p.offset(250), &mut out, S));
    assert_eq!(op, "cuMemcpyDtoHAsync");
    let (op, _) = device_err(d.memset_zero(p.offset(8), 256, S));
    assert_eq!(op, "cuMemsetD8Async");

    // Foreign and null pointers.
    let host = [0u8; 64];
    let (_, detail) = device_err(d.copy_htod(&buf[..8], DevPtr(host.as_ptr() as u64), S));
    assert!(
        detail.contains("no allocation of this device contains it"),
        "{detail}"
    );
    let (_, detail) = device_err(d.memset_zero(DevPtr::NULL, 4, S));
    assert!(detail.contains("null pointer"), "{detail}");

    // Overlapping device-to-device copy.
    let (op, detail) = device_err(d.copy_dtod(p, p.offset(64), 128, S));
    assert_eq!(op, "cuMemcpyDtoDAsync");
    assert!(detail.contains("overlap"), "{detail}");

    // Frees: interior pointer, then use after free, then double free.
    let (op, detail) = device_err(unsafe { d.free(p.offset(16)) });
    assert_eq!(op, "cuMemFree");
    assert!(detail.contains("not to its start"), "{detail}");
    unsafe { d.free(p) }.unwrap();
    let (_, detail) = device_err(d.copy_htod(&buf[..4], p.offset(4), S));
    assert!(detail.contains("was freed"), "{detail}");
    let (op, detail) = device_err(unsafe { d.free(p) });
    assert_eq!(op, "cuMemFree");
    assert!(detail.contains("was freed"), "{detail}");

    // Zero bytes.
    let (op, _) = device_err(d.malloc(0));
    assert_eq!(op, "cuMemAlloc");
}

#[test]
fn emulated_memory_runs_out_at_its_total() {
    let d = emu_with_memory(1 << 20);
    let a = d.malloc(700 << 10).unwrap();
    match d.malloc(400 << 10) {
        Err(Error::DeviceMemory {
            requested,
            live,
            limit,
            detail,
            ..
        }) => {
            assert_eq!(requested, 400 << 10);
            assert_eq!(live, 700 << 10);
            assert_eq!(limit, 1 << 20);
            assert!(detail.contains("CUDA_ERROR_OUT_OF_MEMORY"), "{detail}");
        }
        other => panic!("expected DeviceMemory, got {other:?}"),
    }
    unsafe { d.free(a) }.unwrap();
    let b = d.malloc(400 << 10).unwrap();
    unsafe { d.free(b) }.unwrap();
}

fn events_order_streams_and_are_checked(d: &Arc<dyn Driver>) {
    let e = d.event_create().unwrap();
    assert!(
        d.event_query(e).unwrap(),
        "an event never recorded is complete"
    );
    d.event_record(e, StreamKind::HostToDevice).unwrap();
    d.stream_wait_event(S, e).unwrap();
    d.event_synchronize(e).unwrap();
    assert!(d.event_query(e).unwrap());
    d.synchronize(S).unwrap();
    d.event_destroy(e).unwrap();
    let (op, _) = device_err(d.event_record(e, S));
    assert_eq!(op, "cuEventRecord");
    let (op, _) = device_err(d.event_destroy(e));
    assert_eq!(op, "cuEventDestroy");
}

#[test]
fn emulated_builtin_registry_knows_its_kernels() {
    let d = driver::emulated().unwrap();
    assert!(d.info().emulated);
    assert!(d.info().to_string().contains("emulated"));
    let (op, detail) = device_err(d.kernel("no_such_kernel"));
    assert_eq!(op, "cuModuleGetFunction");
    assert!(
        detail.contains("no kernel named no_such_kernel"),
        "{detail}"
    );
    for p in driver::builtin_programs() {
        for k in &p.kernels {
            d.kernel(k).unwrap();
        }
    }
}

// The shared checks on the emulator.

#[test]
fn emulated_host_registration_round_trips() {
    host_registration_round_trips(&emu());
}

#[test]
fn emulated_memory_is_aligned_and_round_trips() {
    memory_is_aligned_and_round_trips(&emu());
}

#[test]
fn emulated_memory_rejects_what_a_gpu_would_fault_on() {
    memory_rejects_what_a_gpu_would_fault_on(&emu());
}

#[test]
fn emulated_events_order_streams_and_are_checked() {
    events_order_streams_and_are_checked(&emu());
}

#[test]
fn real_device_passes_the_memory_checks() {
    on_real_device(&[
        (
            "host_registration_round_trips",
            host_registration_round_trips,
        ),
        (
            "memory_is_aligned_and_round_trips",
            memory_is_aligned_and_round_trips,
        ),
        (
            "memory_rejects_what_a_gpu_would_fault_on",
            memory_rejects_what_a_gpu_would_fault_on,
        ),
        (
            "events_order_streams_and_are_checked",
            events_order_streams_and_are_checked,
        ),
    ]);
}
