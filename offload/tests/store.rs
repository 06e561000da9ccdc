//! The NVMe store: round trips on both engines and all submission modes, directory
//! ownership, and the documented errors for a full disk, a truncated file and a flipped byte.

use std::path::Path;

use ferrozero_offload::pool::{BufferPool, Pinning};
use ferrozero_offload::store::{AioSettings, Engine, EngineChoice, NvmeStore, Overlap, Submit};
use ferrozero_offload::Error;

fn settings(engine: EngineChoice) -> AioSettings {
    AioSettings {
        block_size: 16 << 10,
        queue_depth: 4,
        intra_op_parallelism: 1,
        submit: Submit::Batched,
        overlap: Overlap::Overlapped,
        engine,
    }
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 9) as u8)
        .collect()
}

fn variants() -> Vec<AioSettings> {
    let mut out = Vec::new();
    for engine in [EngineChoice::Auto, EngineChoice::Threads] {
        for (qd, intra, submit, overlap) in [
            (4, 1, Submit::Batched, Overlap::Overlapped),
            (1, 1, Submit::Single, Overlap::Sequential),
            (3, 2, Submit::Single, Overlap::Overlapped),
            (8, 3, Submit::Batched, Overlap::Sequential),
        ] {
            out.push(AioSettings {
                queue_depth: qd,
                intra_op_parallelism: intra,
                submit,
                overlap,
                ..settings(engine)
            });
        }
    }
    out
}

#[test]
fn round_trips_every_mode_and_length() {
    let tmp = tempfile::tempdir().unwrap();
    for (v, s) in variants().iter().enumerate() {
        let store = NvmeStore::open(&tmp.path().join(format!("v{v}")), s).unwrap();
        if s.engine == EngineChoice::Threads {
            assert_eq!(store.engine(), Engine::Threads);
        }
        for (k, len) in [0usize, 1, 4095, 16 << 10, (16 << 10) + 1, 200_001]
            .into_iter()
            .enumerate()
        {
            let data = pattern(len + 1, k as u8);
            // Offset by one byte: an unaligned caller slice must go through bounce buffers.
            let src = &data[1..];
            let key = format!("layer.{k}/exp_avg");
            store.write(&key, src).unwrap();
            assert_eq!(store.len_of(&key), Some(len));
            let mut back = vec![0u8; len + 3];
            store.read(&key, &mut back[3..]).unwrap();
            assert_eq!(&back[3..], src, "variant {v} len {len}");
        }
        // Aligned pool buffers take the zero-copy path.
        let pool = BufferPool::new(2, 64 << 10, Pinning::Locked).unwrap();
        let mut a = pool.acquire();
        a.copy_from_slice(&pattern(64 << 10, 9));
        store.write("aligned", &a).unwrap();
        let mut b = pool.acquire();
        store.read("aligned", &mut b).unwrap();
        assert_eq!(&a[..], &b[..]);
    }
}

/// Deep queues over many blocks of zero-copy (page-aligned) memory, where checksums are
/// computed while the writes are in flight and verified while later reads are: every mode
/// must still round-trip, including a partial last block.
#[test]
fn deep_queues_round_trip_zero_copy_buffers() {
    let tmp = tempfile::tempdir().unwrap();
    let len = 97 * (16 << 10) + 777;
    let data = pattern(len, 5);
    for (v, (submit, overlap)) in [
        (Submit::Batched, Overlap::Overlapped),
        (Submit::Single, Overlap::Overlapped),
        (Submit::Batched, Overlap::Sequential),
    ]
    .into_iter()
    .enumerate()
    {
        for engine in [EngineChoice::Auto, EngineChoice::Threads] {
            let s = AioSettings {
                queue_depth: 32,
                submit,
                overlap,
                ..settings(engine)
            };
            let store = NvmeStore::open(&tmp.path().join(format!("{v}-{engine:?}")), &s).unwrap();
            let pool = BufferPool::new(2, len, Pinning::Pageable).unwrap();
            let mut a = pool.acquire();
            a[..len].copy_from_slice(&data);
            store.write("deep", &a[..len]).unwrap();
            let mut b = pool.acquire();
            store.read("deep", &mut b[..len]).unwrap();
            assert!(b[..len] == data[..], "{submit:?} {overlap:?} {engine:?}");
            // Rewriting with other bytes replaces the checksums too.
            a[..len].copy_from_slice(&pattern(len, 6));
            store.write("deep", &a[..len]).unwrap();
            store.read("deep", &mut b[..len]).unwrap();
            assert!(b[..len] == pattern(len, 6)[..]);
        }
    }
}

/// With many blocks in flight, corruption in two blocks of a zero-copy read is reported at
/// the lower one, whatever order the completions and verifications happen in.
#[test]
fn corruption_in_a_deep_zero_copy_read_names_the_lowest_bad_block() {
    let bs = 16 << 10;
    let len = 64 * bs;
    for engine in [EngineChoice::Auto, EngineChoice::Threads] {
        let tmp = tempfile::tempdir().unwrap();
        let s = AioSettings {
            queue_depth: 16,
            ..settings(engine)
        };
        let store = NvmeStore::open(tmp.path(), &s).unwrap();
        let pool = BufferPool::new(1, len, Pinning::Pageable).unwrap();
        let mut buf = pool.acquire();
        buf[..len].copy_from_slice(&pattern(len, 7));
        store.write("opt.p", &buf[..len]).unwrap();
        let file = only_file(tmp.path());
        let mut bytes = std::fs::read(&file).unwrap();
        bytes[40 * bs + 5] ^= 1;
        bytes[13 * bs + 100] ^= 0x80;
        std::fs::write(&file, &bytes).unwrap();
        match store.read("opt.p", &mut buf[..len]).unwrap_err() {
            Error::Corrupt { offset, reason, .. } => {
                assert_eq!(offset, 13 * bs as u64, "{engine:?}");
                assert!(reason.contains("checksum"), "{reason}");
            }
            e => panic!("expected Corrupt, got {e}"),
        }
    }
}

#[test]
fn async_forms_return_the_buffer_and_the_data() {
    let tmp = tempfile::tempdir().unwrap();
    let store = NvmeStore::open(tmp.path(), &settings(EngineChoice::Auto)).unwrap();
    let pending: Vec<_> = (0..6)
        .map(|i| store.submit_write(&format!("t{i}"), pattern(50_000, i), 50_000))
        .collect();
    for p in pending {
        p.wait().unwrap();
    }
    for i in 0..6u8 {
        let back = store
            .submit_read(&format!("t{i}"), vec![0u8; 60_000], 50_000)
            .wait()
            .unwrap();
        assert_eq!(&back[..50_000], &pattern(50_000, i)[..]);
    }
    let e = store
        .submit_read("t0", vec![0u8; 10], 50_000)
        .wait()
        .unwrap_err();
    assert!(matches!(e, Error::Length { .. }), "{e}");
}

#[test]
fn a_directory_has_one_owner_and_is_cleaned_on_drop() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("swap");
    let store = NvmeStore::open(&dir, &settings(EngineChoice::Auto)).unwrap();
    store.write("w", &[1u8; 100]).unwrap();
    let e = NvmeStore::open(&dir, &settings(EngineChoice::Auto))
        .err()
        .expect("second store refused");
    assert!(e.to_string().contains("in use by another store"), "{e}");
    assert!(std::fs::read_dir(&dir).unwrap().count() >= 2);
    drop(store);
    assert_eq!(
        std::fs::read_dir(&dir).unwrap().count(),
        0,
        "files and lock removed on drop"
    );
    // A stale tensor file from a crashed run is removed when the directory is taken again.
    std::fs::write(dir.join("t-old.swp"), b"x").unwrap();
    let store = NvmeStore::open(&dir, &settings(EngineChoice::Auto)).unwrap();
    assert!(!dir.join("t-old.swp").exists());
    let e = store.read("never-written", &mut [0u8; 4]).unwrap_err();
    assert!(e.to_string().contains("never-written"), "{e}");
    store.write("k", &[0u8; 10]).unwrap();
    assert!(matches!(
        store.read("k", &mut [0u8; 9]).unwrap_err(),
        Error::Length { .. }
    ));
    let bad = AioSettings {
        block_size: 1000,
        ..settings(EngineChoice::Auto)
    };
    assert!(NvmeStore::open(&tmp.path().join("b"), &bad).is_err());
}

fn only_file(dir: &Path) -> std::path::PathBuf {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "swp"))
        .unwrap()
}

#[test]
fn a_flipped_byte_is_a_checksum_error_naming_file_offset_and_tensor() {
    for engine in [EngineChoice::Auto, EngineChoice::Threads] {
        let tmp = tempfile::tempdir().unwrap();
        let store = NvmeStore::open(tmp.path(), &settings(engine)).unwrap();
        store.write("opt.m", &pattern(100_000, 3)).unwrap();
        let file = only_file(tmp.path());
        let mut bytes = std::fs::read(&file).unwrap();
        bytes[40_000] ^= 0x10;
        std::fs::write(&file, &bytes).unwrap();
        let mut back = vec![0u8; 100_000];
        match store.read("opt.m", &mut back).unwrap_err() {
            Error::Corrupt {
                path,
                offset,
                tensor,
                reason,
            } => {
                assert_eq!(path, file.display().to_string());
                assert_eq!(offset, 32 << 10, "the 16 KiB block holding byte 40000");
                assert_eq!(tensor, "opt.m");
                assert!(reason.contains("checksum"), "{reason}");
            }
            e => panic!("expected Corrupt, got {e}"),
        }
    }
}

#[test]
fn a_truncated_file_is_a_short_read_error() {
    for engine in [EngineChoice::Auto, EngineChoice::Threads] {
        let tmp = tempfile::tempdir().unwrap();
        let store = NvmeStore::open(tmp.path(), &settings(engine)).unwrap();
        store.write("opt.v", &pattern(100_000, 4)).unwrap();
        let file = only_file(tmp.path());
        std::fs::OpenOptions::new()
            .write(true)
            .open(&file)
            .unwrap()
            .set_len(50_000)
            .unwrap();
        let mut back = vec![0u8; 100_000];
        match store.read("opt.v", &mut back).unwrap_err() {
            Error::Corrupt {
                offset,
                tensor,
                reason,
                ..
            } => {
                assert_eq!(offset, 48 << 10, "the block the truncation cut");
                assert_eq!(tensor, "opt.v");
                assert!(reason.contains("short read"), "{reason}");
            }
            e => panic!("expected Corrupt, got {e}"),
        }
    }
}

/// A 1 MiB tmpfs, unmounted on drop.
struct SmallFs(tempfile::TempDir);

impl SmallFs {
    fn mount() -> Result<SmallFs, String> {
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let c = |s: &str| std::ffi::CString::new(s).unwrap();
        let target = c(dir.path().to_str().unwrap());
        // SAFETY: valid C strings; mount has no other preconditions.
        let rc = unsafe {
            libc::mount(
                c("tmpfs").as_ptr(),
                target.as_ptr(),
                c("tmpfs").as_ptr(),
                0,
                c("size=1m").as_ptr().cast(),
            )
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error().to_string());
        }
        Ok(SmallFs(dir))
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let target = std::ffi::CString::new(self.0.path().to_str().unwrap()).unwrap();
        // SAFETY: unmounting what we mounted.
        unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
    }
}

#[test]
fn a_full_disk_is_an_io_error_naming_file_and_tensor() {
    let fs = match SmallFs::mount() {
        Ok(fs) => fs,
        Err(e) => {
            eprintln!("SKIPPED a_full_disk_is_an_io_error_naming_file_and_tensor: cannot mount a small tmpfs ({e})");
            return;
        }
    };
    for engine in [EngineChoice::Auto, EngineChoice::Threads] {
        let dir = fs.0.path().join(format!("{engine:?}"));
        let store = NvmeStore::open(&dir, &settings(engine)).unwrap();
        store.write("fits", &pattern(300_000, 1)).unwrap();
        match store.write("too.big", &pattern(2 << 20, 2)).unwrap_err() {
            Error::Io {
                path,
                tensor,
                source,
                ..
            } => {
                assert!(path.ends_with("t-too.big.swp"), "{path}");
                assert_eq!(tensor, "too.big");
                assert_eq!(source.raw_os_error(), Some(libc::ENOSPC), "{source}");
            }
            e => panic!("expected Io, got {e}"),
        }
        // The failed tensor is not readable; the earlier one still is.
        assert!(store.read("too.big", &mut vec![0u8; 2 << 20]).is_err());
        let mut back = vec![0u8; 300_000];
        store.read("fits", &mut back).unwrap();
        assert_eq!(back, pattern(300_000, 1));
    }
}

#[test]
fn the_engine_is_chosen_at_start_and_reported_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let store = NvmeStore::open(&tmp.path().join("a"), &settings(EngineChoice::Auto)).unwrap();
    match store.engine() {
        Engine::IoUring => assert!(store.engine_note().is_none()),
        Engine::Threads => {
            let note = store.engine_note().expect("a fallback says why");
            eprintln!("io_uring unavailable here: {note}");
            let e = NvmeStore::open(&tmp.path().join("b"), &settings(EngineChoice::IoUring)).err();
            assert!(e
                .expect("io_uring demanded")
                .to_string()
                .contains("io_uring"));
        }
        Engine::Meta => panic!("a store with a directory moves bytes"),
    }
    assert_eq!(Engine::IoUring.name(), "io_uring");
    assert_eq!(Engine::Threads.name(), "threads");
    let threads = NvmeStore::open(&tmp.path().join("c"), &settings(EngineChoice::Threads)).unwrap();
    assert_eq!(threads.engine(), Engine::Threads);
    assert!(threads.engine_note().is_none(), "chosen, not a fallback");
}
