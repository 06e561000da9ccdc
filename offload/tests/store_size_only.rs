//! Size-only buffers (a length and no bytes): what the engine's size-only run swaps. A meta
//! store records and checks their lengths as it does for bytes; a store with files refuses
//! them by name, since it would have nothing to write.

use ferrozero_offload::store::{AioSettings, IoDst, IoSrc, NvmeStore};

/// A buffer with no bytes.
#[derive(Debug)]
struct SizeOnly;

impl IoSrc for SizeOnly {
    fn io_bytes(&self) -> Option<&[u8]> {
        None
    }
}

impl IoDst for SizeOnly {
    fn io_bytes_mut(&mut self) -> Option<&mut [u8]> {
        None
    }
}

#[test]
fn a_meta_store_takes_size_only_buffers_and_checks_their_lengths() {
    let store = NvmeStore::meta(&AioSettings::default()).unwrap();
    store.write_from("p0", &SizeOnly, 4096).unwrap();
    assert_eq!(store.len_of("p0"), Some(4096));
    store.read_into("p0", &mut SizeOnly, 4096).unwrap();
    let e = store.read_into("p0", &mut SizeOnly, 4095).unwrap_err();
    assert!(e.to_string().contains("holds 4096 bytes"), "{e}");
    assert!(store.read_into("absent", &mut SizeOnly, 1).is_err());
    let w = store.submit_write("p1", SizeOnly, 1000).wait();
    assert!(w.is_ok());
    assert_eq!(store.len_of("p1"), Some(1000));
    assert!(store.submit_read("p1", SizeOnly, 1000).wait().is_ok());
    assert!(store.submit_read("p1", SizeOnly, 999).wait().is_err());
    let t = store.bytes_moved();
    assert_eq!((t.read, t.written), (4096 + 1000, 4096 + 1000));
    // Bytes still work on a meta store, and a read leaves them as they were.
    store.write_from("b", &[7u8; 10][..], 10).unwrap();
    let mut back = [3u8; 10];
    store.read_into("b", &mut back[..], 10).unwrap();
    assert_eq!(back, [3u8; 10]);
}

#[test]
fn a_store_with_files_refuses_size_only_buffers_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let store = NvmeStore::open(tmp.path(), &AioSettings::default()).unwrap();
    let e = store.write_from("p0", &SizeOnly, 4096).unwrap_err();
    assert!(e.to_string().contains("size-only buffer"), "{e}");
    assert_eq!(store.len_of("p0"), None);
    store.write_from("p0", &[1u8; 4096][..], 4096).unwrap();
    let e = store.read_into("p0", &mut SizeOnly, 4096).unwrap_err();
    assert!(e.to_string().contains("size-only buffer"), "{e}");
    let e = store.submit_write("p1", SizeOnly, 8).wait().unwrap_err();
    assert!(e.to_string().contains("\"p1\""), "{e}");
    let mut back = vec![0u8; 4096];
    store.read_into("p0", &mut back[..], 4096).unwrap();
    assert_eq!(back, vec![1u8; 4096]);
}
