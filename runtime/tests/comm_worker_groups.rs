//! Asynchronous collectives through `CommWorker`, and sub-groups through `split` and
//! `duplicate`, on the `local` communicator.

use std::time::Duration;

use ferrozero_runtime::comm::local::run_ranks;
use ferrozero_runtime::comm::worker::{CommWorker, OwnedBuf};
use ferrozero_runtime::comm::{BufMut, BufRef, Communicator, ReduceOp};
use ferrozero_runtime::Error;

const TIMEOUT: Duration = Duration::from_secs(20);

#[test]
fn worker_overlaps_with_direct_collectives_and_returns_buffers() {
    let out = run_ranks(4, TIMEOUT, |c: Box<dyn Communicator>| {
        let w = CommWorker::duplicate_of(&*c)?;
        let r = c.rank() as f32;
        // Two collectives in flight on the worker while the main communicator runs another.
        let a = w.all_reduce(OwnedBuf::F32(vec![r; 1000]), ReduceOp::Sum);
        let b = w.all_gather(OwnedBuf::F32(vec![r; 3]), OwnedBuf::F32(vec![0.0; 12]));
        let mut direct = vec![r + 1.0; 10];
        c.all_reduce(BufMut::F32(&mut direct), ReduceOp::Max)?;
        let rs = w.reduce_scatter(
            OwnedBuf::F32((0..8).map(|i| i as f32 * (r + 1.0)).collect()),
            OwnedBuf::F32(vec![0.0; 2]),
            ReduceOp::Avg,
        );
        let bc = w.broadcast(OwnedBuf::F32(vec![r; 5]), 3);
        w.barrier().wait()?;
        Ok((a.wait()?, b.wait()?.1, rs.wait()?.1, bc.wait()?, direct))
    })
    .unwrap();
    for (rank, (a, b, rs, bc, direct)) in out.into_iter().enumerate() {
        assert_eq!(a, OwnedBuf::F32(vec![6.0; 1000]));
        let gathered: Vec<f32> = (0..4).flat_map(|k| [k as f32; 3]).collect();
        assert_eq!(b, OwnedBuf::F32(gathered));
        // Element i of the sum over ranks of i*(r+1) is 10*i; divided by 4.
        let i = (2 * rank) as f32;
        assert_eq!(
            rs,
            OwnedBuf::F32(vec![10.0 * i / 4.0, 10.0 * (i + 1.0) / 4.0])
        );
        assert_eq!(bc, OwnedBuf::F32(vec![3.0; 5]));
        assert_eq!(direct, vec![4.0; 10]);
    }
}

#[test]
fn worker_errors_propagate_to_wait() {
    // The mismatch is found as soon as both ranks arrive; a long timeout keeps a loaded
    // machine from turning it into a timeout instead.
    let e = run_ranks(2, TIMEOUT, |c: Box<dyn Communicator>| {
        let w = CommWorker::duplicate_of(&*c)?;
        let len = 4 + c.rank();
        w.all_reduce(OwnedBuf::F32(vec![1.0; len]), ReduceOp::Sum)
            .wait()
            .map(|_| ())
    })
    .expect_err("lengths differ");
    assert!(
        matches!(
            e,
            Error::Comm {
                op: "all_reduce",
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("mismatched"), "{e}");
}

#[test]
fn split_forms_groups_by_color_ordered_by_key() {
    let out = run_ranks(6, TIMEOUT, |c: Box<dyn Communicator>| {
        let r = c.rank();
        // Colors 0 (ranks 0, 2, 4) and 1 (1, 3, 5); keys reverse the order inside a group.
        let sub = c.split(r % 2, 100 - r)?;
        let mut v = vec![r as f32];
        sub.all_reduce(BufMut::F32(&mut v), ReduceOp::Sum)?;
        let mut g = vec![0.0f32; sub.world_size()];
        sub.all_gather(BufRef::F32(&[r as f32]), BufMut::F32(&mut g))?;
        // The parent group still works after the split.
        c.barrier()?;
        Ok((sub.rank(), sub.world_size(), v[0], g))
    })
    .unwrap();
    let want = [
        (2, 3, 6.0, vec![4.0, 2.0, 0.0]),
        (2, 3, 9.0, vec![5.0, 3.0, 1.0]),
        (1, 3, 6.0, vec![4.0, 2.0, 0.0]),
        (1, 3, 9.0, vec![5.0, 3.0, 1.0]),
        (0, 3, 6.0, vec![4.0, 2.0, 0.0]),
        (0, 3, 9.0, vec![5.0, 3.0, 1.0]),
    ];
    assert_eq!(out, want);
}

#[test]
fn a_dead_rank_fails_its_subgroup_too() {
    let e = run_ranks(4, Duration::from_secs(20), |c: Box<dyn Communicator>| {
        let sub = c.split(c.rank() / 2, 0)?;
        if c.rank() == 3 {
            panic!("rank 3 dies");
        }
        sub.barrier()
    })
    .expect_err("rank 3 died");
    assert!(
        e.to_string()
            .contains("job aborted: rank 3 failed: panicked: rank 3 dies"),
        "{e}"
    );
}
