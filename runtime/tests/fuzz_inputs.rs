//! Bounded fuzzing of the files users hand the runtime: a safetensors file (header and data)
//! through `weights::load`, and a checkpoint's `meta.json` through `CheckpointMeta::read`.
//! Mutations of valid files and random bytes must give a value or an error naming the file,
//! never a panic; a metadata file that passes the check must describe a layout whose sizes
//! are consistent, so that loading it cannot index or allocate past it.

use std::path::Path;

use ferrozero_runtime::engine::checkpoint::{CheckpointMeta, FileMeta, GroupMeta, SlotMeta};
use ferrozero_runtime::engine::loss_scale::LossScaler;
use ferrozero_runtime::nn::weights::{self, Naming};
use ferrozero_runtime::tensor::DType;
use proptest::prelude::*;

/// A valid two-tensor safetensors file, as bytes.
fn weights_seed(dir: &Path) -> Vec<u8> {
    let path = dir.join("seed.safetensors");
    let a: Vec<f32> = (0..6).map(|i| i as f32 * 0.5).collect();
    weights::save(
        &path,
        &[("h.0.attn.w", &[2, 3], &a), ("wte", &[4], &a[..4])],
        DType::Bf16,
    )
    .unwrap();
    std::fs::read(path).unwrap()
}

fn meta_seed() -> CheckpointMeta {
    let slot = |name: &str, offset, shape: Vec<usize>| SlotMeta {
        name: name.into(),
        numel: shape.iter().product(),
        shape,
        offset,
    };
    CheckpointMeta {
        format: "ferrozero-checkpoint".into(),
        version: 1,
        tag: "step1".into(),
        step: 1,
        data_position: 8,
        world_size: 2,
        stage: 3,
        param_dtype: "bf16".into(),
        has_master: true,
        moments: 2,
        seed: 42,
        scaler: LossScaler::None,
        next_lr: 1e-4,
        config: serde_json::json!({}),
        groups: vec![GroupMeta {
            slots: vec![slot("a", 0, vec![2, 3]), slot("b", 6, vec![4])],
            numel: 10,
            shard_len: 16,
            frozen: false,
        }],
        frozen_base: None,
        files: (0..2)
            .map(|r| FileMeta {
                name: format!("rank-{r:05}.safetensors"),
                bytes: 100,
                crc32c: 7,
                tensors: Default::default(),
            })
            .collect(),
    }
}

/// Writes `bytes` as the tag directory's metadata and reads it back.
fn read_meta(dir: &Path, bytes: &[u8]) -> Result<CheckpointMeta, String> {
    std::fs::write(dir.join("meta.json"), bytes).unwrap();
    CheckpointMeta::read(dir).map_err(|e| e.to_string())
}

/// What a layout that passed the check promises the reader.
fn assert_consistent(m: &CheckpointMeta) {
    assert_eq!(m.files.len(), m.world_size);
    for g in &m.groups {
        let mut end = 0usize;
        for s in &g.slots {
            assert_eq!(s.offset, end, "{g:?}");
            assert_eq!(
                s.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)),
                Some(s.numel)
            );
            end = s.offset.checked_add(s.numel).unwrap();
        }
        assert_eq!(end, g.numel);
        assert!(g.shard_len.checked_mul(m.world_size).unwrap() >= g.numel);
    }
}

fn mutate(seed: &[u8], edits: &[(usize, u8, u8)]) -> Vec<u8> {
    let mut bytes = seed.to_vec();
    for &(pos, op, byte) in edits {
        if bytes.is_empty() {
            break;
        }
        let i = pos % bytes.len();
        match op % 4 {
            0 => bytes[i] = byte,
            1 => {
                bytes.remove(i);
            }
            2 => bytes.insert(i, byte),
            // Digits matter most in both formats: sizes, offsets and lengths.
            _ => bytes[i] = b'0' + byte % 10,
        }
    }
    bytes
}

proptest! {
    // Bounded for CI: each property a few seconds at most.
    #![proptest_config(ProptestConfig { cases: 1500, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn mutated_safetensors_load_or_name_the_file(edits in proptest::collection::vec((any::<usize>(), any::<u8>(), any::<u8>()), 1..6)) {
        let dir = tempfile::tempdir().unwrap();
        let seed = weights_seed(dir.path());
        // Most edits land in the header, which is where a loader can go wrong.
        let header = 8 + u64::from_le_bytes(seed[..8].try_into().unwrap()) as usize;
        let edits: Vec<_> = edits.iter().map(|&(p, o, b)| (p % header, o, b)).collect();
        let path = dir.path().join("m.safetensors");
        std::fs::write(&path, mutate(&seed, &edits)).unwrap();
        match weights::load(&path, Naming::Exact) {
            Ok(ts) => for t in ts {
                prop_assert_eq!(t.shape.iter().product::<usize>(), t.data.len());
            },
            Err(e) => prop_assert!(e.to_string().contains("m.safetensors"), "{}", e),
        }
    }

    #[test]
    fn random_bytes_are_not_weights(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r.safetensors");
        std::fs::write(&path, &bytes).unwrap();
        if let Err(e) = weights::load(&path, Naming::Exact) {
            prop_assert!(e.to_string().contains("r.safetensors"), "{}", e);
        }
    }

    #[test]
    fn mutated_metadata_is_consistent_or_refused(edits in proptest::collection::vec((any::<usize>(), any::<u8>(), any::<u8>()), 1..6)) {
        let dir = tempfile::tempdir().unwrap();
        let seed = serde_json::to_vec(&meta_seed()).unwrap();
        match read_meta(dir.path(), &mutate(&seed, &edits)) {
            Ok(m) => assert_consistent(&m),
            Err(e) => prop_assert!(e.contains("meta.json"), "{}", e),
        }
    }

    /// Sizes anywhere in `usize`: the check's arithmetic must not wrap into a pass.
    #[test]
    fn metadata_sizes_are_checked_not_wrapped(
        world in 0usize..5,
        shard_len in prop_oneof![0usize..64, Just(usize::MAX / 2 + 9), any::<usize>()],
        offset in prop_oneof![Just(6usize), any::<usize>()],
        dims in proptest::collection::vec(prop_oneof![1usize..5, any::<usize>()], 0..3),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let mut m = meta_seed();
        m.world_size = world;
        m.files.truncate(world);
        m.groups[0].shard_len = shard_len;
        m.groups[0].slots[1].offset = offset;
        m.groups[0].slots[1].shape = dims;
        if let Ok(m) = read_meta(dir.path(), &serde_json::to_vec(&m).unwrap()) {
            assert_consistent(&m);
        }
    }
}

#[test]
fn the_seeds_are_valid() {
    let dir = tempfile::tempdir().unwrap();
    let seed = weights_seed(dir.path());
    std::fs::write(dir.path().join("w.safetensors"), &seed).unwrap();
    assert_eq!(
        weights::load(&dir.path().join("w.safetensors"), Naming::Exact)
            .unwrap()
            .len(),
        2
    );
    let m = read_meta(dir.path(), &serde_json::to_vec(&meta_seed()).unwrap()).unwrap();
    assert_consistent(&m);
}

/// Found by the properties above: shards whose total wraps past `usize::MAX` to a small
/// number passed the "shards cover the group" check, and the reader would then size its
/// reads by the huge shard length.
#[test]
fn shards_whose_total_wraps_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut m = meta_seed();
    m.groups[0].shard_len = usize::MAX / 2 + 9; // times 2 wraps to 16
    let e = read_meta(dir.path(), &serde_json::to_vec(&m).unwrap()).unwrap_err();
    assert!(
        e.contains("meta.json")
            && e.contains("group 0: inconsistent layout")
            && e.contains("do not cover 10"),
        "{e}"
    );
}

/// A slot placed past its group, or not where the previous one ends, is refused by name: the
/// consolidation would slice the group's buffer there.
#[test]
fn slots_outside_their_group_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut m = meta_seed();
    m.groups[0].slots[1].offset = 1 << 40;
    let e = read_meta(dir.path(), &serde_json::to_vec(&m).unwrap()).unwrap_err();
    assert!(e.contains("`b` starts at 1099511627776, not at 6"), "{e}");
    let mut m = meta_seed();
    m.groups[0].slots[0].shape = vec![5, 3];
    let e = read_meta(dir.path(), &serde_json::to_vec(&m).unwrap()).unwrap_err();
    assert!(e.contains("`a` has shape [5, 3] but 6 elements"), "{e}");
}
