//! Damaged checkpoints and bad requests give errors that name the file and the fault, on
//! every rank (each rank's message names the failing rank and carries its error: for a
//! corrupt shard, the tensor and both checksums), without hanging; saving replaces tags
//! atomically and refuses bad tags.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{config, toy};
use ferrozero_config::resolved::{Precision, ZeroStage};
use ferrozero_runtime::comm::local::run_ranks;
use ferrozero_runtime::engine::checkpoint::{CheckpointReader, Tag, TensorKind};
use ferrozero_runtime::engine::Engine;

const V: usize = 11;
const SEQ: usize = 3;

fn engine(comm: Box<dyn ferrozero_runtime::comm::Communicator>, dim: usize) -> Engine {
    let cfg = config(ZeroStage::Stage2, comm.world_size(), 1, 1, Precision::Bf16);
    Engine::new(toy::model(V, dim, SEQ, 1), cfg, comm).unwrap()
}

fn saved(tag: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    run_ranks(2, Duration::from_secs(30), |comm| {
        let rank = comm.rank();
        let mut e = engine(comm, 8);
        e.train_batch(&[toy::batch(V, SEQ, rank, 1)])?;
        e.save_checkpoint(dir.path(), tag, 1)?;
        Ok(())
    })
    .unwrap();
    let file = dir.path().join(tag).join("rank-00001.safetensors");
    (dir, file)
}

/// Loads at world 2 and returns each rank's error message.
fn load_errors(dir: &Path, tag: Tag, dim: usize) -> Vec<String> {
    run_ranks(2, Duration::from_secs(30), |comm| {
        let mut e = engine(comm, dim);
        Ok(match e.load_checkpoint(dir, &tag) {
            Ok(_) => String::from("loaded"),
            Err(err) => err.to_string(),
        })
    })
    .unwrap()
}

fn assert_all(errs: &[String], parts: &[&str]) {
    // Every rank reads the same message: the failing rank's own error, with its rank.
    assert!(
        errs.iter().all(|e| parts.iter().all(|p| e.contains(p))),
        "not every error mentions {parts:?}: {errs:?}"
    );
    assert!(errs.iter().all(|e| e != "loaded"), "{errs:?}");
}

#[test]
fn a_flipped_byte_names_the_rank_the_file_the_tensor_and_both_checksums() {
    let (dir, file) = saved("t");
    let recorded = CheckpointReader::open(dir.path(), &Tag::Latest)
        .unwrap()
        .meta()
        .files[1]
        .tensors["group.0.exp_avg"];
    let mut bytes = std::fs::read(&file).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let start = header["group.0.exp_avg"]["data_offsets"][0]
        .as_u64()
        .unwrap() as usize;
    bytes[8 + n + start + 1] ^= 0x10;
    std::fs::write(&file, bytes).unwrap();
    let errs = load_errors(dir.path(), Tag::Latest, 8);
    assert_all(
        &errs,
        &[
            "checkpoint aborted: rank 1 failed",
            "rank-00001.safetensors",
            "checksum mismatch in tensor group.0.exp_avg",
            &format!("the metadata records {recorded:08x}"),
        ],
    );
    let found = errs[0]
        .split("group.0.exp_avg: CRC-32C ")
        .nth(1)
        .map(|s| &s[..8])
        .unwrap();
    assert_ne!(found, format!("{recorded:08x}"), "{errs:?}");
}

#[test]
fn a_truncated_file_is_reported_by_size_and_by_the_reader() {
    let (dir, file) = saved("t");
    let len = std::fs::metadata(&file).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(&file).unwrap();
    f.set_len(len - 40).unwrap();
    assert_all(
        &load_errors(dir.path(), Tag::Latest, 8),
        &["rank-00001.safetensors", "size"],
    );
    // Reading without verifying still refuses the short file rather than returning garbage.
    let r = CheckpointReader::open(dir.path(), &Tag::Latest).unwrap();
    let numel = r.meta().groups[0].numel;
    let err = r
        .read_f32(0, TensorKind::M, 0..numel)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("rank-00001") && err.contains("truncated"),
        "{err}"
    );
}

#[test]
fn missing_files_are_named() {
    let (dir, file) = saved("t");
    std::fs::remove_file(&file).unwrap();
    assert_all(
        &load_errors(dir.path(), Tag::Latest, 8),
        &["rank-00001.safetensors", "missing"],
    );
    std::fs::remove_file(dir.path().join("t/meta.json")).unwrap();
    assert_all(
        &load_errors(dir.path(), Tag::Latest, 8),
        &["meta.json", "missing"],
    );
    std::fs::remove_file(dir.path().join("latest")).unwrap();
    assert_all(
        &load_errors(dir.path(), Tag::Latest, 8),
        &["latest", "missing"],
    );
    assert_all(
        &load_errors(dir.path(), Tag::Named("nope".into()), 8),
        &["nope", "does not exist"],
    );
}

#[test]
fn a_different_model_is_refused_with_the_parameter_named() {
    let (dir, _) = saved("t");
    assert_all(
        &load_errors(dir.path(), Tag::Latest, 16),
        &["saved parameter", "where the model has"],
    );
}

#[test]
fn a_missing_tensor_and_a_wrong_shape_are_named() {
    let (dir, file) = saved("t");
    let r = CheckpointReader::open(dir.path(), &Tag::Latest).unwrap();
    let gm = r.meta().groups[0].clone();
    // Rewrite rank 1's file with one tensor renamed and one reshaped, and fix the checksum so
    // only the content checks can catch it.
    let bytes = std::fs::read(&file).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = String::from_utf8(bytes[8..8 + n].to_vec()).unwrap();
    let header = header.replace("group.0.exp_avg\"", "group.0.exp_avx\"");
    assert_eq!(header.len(), n);
    let mut out = bytes[..8].to_vec();
    out.extend(header.as_bytes());
    out.extend(&bytes[8 + n..]);
    std::fs::write(&file, out).unwrap();
    let err = r
        .read_f32(0, TensorKind::M, 0..gm.numel)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("rank-00001") && err.contains("missing tensor group.0.exp_avg"),
        "{err}"
    );

    // A layout that disagrees with the file: every tensor's shape is checked on read.
    let meta_path = dir.path().join("t/meta.json");
    let mut meta: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&meta_path).unwrap()).unwrap();
    let sl = meta["groups"][0]["shard_len"].as_u64().unwrap();
    meta["groups"][0]["shard_len"] = (sl + 16).into();
    std::fs::write(&meta_path, serde_json::to_vec(&meta).unwrap()).unwrap();
    let r = CheckpointReader::open(dir.path(), &Tag::Latest).unwrap();
    let err = r
        .read_f32(0, TensorKind::Master, 0..gm.numel)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("rank-00000")
            && err.contains(&format!("shape [{sl}], expected [{}]", sl + 16)),
        "{err}"
    );
}

#[test]
fn bad_tags_and_mid_accumulation_saves_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let errs = run_ranks(1, Duration::from_secs(30), |comm| {
        let mut e = engine(comm, 8);
        let mut errs = Vec::new();
        for tag in ["", "../x", ".hidden", "latest", "a/b"] {
            errs.push(
                e.save_checkpoint(dir.path(), tag, 0)
                    .unwrap_err()
                    .to_string(),
            );
        }
        e.forward(&toy::batch(V, SEQ, 0, 1))?;
        e.backward()?;
        errs.push(
            e.save_checkpoint(dir.path(), "mid", 0)
                .unwrap_err()
                .to_string(),
        );
        Ok(errs)
    })
    .unwrap();
    assert!(
        errs[0][..5].iter().all(|e| e.contains("checkpoint tag")),
        "{errs:?}"
    );
    assert!(errs[0][5].contains("gradient accumulation"), "{errs:?}");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

#[test]
fn saving_an_existing_tag_replaces_it_atomically() {
    let (dir, _) = saved("same");
    let before = CheckpointReader::open(dir.path(), &Tag::Latest)
        .unwrap()
        .meta()
        .step;
    run_ranks(2, Duration::from_secs(30), |comm| {
        let rank = comm.rank();
        let mut e = engine(comm, 8);
        e.load_checkpoint(dir.path(), &Tag::Latest)?;
        e.train_batch(&[toy::batch(V, SEQ, rank + 2, 1)])?;
        e.save_checkpoint(dir.path(), "same", 2)?;
        Ok(())
    })
    .unwrap();
    let r = CheckpointReader::open(dir.path(), &Tag::Latest).unwrap();
    r.verify_all().unwrap();
    assert_eq!((before, r.meta().step, r.meta().data_position), (1, 2, 2));
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(names.len(), 2, "leftovers: {names:?}");
}

#[test]
fn an_unwritable_directory_fails_on_every_rank_without_hanging() {
    let dir = tempfile::tempdir().unwrap();
    let not_a_dir = dir.path().join("file");
    std::fs::write(&not_a_dir, b"x").unwrap();
    let errs = run_ranks(3, Duration::from_secs(30), |comm| {
        let e = engine(comm, 8);
        Ok(e.save_checkpoint(&not_a_dir, "t", 0)
            .unwrap_err()
            .to_string())
    })
    .unwrap();
    // Every rank names rank 0 and says what it could not do, with the path.
    for e in &errs {
        assert!(
            e.contains("checkpoint aborted: rank 0 failed")
                && e.contains(&*not_a_dir.to_string_lossy()),
            "{errs:?}"
        );
    }
}
