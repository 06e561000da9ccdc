//! Gradient checking for any [`Module`]: the analytic backward against central finite
//! differences of the scalar objective `Σ out_i · r_i` (r a fixed random projection, or 1
//! for a one-element loss output), accumulated in f64.
//!
//! Users run it on their own modules:
//! ```text
//! let report = gradcheck::check(&my_block, &batch, &mut params, &input, &Options::default())?;
//! assert!(report.passed(), "{report}");
//! ```
//! [`check_on`] runs the same check on any backend (parameters and input live on the host and
//! are copied to the device for every evaluation), e.g. in f32 on a GPU.

use std::fmt;

use super::{Batch, BatchIds, Ctx, Grads, Module, Params, Saved};
use crate::backend::{rng, Backend};
use crate::tensor::{BufRef, DType, Storage, Tensor};
use crate::{Error, Result};

/// Settings of a check.
#[derive(Debug, Clone, PartialEq)]
pub struct Options {
    /// Finite-difference step (applied in f32, the exact step is used in the quotient).
    pub eps: f64,
    /// At most this many elements per tensor are probed (evenly spread); 0 means all.
    pub max_per_tensor: usize,
    /// An element fails when `|analytic - numeric| > atol + rtol · |numeric|`.
    pub atol: f64,
    /// See `atol`.
    pub rtol: f64,
    /// Seed for the projection and for `ctx.rng_seed`.
    pub seed: u64,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            eps: 1e-2,
            max_per_tensor: 64,
            atol: 1e-3,
            rtol: 1e-2,
            seed: 7,
        }
    }
}

/// The comparison for one parameter or for the input.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorReport {
    /// Parameter name, `shared[k]`, or `input`.
    pub name: String,
    /// Elements probed.
    pub checked: usize,
    /// Largest absolute difference.
    pub max_abs: f64,
    /// Largest difference relative to `max(|analytic|, |numeric|)`.
    pub max_rel: f64,
    /// Elements outside the tolerance.
    pub failures: usize,
}

/// The result of a check.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    /// Parameters in [`Params`] order, then `input` when the module takes one.
    pub tensors: Vec<TensorReport>,
}

impl Report {
    /// Whether every probed element is within tolerance.
    pub fn passed(&self) -> bool {
        self.tensors.iter().all(|t| t.failures == 0)
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for t in &self.tensors {
            writeln!(
                f,
                "{:<48} checked {:>5}  max abs {:.3e}  max rel {:.3e}  failures {}",
                t.name, t.checked, t.max_abs, t.max_rel, t.failures
            )?;
        }
        Ok(())
    }
}

struct Probe<'a> {
    be: &'a dyn Backend,
    module: &'a dyn Module,
    batch: &'a Batch,
    ids: &'a BatchIds,
    seed: u64,
    proj: Vec<f64>,
}

/// Host values copied to the backend's device.
fn upload_all(be: &dyn Backend, host: &[Vec<f32>]) -> Result<Vec<Storage>> {
    host.iter().map(|p| be.upload(BufRef::F32(p))).collect()
}

/// A host f32 tensor copied to the backend's device (the empty input of a first unit stays
/// the shapeless empty tensor it was).
fn upload_tensor(be: &dyn Backend, shape: &[usize], data: &[f32]) -> Result<Tensor> {
    let storage = be.upload(BufRef::F32(data))?;
    if data.is_empty() && shape.is_empty() {
        return Ok(Tensor {
            shape: vec![],
            storage,
        });
    }
    Tensor::new(shape.to_vec(), storage)
}

impl Probe<'_> {
    /// A training call's context over `saved`: every call of the check runs the same rows.
    fn ctx<'s>(&'s self, saved: &'s mut Saved) -> Ctx<'s> {
        Ctx::new(self.be, (self.batch, self.ids), true, (self.seed, 0), saved)
    }

    fn objective(&self, params: &[Vec<f32>], input: &Tensor) -> Result<f64> {
        let mut saved: Saved = None;
        let mut ctx = self.ctx(&mut saved);
        let stores = upload_all(self.be, params)?;
        let p = Params::new(stores.iter().map(Storage::view).collect());
        let out = self.module.forward(&mut ctx, &p, input)?.to_vec_f32()?;
        if out.len() != self.proj.len() {
            return Err(Error::Invalid(
                "gradcheck: output size changed between calls".into(),
            ));
        }
        Ok(out
            .iter()
            .zip(&self.proj)
            .map(|(&o, r)| f64::from(o) * r)
            .sum())
    }
}

fn probe_indices(n: usize, max: usize) -> Vec<usize> {
    if max == 0 || n <= max {
        return (0..n).collect();
    }
    (0..max).map(|i| i * n / max + (n / max) / 2).collect()
}

/// Runs the check on the CPU. `params` holds the module's parameters then its shared ones,
/// in [`Params`] order; they are perturbed during the check and restored afterwards.
pub fn check(
    module: &dyn Module,
    batch: &Batch,
    params: &mut [Vec<f32>],
    input: &Tensor,
    opts: &Options,
) -> Result<Report> {
    check_on(&*crate::backend::cpu(), module, batch, params, input, opts)
}

/// Runs the check with the module computing on `be`. The input may live anywhere; the
/// backend must compute in f32 for the finite differences to mean anything.
pub fn check_on(
    be: &dyn Backend,
    module: &dyn Module,
    batch: &Batch,
    params: &mut [Vec<f32>],
    input: &Tensor,
    opts: &Options,
) -> Result<Report> {
    if be.act_dtype() != DType::F32 {
        return Err(Error::Invalid(format!(
            "gradcheck needs f32 activations; {} computes in {:?}",
            be.name(),
            be.act_dtype()
        )));
    }
    let ids = BatchIds::new(be, batch)?;
    let x_host = input.to_vec_f32()?;
    let x_dev = upload_tensor(be, &input.shape, &x_host)?;
    let mut probe = Probe {
        be,
        module,
        batch,
        ids: &ids,
        seed: opts.seed,
        proj: Vec::new(),
    };
    let mut saved: Saved = None;
    let out = {
        let mut ctx = probe.ctx(&mut saved);
        let stores = upload_all(be, params)?;
        module.forward(
            &mut ctx,
            &Params::new(stores.iter().map(Storage::view).collect()),
            &x_dev,
        )?
    };
    let proj: Vec<f64> = if out.numel() == 1 {
        vec![1.0]
    } else {
        (0..out.numel())
            .map(|i| rng::normal(opts.seed ^ 0xA5A5, i as u64))
            .collect()
    };
    let r32: Vec<f32> = proj.iter().map(|&r| r as f32).collect();
    // A one-element (loss) output takes its gradient in host memory, as the engine passes it.
    let grad_out = if out.numel() == 1 {
        Tensor::from_f32(out.shape.clone(), r32)?
    } else {
        upload_tensor(be, &out.shape, &r32)?
    };
    let (grads, dx) = {
        let mut ctx = probe.ctx(&mut saved);
        let stores = upload_all(be, params)?;
        let p = Params::new(stores.iter().map(Storage::view).collect());
        let mut gstores = params
            .iter()
            .map(|p| be.zeros(DType::F32, p.len()))
            .collect::<Result<Vec<Storage>>>()?;
        let mut g = Grads::new(gstores.iter_mut().map(Storage::view_mut).collect());
        let dx = module.backward(&mut ctx, &p, &mut g, &grad_out)?;
        drop(g);
        let grads = gstores
            .iter()
            .map(Storage::to_vec_f32)
            .collect::<Result<Vec<Vec<f32>>>>()?;
        (grads, dx.to_vec_f32()?)
    };
    if input.numel() > 0 && dx.len() != input.numel() {
        return Err(Error::Shape {
            op: "gradcheck",
            expected: format!("an input gradient of {} elements", input.numel()),
            got: format!("{}", dx.len()),
        });
    }
    probe.proj = proj;
    let specs = module.param_specs();
    let mut reports = Vec::new();
    for i in 0..params.len() {
        let name = specs.get(i).map_or_else(
            || format!("shared[{}]", i - specs.len()),
            |s| s.name.clone(),
        );
        let mut rep = TensorReport {
            name,
            checked: 0,
            max_abs: 0.0,
            max_rel: 0.0,
            failures: 0,
        };
        for j in probe_indices(params[i].len(), opts.max_per_tensor) {
            let num = central(opts.eps, &mut |d| {
                let old = params[i][j];
                params[i][j] = old + d;
                let step = f64::from(params[i][j]) - f64::from(old);
                let l = probe.objective(params, &x_dev);
                params[i][j] = old;
                Ok((l?, step))
            })?;
            record(&mut rep, f64::from(grads[i][j]), num, opts);
        }
        reports.push(rep);
    }
    if input.numel() > 0 {
        let mut x = x_host;
        let mut rep = TensorReport {
            name: "input".into(),
            checked: 0,
            max_abs: 0.0,
            max_rel: 0.0,
            failures: 0,
        };
        for j in probe_indices(x.len(), opts.max_per_tensor) {
            let num = central(opts.eps, &mut |d| {
                let old = x[j];
                x[j] = old + d;
                let step = f64::from(x[j]) - f64::from(old);
                let l =
                    upload_tensor(be, &input.shape, &x).and_then(|t| probe.objective(params, &t));
                x[j] = old;
                Ok((l?, step))
            })?;
            record(&mut rep, f64::from(dx[j]), num, opts);
        }
        reports.push(rep);
    }
    Ok(Report { tensors: reports })
}

/// `(f(+eps) - f(-eps)) / (step+ - step-)` where `f(d)` returns the objective and the exact
/// step taken after f32 rounding.
fn central(eps: f64, f: &mut dyn FnMut(f32) -> Result<(f64, f64)>) -> Result<f64> {
    let (lp, sp) = f(eps as f32)?;
    let (lm, sm) = f(-eps as f32)?;
    Ok((lp - lm) / (sp - sm))
}

fn record(rep: &mut TensorReport, analytic: f64, numeric: f64, opts: &Options) {
    let abs = (analytic - numeric).abs();
    let scale = analytic.abs().max(numeric.abs());
    rep.checked += 1;
    rep.max_abs = rep.max_abs.max(abs);
    if scale > 0.0 {
        rep.max_rel = rep.max_rel.max(abs / scale);
    }
    if abs > opts.atol + opts.rtol * numeric.abs() || !abs.is_finite() {
        rep.failures += 1;
    }
}
