//! LAMB's step over the engine's flat buffers: a trust ratio per parameter tensor, when
//! tensors are runs of a group's flat buffer and each rank may own only a shard of it.
//!
//! The formula is `ferrozero_offload::optim`'s (DeepSpeed's `FusedLamb`, written out on its
//! `lamb` module). The engine's part is where the per-tensor norms come from:
//!
//! - A group's padded buffer is cut into runs: each parameter slot intersected with each
//!   shard of the group's layout (`GroupLayout::shard_range(r)`, `r` over the layout's
//!   ranks). A run's partial sums of squares (of the weights and of the update direction)
//!   depend only on its elements, in the order the offload kernel fixes by its length.
//! - Pass 1 updates the moments over the owned range run by run and keeps each run's
//!   partials in a table `[slot][shard]`. A rank that owns every shard (stage 0, or one rank)
//!   fills the whole table itself; at stages 1-3 each rank fills its shard's column and the
//!   shard group all-gathers the columns (each f64 carried bit for bit as four 16-bit words,
//!   each an f32 integer: exact on every transport, and no word is ever a NaN pattern).
//! - A tensor's sums are its row added in shard order from 0.0, so the same f64 additions in
//!   the same order at every stage: the trust ratios, and so the parameters, are bitwise
//!   equal across stages 0-3 at one world size (`runtime/tests/engine_lamb.rs`).
//! - Pass 2 recomputes each element's direction from the moments and applies the update with
//!   its tensor's ratio, writing the low-precision copy in the same pass.
//!
//! Both passes run where the optimizer state lives ([`Placement`]): in place on the compute
//! device (the CPU, or a GPU's kernels with the CPU's bits; a device without LAMB kernels is
//! refused by [`check`]), or on the host
//! for offloaded state, reading what `offload_copies::fetch` brings down (the parameters when
//! they are their own master weights) and, in pass 2, uploading the updated device values on
//! the copy stream as the element-wise host step does (`device_lamb.rs`: stages 0-3 bitwise
//! on the emulated GPU too).
//!
//! The padding after the last slot belongs to no tensor: its moments stay zero (its
//! gradients are zero) and pass 2 leaves it untouched. `sub_group_size` does not tile these
//! passes (a run is one kernel call; the kernels split it across threads themselves).

use std::ops::Range;

use ferrozero_config::resolved::{OffloadTarget, OptimizerConfig, ResolvedConfig};
use ferrozero_offload::optim::{lamb_coeff, LambHyper};

use super::group::{empty_storage, Group};
use super::offload_copies::{host_read, host_step_with, HostState, Inbound, Landing, UploadWindow};
use super::partition::GroupLayout;
use crate::backend::{Backend, GradView};
use crate::comm::{BufMut, BufRef, Communicator};
use crate::tensor::{DType, Storage, View, ViewMut};
use crate::{Error, Result};

/// Refuses, when the optimizer is LAMB, what its step does not support, each naming the key
/// to change: `be` (the compute device) must run LAMB's passes when the optimizer state
/// stays on it (a device without them must offload the state to the host), and parameters
/// or state on NVMe and bf16 optimizer values are refused.
pub fn check(cfg: &ResolvedConfig, be: &dyn Backend) -> Result<()> {
    if !matches!(cfg.optimizer, OptimizerConfig::Lamb { .. }) {
        return Ok(());
    }
    let refuse = |what: &str| Err(Error::Config(format!("optimizer.type = \"Lamb\" {what}")));
    if let OffloadTarget::Nvme(_) = cfg.zero.offload_optimizer.target {
        return refuse(
            "does not run with the optimizer state on NVMe: set \
             zero_optimization.offload_optimizer.device = \"cpu\" (or use Adam/AdamW)",
        );
    }
    if let OffloadTarget::Nvme(_) = cfg.zero.offload_param.target {
        return refuse(
            "does not run with parameter shards on NVMe (offload_param.device = \"nvme\"): \
             both of its passes need the shard in memory; use offload_param.device = \"cpu\"",
        );
    }
    if cfg.bf16_state.master_weights_and_grads || cfg.bf16_state.optimizer_states {
        return refuse(
            "keeps f32 master weights and moments: turn off bf16.bf16_master_weights_and_grads \
             and bf16.bf16_optimizer_states",
        );
    }
    // With the state on the compute device, the device runs LAMB's passes only if its
    // optimizer kernels have them: probed on empty views (a device without them refuses
    // before it looks at the views). Offloaded state is the host's, which has them.
    let in_place = cfg.zero.offload_optimizer.target == OffloadTarget::None;
    let probed = match in_place {
        true => probe(be),
        false => probe(be.host_backend()),
    };
    if let Err(e) = probed.map_err(|e| (in_place, e)) {
        return match e {
            (true, e) => refuse(&format!(
                "runs where the optimizer state is in host memory, not on this device ({e}): \
                 set zero_optimization.offload_optimizer.device = \"cpu\""
            )),
            (false, e) => refuse(&format!("cannot run its host step: {e}")),
        };
    }
    Ok(())
}

/// Both passes over no elements on `be`.
fn probe(be: &dyn Backend) -> Result<()> {
    let hp = LambHyper {
        lr: 0.0,
        beta1: 0.0,
        beta2: 0.0,
        eps: 1.0,
        eps_inside_sqrt: false,
        weight_decay: 0.0,
        max_coeff: 1.0,
        min_coeff: 1.0,
        bias_correction: false,
    };
    let (p, g) = (empty_storage(DType::F32), empty_storage(DType::F32));
    let (mut m, mut v) = (empty_storage(DType::F32), empty_storage(DType::F32));
    let pg = (p.view(), GradView::exact(g.view()));
    be.lamb_moments(&hp, 1.0, pg, m.view_mut(), v.view_mut())?;
    let mut p = empty_storage(DType::F32);
    be.lamb_apply((&hp, 1, 1.0), p.view_mut(), (m.view(), v.view()), None)
}

/// One run: a slot's elements inside one shard of the layout, in padded coordinates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Run {
    /// The slot (parameter tensor) in the layout.
    pub slot: usize,
    /// The shard it lies in.
    pub shard: usize,
    /// Its padded element range.
    pub range: Range<usize>,
}

/// The runs of `layout` inside `owned`, slot-major then shard. `owned` must be a union of
/// whole shards (it is: the full buffer or one shard).
pub fn runs(layout: &GroupLayout, owned: &Range<usize>) -> Vec<Run> {
    let mut out = Vec::new();
    for (slot, s) in layout.slots.iter().enumerate() {
        for shard in 0..layout.world_size.max(1) {
            let sh = layout.shard_range(shard);
            let (a, b) = (s.offset.max(sh.start), (s.offset + s.numel).min(sh.end));
            if a < b && owned.start <= a && b <= owned.end {
                out.push(Run {
                    slot,
                    shard,
                    range: a..b,
                });
            }
        }
    }
    out
}

/// One group's partial sums: `[slot * shards + shard] = (w², u²)`.
#[derive(Debug, Clone)]
pub struct Partials {
    shards: usize,
    sums: Vec<(f64, f64)>,
}

impl Partials {
    fn new(layout: &GroupLayout) -> Self {
        let shards = layout.world_size.max(1);
        Self {
            shards,
            sums: vec![(0.0, 0.0); layout.slots.len() * shards],
        }
    }

    /// The trust ratio of every slot: its row added in shard order.
    fn coeffs(&self, hp: &LambHyper) -> Vec<f32> {
        self.sums
            .chunks(self.shards.max(1))
            .map(|row| {
                let (w, u) = row
                    .iter()
                    .fold((0.0f64, 0.0f64), |(a, b), &(w, u)| (a + w, b + u));
                lamb_coeff(hp, w, u)
            })
            .collect()
    }
}

/// Where a group's state lives for LAMB's passes: on the compute device, which runs them in
/// place, or offloaded to host memory, where the host runs them on what
/// `offload_copies` brings down and the updated device values go up on the copy stream.
pub enum Placement<'a> {
    /// The state is on the compute device: its backend runs the passes on the group's views.
    InPlace(&'a dyn Backend),
    /// The state is in host memory: the host runs the passes; device values move on the
    /// compute device's copy streams, uploads held in the window.
    Offloaded(&'a dyn Backend, &'a UploadWindow),
}

/// Pass 1 over one group: the moments of the owned range updated, the owned runs' partial
/// sums recorded.
pub fn moments(
    g: &mut Group,
    (hp, grad_scale): (&LambHyper, f32),
    at: &Placement<'_>,
) -> Result<Partials> {
    let mut partials = Partials::new(&g.layout);
    let runs = runs(&g.layout, &g.owned);
    let start = g.owned.start;
    let mut pass = |p: View<'_>, grads: GradView<'_>, m: &mut Storage, v: &mut Storage, exec| {
        for r in &runs {
            let local = r.range.start - start..r.range.end - start;
            let s = (exec as &dyn Backend).lamb_moments(
                hp,
                grad_scale,
                (p.range(local.clone())?, grads.range(local.clone())?),
                m.range_mut(local.clone())?,
                v.range_mut(local)?,
            )?;
            partials.sums[r.slot * partials.shards + r.shard] = s;
        }
        Ok(())
    };
    match at {
        Placement::InPlace(be) => {
            let s = g.owned_state()?;
            let gv = s.grad.range(s.owned.clone())?;
            pass(s.params.0.as_view(), gv, s.m, s.v, *be)?;
        }
        Placement::Offloaded(be, _) => {
            host_read(g, *be, |p, gv, m, v| pass(p, gv, m, v, be.host_backend()))?;
        }
    }
    Ok(partials)
}

/// Pass 2 over one group: every owned run updated with its tensor's trust ratio, the
/// stored low-precision copy written in the same pass (in staging memory and uploaded when
/// it lives on the device; the upload waits in the group's `landing`).
pub fn apply(
    g: &mut Group,
    (hp, step): (&LambHyper, u64),
    partials: &Partials,
    at: &Placement<'_>,
) -> Result<()> {
    let coeffs = partials.coeffs(hp);
    let runs = runs(&g.layout, &g.owned);
    let start = g.owned.start;
    let pass = |mut p: ViewMut<'_>, m: &Storage, v: &Storage, mut lp: Option<ViewMut<'_>>, exec| {
        for r in &runs {
            let local = r.range.start - start..r.range.end - start;
            let lp_r = match &mut lp {
                Some(b) => Some(b.reborrow().range(local.clone())?),
                None => None,
            };
            (exec as &dyn Backend).lamb_apply(
                (hp, step, coeffs[r.slot]),
                p.reborrow().range(local.clone())?,
                (m.range(local.clone())?, v.range(local)?),
                lp_r,
            )?;
        }
        Ok(())
    };
    match at {
        Placement::InPlace(be) => {
            let s = g.owned_state()?;
            let (p, lp) = s.params;
            let lp = match lp {
                Some((b, off)) => Some(b.range_mut(off..off + s.owned.len())?),
                None => None,
            };
            pass(p, s.m, s.v, lp, *be)
        }
        Placement::Offloaded(be, window) => {
            g.landing = Landing::default();
            let host = be.host_backend();
            let update =
                |p: ViewMut<'_>, _: GradView<'_>, h: HostState<'_>| pass(p, h.m, h.v, h.lp, host);
            g.landing = host_step_with(g, (Inbound::default(), window), *be, update)?;
            Ok(())
        }
    }
}

/// Completes every group's table across the shard group `comm` when each rank owns one
/// shard (`sharded`); a rank that owns every shard has them all already. The gathered
/// columns are exact copies of each rank's f64 partials.
pub fn combine(tables: &mut [Partials], sharded: bool, comm: &dyn Communicator) -> Result<()> {
    if !sharded {
        return Ok(());
    }
    let (rank, world) = (comm.rank(), comm.world_size());
    if let Some(t) = tables.iter().find(|t| t.shards != world) {
        return Err(Error::Invalid(format!(
            "LAMB: a group is split over {} shards but the shard group has {world} ranks",
            t.shards
        )));
    }
    // This rank's column: every group's slots in order, each (w², u²) as eight 16-bit words.
    let mut mine = Vec::new();
    for t in tables.iter() {
        for row in t.sums.chunks(world) {
            let (w, u) = row[rank];
            mine.extend(split_bits(w));
            mine.extend(split_bits(u));
        }
    }
    let mut all = vec![0.0f32; mine.len() * world];
    comm.all_gather(BufRef::F32(&mine), BufMut::F32(&mut all))?;
    for (r, col) in all.chunks(mine.len().max(1)).enumerate().take(world) {
        let mut at = col.chunks_exact(2 * WORDS);
        for t in tables.iter_mut() {
            for row in t.sums.chunks_mut(world) {
                let q = at.next().ok_or_else(|| {
                    Error::Invalid("LAMB: the gathered partial sums came up short".into())
                })?;
                row[r] = (join_bits(&q[..WORDS])?, join_bits(&q[WORDS..])?);
            }
        }
    }
    Ok(())
}

/// f32 words an f64 travels as.
const WORDS: usize = 4;

/// An f64's bits as four 16-bit words, most significant first, each an exact f32 integer.
fn split_bits(x: f64) -> [f32; WORDS] {
    let b = x.to_bits();
    std::array::from_fn(|i| ((b >> (48 - 16 * i)) & 0xffff) as f32)
}

/// The f64 [`split_bits`] made.
fn join_bits(w: &[f32]) -> Result<f64> {
    let mut b = 0u64;
    for &x in w {
        if !(0.0..65536.0).contains(&x) || x.fract() != 0.0 {
            return Err(Error::Invalid(format!(
                "LAMB: a gathered word of a partial sum is {x}, not a 16-bit integer"
            )));
        }
        b = (b << 16) | x as u64;
    }
    Ok(f64::from_bits(b))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::{Init, ParamSpec};

    fn spec(name: &str, n: usize) -> ParamSpec {
        ParamSpec {
            name: name.into(),
            shape: vec![n],
            init: Init::Zeros,
        }
    }

    #[test]
    fn runs_cut_slots_at_shard_boundaries() {
        // Slots of 20 and 30 elements over 2 ranks: shards of 32.
        let l = GroupLayout::new(&[spec("a", 20), spec("b", 30)], 2);
        let all = runs(&l, &(0..l.padded()));
        let got: Vec<_> = all
            .iter()
            .map(|r| (r.slot, r.shard, r.range.clone()))
            .collect();
        assert_eq!(got, vec![(0, 0, 0..20), (1, 0, 20..32), (1, 1, 32..50)]);
        let second = runs(&l, &l.shard_range(1));
        assert_eq!(second, vec![all[2].clone()]);
    }

    #[test]
    fn f64_bits_survive_the_f32_carrier() {
        for x in [0.0, 1.0, 3.5e-300, 1e300, f64::MIN_POSITIVE, 0.1 + 0.2] {
            assert_eq!(join_bits(&split_bits(x)).unwrap().to_bits(), x.to_bits());
        }
    }
}
