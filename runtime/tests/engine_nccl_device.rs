//! The engine over the NCCL communicator (the fake library) with its buffers on emulated
//! devices, one per rank: a GPT-2 trains bit for bit as over the local communicator at two
//! ranks (where NCCL's order and rank order add the same two terms), at stages 0 and 3, and
//! no step fences a device for a collective: the host's only waits are copies (the step's
//! status download, and the fake's data movement that NCCL's kernels do on a GPU).
#![cfg(feature = "cuda")]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::tiny::{self, VOCAB};
use common::{config, toy};
use ferrozero_config::resolved::{
    CommBackend, CommReduction, Precision, ResolvedConfig, ZeroStage,
};
use ferrozero_runtime::backend::cuda::driver::{StreamKind, TraceOp, Traced};
use ferrozero_runtime::backend::cuda::{self, CudaBackend};
use ferrozero_runtime::backend::Backend;
use ferrozero_runtime::comm::local::run_ranks;
use ferrozero_runtime::comm::nccl::fake::FakeNccl;
use ferrozero_runtime::comm::nccl::{NcclComm, NcclOptions};
use ferrozero_runtime::comm::store::{JobSecret, StoreServer, TcpStore};
use ferrozero_runtime::comm::Communicator;
use ferrozero_runtime::engine::Engine;

use ferrozero_runtime::tensor::DType;
use ferrozero_runtime::Result;

const WORLD: usize = 2;

/// Every step's loss bits and the final parameters' bits of one rank, and the last step's
/// trace on its device.
type Run = (Vec<u64>, Vec<Vec<u32>>, Vec<Traced>);

/// Three bf16 steps of two micro-batches on rank `rank`'s own emulated device.
fn train(cfg: &ResolvedConfig, comm: Box<dyn Communicator>) -> Result<Run> {
    let rank = comm.rank();
    let dev: Arc<CudaBackend> = cuda::emulated(DType::Bf16)?;
    let be: Arc<dyn Backend> = dev.clone();
    let mut e = Engine::with_backend(tiny::gpt2_model(2), cfg.clone(), comm, be)?;
    let mut losses = Vec::new();
    for s in 0..3 {
        let batches: Vec<_> = (0..2)
            .map(|m| toy::batch(VOCAB, 8, (s * 2 + m) * WORLD + rank, 1))
            .collect();
        if s == 2 {
            dev.device().observed().start_trace();
        }
        losses.push(e.train_batch(&batches)?.loss.to_bits());
    }
    let trace = dev.device().observed().take_trace();
    let params = e.parameters()?;
    let params = params
        .iter()
        .map(|t| t.data.iter().map(|x| x.to_bits()).collect())
        .collect();
    Ok((losses, params, trace))
}

fn over_nccl(cfg: &ResolvedConfig) -> Vec<Run> {
    let secret = JobSecret::new("the NCCL engine test's store secret").unwrap();
    let srv = StoreServer::bind("127.0.0.1:0".parse().unwrap(), secret.clone()).unwrap();
    let (addr, lib) = (srv.addr(), FakeNccl::default());
    let mut cfg = cfg.clone();
    cfg.comms.backend = CommBackend::Nccl;
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..WORLD)
            .map(|r| {
                let (cfg, lib, secret) = (&cfg, &lib, &secret);
                s.spawn(move || {
                    let store = TcpStore::connect(addr, Duration::from_secs(10), secret)?;
                    let opts = NcclOptions {
                        timeout: Duration::from_secs(60),
                        deterministic: false,
                    };
                    let c = NcclComm::init(lib, Arc::new(store), "job", (r, WORLD), opts)?;
                    train(cfg, Box::new(c))
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap().expect("training over NCCL"))
            .collect()
    })
}

#[test]
fn the_engine_trains_over_nccl_on_devices_as_over_local_without_fencing_them() {
    let emulator = cuda::emulated(DType::Bf16);
    if let Err(e) = emulator {
        cuda::emu::skip_unless_required(&format!("no emulated device: {e}"));
        return;
    }
    for stage in [ZeroStage::Stage0, ZeroStage::Stage3] {
        let mut cfg = config(stage, WORLD, 1, 2, Precision::Bf16);
        // NCCL's own order: at two ranks it adds the same two terms as rank order.
        cfg.comms.reduction = CommReduction::Native;
        let local = run_ranks(WORLD, Duration::from_secs(300), |c| train(&cfg, c)).unwrap();
        let nccl = over_nccl(&cfg);
        for (r, (l, n)) in local.iter().zip(&nccl).enumerate() {
            assert_eq!(l.0, n.0, "stage {stage:?} rank {r}: losses");
            assert_eq!(l.1, n.1, "stage {stage:?} rank {r}: parameters");
            let trace = &n.2;
            let fences = trace
                .iter()
                .filter(|(_, op)| matches!(op, TraceOp::Synchronize | TraceOp::HostWaitEvent(_)))
                .count();
            assert_eq!(fences, 0, "stage {stage:?} rank {r}: {trace:?}");
            let waits = trace
                .iter()
                .filter(|(_, op)| matches!(op, TraceOp::Wait(_)))
                .count();
            assert!(waits > 0, "stage {stage:?} rank {r}: no event waits");
            let ends = trace
                .iter()
                .filter(|(s, op)| {
                    *s == Some(StreamKind::Collective) && matches!(op, TraceOp::Record(_))
                })
                .count();
            println!("stage {stage:?} rank {r}: {ends} device collectives in the step, no fence");
        }
    }
}
