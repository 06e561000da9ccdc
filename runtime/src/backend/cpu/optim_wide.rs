//! The host optimizer step over bf16 optimizer values (`bf16.bf16_master_weights_and_grads`:
//! the bf16 parameters are the master weights; `bf16.bf16_optimizer_states`: bf16 moments).
//! Each run of elements is widened to f32, stepped by the same f32 kernels as f32 state, and
//! written back rounded to nearest even: the parameters as the kernel's rounded copy, the
//! moments afterwards. That is how DeepSpeed's CPU Adam treats bf16 parameters and moments,
//! and it keeps the kernels' invariant: each element is computed alike wherever it falls.

use std::ops::Range;

use ferrozero_offload::optim::{self, LowPrecision};
use half::bf16;

use crate::backend::UpdateRule;
use crate::tensor::{BufMut, ViewMut};
use crate::{Error, Result};

const OP: &str = "optimizer step";

/// Elements per widened run: the f32 copies of one run stay in the cache between the
/// widening, the kernel and the narrowing.
const CHUNK: usize = 1 << 16;

/// Optimizer values in host memory, f32 or bf16.
enum Vals<'a> {
    F32(&'a mut [f32]),
    Bf16(&'a mut [bf16]),
}

impl<'a> Vals<'a> {
    fn of(what: &str, v: ViewMut<'a>) -> Result<Self> {
        match v {
            ViewMut::Host(BufMut::F32(s)) => Ok(Vals::F32(s)),
            ViewMut::Host(BufMut::Bf16(s)) => Ok(Vals::Bf16(s)),
            other => Err(Error::Invalid(format!(
                "{OP}: the {what} are {:?}{}; the host step takes f32 or bf16 host memory",
                other.dtype(),
                if matches!(other, ViewMut::Cuda(_)) {
                    " in device memory"
                } else {
                    ""
                }
            ))),
        }
    }

    fn len(&self) -> usize {
        match self {
            Vals::F32(s) => s.len(),
            Vals::Bf16(s) => s.len(),
        }
    }

    /// `r` as f32 in `dst`.
    fn widen(&self, r: Range<usize>, dst: &mut Vec<f32>) {
        dst.clear();
        match self {
            Vals::F32(s) => dst.extend_from_slice(&s[r]),
            Vals::Bf16(s) => dst.extend(s[r].iter().map(|x| x.to_f32())),
        }
    }

    /// `src` written into `r`, rounded to nearest even when bf16.
    fn narrow(&mut self, r: Range<usize>, src: &[f32]) {
        match self {
            Vals::F32(s) => s[r].copy_from_slice(src),
            Vals::Bf16(s) => {
                for (d, &x) in s[r].iter_mut().zip(src) {
                    *d = bf16::from_f32(x);
                }
            }
        }
    }
}

/// One step over values of which some are bf16; `grads` already f32. No separate rounded
/// copy exists: bf16 parameters are their own.
#[allow(clippy::too_many_arguments)]
pub(super) fn update(
    rule: &UpdateRule,
    step: u64,
    grad_scale: f32,
    params: ViewMut<'_>,
    grads: &[f32],
    m: ViewMut<'_>,
    v: ViewMut<'_>,
    lp: Option<ViewMut<'_>>,
) -> Result<()> {
    if lp.is_some() {
        return Err(Error::Invalid(format!(
            "{OP}: bf16 optimizer values with a separate rounded parameter copy; with \
             bf16 master weights the parameters are updated in place"
        )));
    }
    let mut p = Vals::of("parameters", params)?;
    let mut m = Vals::of("first moments", m)?;
    let mut v = Vals::of("second moments", v)?;
    let n = p.len();
    if grads.len() != n || m.len() != n || (v.len() != n && v.len() != 0) {
        return Err(Error::Shape {
            op: OP,
            expected: format!("gradients, moments of {n} elements"),
            got: format!("{}, {}, {}", grads.len(), m.len(), v.len()),
        });
    }
    let (mut pf, mut mf, mut vf) = (Vec::new(), Vec::new(), Vec::new());
    for start in (0..n).step_by(CHUNK) {
        let r = start..(start + CHUNK).min(n);
        let vr = if v.len() == 0 { 0..0 } else { r.clone() };
        p.widen(r.clone(), &mut pf);
        m.widen(r.clone(), &mut mf);
        v.widen(vr.clone(), &mut vf);
        let g = &grads[r.clone()];
        let lp_out = match &mut p {
            Vals::Bf16(s) => LowPrecision::Bf16(&mut s[r.clone()]),
            Vals::F32(_) => LowPrecision::None,
        };
        match rule {
            UpdateRule::Adam(hp) => {
                optim::adam_step(hp, step, grad_scale, &mut pf, g, &mut mf, &mut vf, lp_out)
            }
            UpdateRule::Sgd(hp) => {
                optim::sgd_step(hp, step, grad_scale, &mut pf, g, &mut mf, lp_out)
            }
            UpdateRule::Lion(hp) => optim::lion_step(hp, grad_scale, &mut pf, g, &mut mf, lp_out),
        }?;
        if let Vals::F32(s) = &mut p {
            s[r.clone()].copy_from_slice(&pf);
        }
        m.narrow(r, &mf);
        v.narrow(vr, &vf);
    }
    Ok(())
}
