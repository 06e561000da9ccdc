//! `comms.backend` means what it says: an engine given a communicator of another backend is
//! refused at construction, with the reason and what would work; the matching one is used.

mod common;

use std::time::Duration;

use common::{config, toy};
use ferrozero_config::resolved::{CommBackend, Precision, ZeroStage};
use ferrozero_runtime::comm::local::LocalComm;
use ferrozero_runtime::engine::Engine;

fn build(backend: CommBackend) -> ferrozero_runtime::Result<Engine> {
    let mut cfg = config(ZeroStage::Stage2, 1, 2, 1, Precision::F32);
    cfg.comms.backend = backend;
    let comm = LocalComm::group(1, Duration::from_secs(10)).remove(0);
    Engine::new(toy::model(11, 6, 5, 1), cfg, Box::new(comm))
}

#[test]
fn a_backend_the_job_does_not_have_is_refused_with_what_would_work() {
    for (backend, name, hint) in [
        (CommBackend::Nccl, "nccl", "one process per GPU"),
        (CommBackend::Mpi, "mpi", "--features mpi"),
    ] {
        let err = match build(backend) {
            Ok(_) => panic!("{name}: a local communicator was accepted"),
            Err(e) => e.to_string(),
        };
        assert!(
            err.contains(&format!("comms.backend = \"{name}\"")),
            "{err}"
        );
        assert!(err.contains("local communicator"), "{err}");
        assert!(err.contains(hint), "{err}");
        assert!(err.contains("comms.backend = \"local\""), "{err}");
    }
}

#[test]
fn the_matching_backend_is_used_and_named() {
    let e = build(CommBackend::Local).expect("local communicator for comms.backend = local");
    assert!(e.summary().contains("over local"), "{}", e.summary());
}
