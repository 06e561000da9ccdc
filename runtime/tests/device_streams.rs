//! The schedule's device arm on every device: events recorded on each stream complete, a copy
//! stream ordered after the compute stream's event reads what compute wrote, and an event
//! waited on by another stream or a host thread stays valid until its last holder drops it.

mod device_common;

use device_common::{rand, Dev};
use ferrozero_runtime::backend::Stream;
use ferrozero_runtime::tensor::{BufRef, DType};

fn copies_ordered_after_compute_see_its_result(d: &Dev) {
    let be = &*d.be;
    let (a, b) = (rand(1000, 7), rand(1000, 8));
    let mut acc = be.upload(BufRef::F32(&a)).unwrap();
    let x = be.upload(BufRef::F32(&b)).unwrap();
    let mut scratch = Vec::new();
    acc.accumulate(0, &x, 1000, &mut scratch).unwrap();
    let done = be.record(Stream::Compute).unwrap();
    be.wait_event(Stream::DeviceToHost, &done).unwrap();
    // A host lane waits on the same event from another thread.
    std::thread::scope(|s| s.spawn(|| done.synchronize()).join().unwrap()).unwrap();
    assert!(done.is_complete().unwrap(), "{}", d.name);
    let got = acc.to_vec_f32().unwrap();
    let want: Vec<f32> = a.iter().zip(&b).map(|(p, q)| p + q).collect();
    assert_eq!(got, want, "{}", d.name);
    for s in [Stream::Compute, Stream::HostToDevice, Stream::DeviceToHost] {
        let e = be.record(s).unwrap();
        be.wait_event(Stream::Compute, &e).unwrap();
        e.synchronize().unwrap();
    }
    assert_eq!(
        be.zeros(DType::F32, 3).unwrap().to_vec_f32().unwrap(),
        [0.0; 3]
    );
}
test_device!(copies_ordered_after_compute_see_its_result);
