//! ZeRO++ hpZ (`zero_hpz_partition_size`, DeepSpeed's meaning): 4 local ranks as 2 groups of
//! 2 keep optimizer state and gradients over all 4 ranks (the bytes of plain stage 3 at world
//! 4), hold a secondary copy of half the parameters more, train bit for bit like plain stage 3
//! (forward gathers the same values over the world, backward the same values inside the
//! group), report only forward's gathers as crossing groups, and the estimator agrees. Under
//! `train_batch` the loss head runs its backward inside forward, so no secondary copy of its
//! parameters is cut.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::runs::{train, D, LAYERS, T, V};
use common::{config, toy};
use ferrozero_config::resolved::{Precision, ResolvedConfig, ZeroStage};
use ferrozero_runtime::comm::local::run_ranks;
use ferrozero_runtime::comm::{BufMut, BufRef, CommBackend, Communicator, ReduceOp};
use ferrozero_runtime::engine::estimate::estimate;
use ferrozero_runtime::engine::ledger::{Category, Location};
use ferrozero_runtime::engine::partition::GroupLayout;
use ferrozero_runtime::engine::{Engine, NamedTensor};
use ferrozero_runtime::nn::llama;
use ferrozero_runtime::tensor::{View, ViewMut};

fn hpz(world: usize, group: usize, overlap: bool, ckpt: bool) -> ResolvedConfig {
    let mut cfg = config(ZeroStage::Stage3, world, 2, 2, Precision::F32);
    cfg.zero.hpz_partition_size = group;
    cfg.zero.overlap_comm = overlap;
    // Nothing stays gathered from forward to backward: backward gathers every unit again.
    cfg.zero.max_reuse_distance = 0;
    if ckpt {
        cfg.activation_checkpointing = Some(common::checkpointing(false));
    }
    cfg
}

/// Padded parameter elements of every group at world size 4.
fn padded_elems() -> usize {
    let model = toy::model(V, D, T, LAYERS);
    let mut specs: Vec<_> = model.units.iter().map(|u| u.module.param_specs()).collect();
    specs.push(model.shared.clone());
    specs
        .iter()
        .filter(|s| !s.is_empty())
        .map(|s| GroupLayout::new(s, 4).padded())
        .sum()
}

#[test]
fn hpz_trains_like_plain_stage3_with_the_same_optimizer_bytes() {
    for (overlap, ckpt) in [(false, false), (true, false), (false, true)] {
        let plain = train(&hpz(4, 1, overlap, ckpt));
        let h = train(&hpz(4, 2, overlap, ckpt));
        let at = format!("overlap {overlap}, checkpointing {ckpt}");
        assert_eq!(plain.losses, h.losses, "{at}");
        for (x, y) in plain.params.iter().zip(&h.params) {
            assert_eq!(x.data, y.data, "{at}: {}", x.name);
        }
        assert_eq!(h.optim_bytes, plain.optim_bytes, "{at}");
        // Every rank's forward gathers cross groups at every step; plain stage 3 has none.
        assert!(h.cross.iter().flatten().all(|&b| b > 0), "{at}");
        assert!(plain.cross.iter().flatten().all(|&b| b == 0), "{at}");
        // The secondary partition: half of every group's padded f32 parameters.
        let secondary = (padded_elems() / 2 * 4) as u64;
        assert_eq!(h.param_bytes, plain.param_bytes + secondary, "{at}");
    }
}

/// Llama "tiny" (a loss head with parameters: the final norm and an untied `lm_head`) trained
/// three steps on 4 ranks under `cfg`, through `train_batch` (`fused`) or the manual
/// `forward`/`backward`/`step`: rank 0's parameters, device parameter bytes and device peak.
fn llama_run(cfg: &ResolvedConfig, fused: bool) -> (Vec<NamedTensor>, u64, u64) {
    let model = || llama::build(&llama::LlamaConfig::preset("tiny").unwrap()).unwrap();
    let mut out = run_ranks(4, Duration::from_secs(120), |comm| {
        let rank = comm.rank();
        let mut e = Engine::new(model(), cfg.clone(), comm)?;
        let (micro, gas) = (
            cfg.train_micro_batch_size_per_gpu,
            cfg.gradient_accumulation_steps,
        );
        for s in 0..3 {
            let batches: Vec<_> = (0..gas)
                .map(|m| toy::batch(64, T, ((s * gas + m) * 4 + rank) * micro, micro))
                .collect();
            if fused {
                e.train_batch(&batches)?;
            } else {
                for b in &batches {
                    e.forward(b)?;
                    e.backward()?;
                }
                e.step()?;
            }
        }
        let bytes = e.ledger().current(Location::Device, Category::Parameters);
        let peak = e.ledger().peak_total(Location::Device);
        Ok((e.parameters()?, bytes, peak))
    })
    .expect("training failed");
    out.swap_remove(0)
}

#[test]
fn the_fused_head_gets_no_secondary_partition_and_the_bits_stay() {
    let mut bytes = Vec::new();
    // The manual API scales each micro-batch by its own tokens, `train_batch` by the batch's:
    // each is compared with plain stage 3 through the same API.
    for (fused, what) in [(true, "train_batch"), (false, "forward/backward")] {
        let (plain, _, _) = llama_run(&hpz(4, 1, false, false), fused);
        let cfg = hpz(4, 2, false, false);
        let (h, h_bytes, h_peak) = llama_run(&cfg, fused);
        for (x, y) in plain.iter().zip(&h) {
            assert!(x.data == y.data, "hpZ through {what}: {} differs", x.name);
        }
        bytes.push(h_bytes);
        if fused {
            // The estimator runs `train_batch`: it keeps no secondary copy of the head either.
            let model = llama::build(&llama::LlamaConfig::preset("tiny").unwrap()).unwrap();
            let est = estimate(&model, &cfg, cfg.train_micro_batch_size_per_gpu, T).unwrap();
            assert_eq!(
                est.device.peak_bytes, h_peak,
                "estimated against the ledger's peak"
            );
        }
    }
    // The manual API's backward gathers the head from its secondary copy, so it is cut there:
    // half of the head group's padded f32 parameters more than under `train_batch`.
    let model = llama::build(&llama::LlamaConfig::preset("tiny").unwrap()).unwrap();
    let head = model.units.last().unwrap().module.param_specs();
    assert!(
        !head.is_empty(),
        "the head must have parameters for this test to mean anything"
    );
    let head_secondary = (GroupLayout::new(&head, 4).padded() / 2 * 4) as u64;
    assert_eq!(bytes[1], bytes[0] + head_secondary);
}

#[test]
fn a_group_size_that_does_not_divide_the_world_is_refused() {
    for (group, words) in [
        (3, "divide the world size 4"),
        (8, "larger than the world size 4"),
    ] {
        let err = run_ranks(4, Duration::from_secs(10), |comm| {
            Engine::new(
                toy::model(V, D, T, LAYERS),
                hpz(4, group, false, false),
                comm,
            )
            .map(|_| ())
        })
        .unwrap_err()
        .to_string();
        assert!(
            err.contains(&format!(
                "zero_optimization.zero_hpz_partition_size = {group}"
            )),
            "{err}"
        );
        assert!(err.contains(words), "{err}");
    }
}

#[test]
fn below_stage3_hpz_changes_nothing() {
    let mut a = hpz(4, 1, false, false);
    a.zero.stage = ZeroStage::Stage2;
    let mut b = a.clone();
    b.zero.hpz_partition_size = 2;
    let (x, y) = (train(&a), train(&b));
    assert_eq!(x.losses, y.losses);
    assert_eq!(x.param_bytes, y.param_bytes);
}

/// Elements all-gathered by the world communicator (and its duplicates) and by the groups
/// split from it.
#[derive(Default)]
struct Gathered {
    world: AtomicU64,
    group: AtomicU64,
}

/// A communicator that counts the elements its all-gathers produce, by level.
struct Counting {
    inner: Box<dyn Communicator>,
    counts: Arc<Gathered>,
    split: bool,
}

impl Counting {
    fn count(&self, n: usize) {
        let c = if self.split {
            &self.counts.group
        } else {
            &self.counts.world
        };
        c.fetch_add(n as u64, Ordering::Relaxed);
    }
}

impl Communicator for Counting {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn backend(&self) -> CommBackend {
        self.inner.backend()
    }
    fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> ferrozero_runtime::Result<()> {
        self.inner.all_reduce(buf, op)
    }
    fn reduce_scatter(
        &self,
        input: BufRef<'_>,
        output: BufMut<'_>,
        op: ReduceOp,
    ) -> ferrozero_runtime::Result<()> {
        self.inner.reduce_scatter(input, output, op)
    }
    fn all_gather(&self, input: BufRef<'_>, output: BufMut<'_>) -> ferrozero_runtime::Result<()> {
        self.count(output.len());
        self.inner.all_gather(input, output)
    }
    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> ferrozero_runtime::Result<()> {
        self.inner.broadcast(buf, root)
    }
    fn barrier(&self) -> ferrozero_runtime::Result<()> {
        self.inner.barrier()
    }
    fn all_reduce_view(&self, buf: ViewMut<'_>, op: ReduceOp) -> ferrozero_runtime::Result<()> {
        self.inner.all_reduce_view(buf, op)
    }
    fn reduce_scatter_view(
        &self,
        input: View<'_>,
        output: ViewMut<'_>,
        op: ReduceOp,
    ) -> ferrozero_runtime::Result<()> {
        self.inner.reduce_scatter_view(input, output, op)
    }
    fn all_gather_view(
        &self,
        input: View<'_>,
        output: ViewMut<'_>,
    ) -> ferrozero_runtime::Result<()> {
        self.count(output.len());
        self.inner.all_gather_view(input, output)
    }
    fn duplicate(&self) -> ferrozero_runtime::Result<Box<dyn Communicator>> {
        Ok(Box::new(Counting {
            inner: self.inner.duplicate()?,
            counts: Arc::clone(&self.counts),
            split: self.split,
        }))
    }
    fn split(&self, color: usize, key: usize) -> ferrozero_runtime::Result<Box<dyn Communicator>> {
        Ok(Box::new(Counting {
            inner: self.inner.split(color, key)?,
            counts: Arc::clone(&self.counts),
            split: true,
        }))
    }
}

/// Rank 0's gathered elements (world, group) over one training step of 2 micro-steps, and
/// the step's cross-group bytes.
fn gathered(cfg: &ResolvedConfig) -> (u64, u64, u64) {
    let world = cfg.world_size;
    let out = run_ranks(world, Duration::from_secs(60), |comm| {
        let rank = comm.rank();
        let counts = Arc::new(Gathered::default());
        let comm = Box::new(Counting {
            inner: comm,
            counts: Arc::clone(&counts),
            split: false,
        });
        let mut e = Engine::new(toy::model(V, D, T, LAYERS), cfg.clone(), comm)?;
        let batches: Vec<_> = (0..2)
            .map(|m| toy::batch(V, T, (m * world + rank) * 2, 2))
            .collect();
        let (w0, g0) = (
            counts.world.load(Ordering::Relaxed),
            counts.group.load(Ordering::Relaxed),
        );
        let r = e.train_batch(&batches)?;
        Ok((
            counts.world.load(Ordering::Relaxed) - w0,
            counts.group.load(Ordering::Relaxed) - g0,
            r.cross_group_bytes,
        ))
    })
    .expect("training failed");
    out[0]
}

#[test]
fn backward_gathers_inside_the_group_and_only_forward_crosses_groups() {
    for overlap in [false, true] {
        let (plain_world, plain_group, plain_cross) = gathered(&hpz(4, 1, overlap, false));
        let (world, group, cross) = gathered(&hpz(4, 2, overlap, false));
        let at = format!("overlap {overlap}");
        // Plain stage 3 gathers over the world in forward and in backward; hpZ moves
        // backward's gathers (the same elements) into the group and keeps forward's.
        assert_eq!((plain_group, plain_cross), (0, 0), "{at}");
        assert!(group > 0 && world > 0, "{at}: {world} {group}");
        assert!(world < plain_world, "{at}: {world} vs {plain_world}");
        assert_eq!(world + group, plain_world, "{at}");
        // Cross-group bytes: half of every world gather's f32 elements (the other group's
        // two ranks of four); backward adds none.
        assert_eq!(cross, world * 4 / 2, "{at}");
    }
}
