//! Gradient checking for any [`Module`]: the analytic backward against central finite
//! differences of the scalar objective `Σ out_i · r_i` (r a fixed random projection, or 1
//! for a one-element loss output), accumulated in f64.
//!
//! Users run it on their own modules:
//! ```text
//! let report = gradcheck::check(&my_block, &batch, &mut params, &input, &Options::default())?;
//! assert!(report.passed(), "{report}");
//! ```

use std::fmt;

use super::{Batch, Ctx, Grads, Module, Params, Saved};
use crate::backend::rng;
use crate::tensor::Tensor;
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
    module: &'a dyn Module,
    batch: &'a Batch,
    seed: u64,
    proj: Vec<f64>,
}

impl Probe<'_> {
    fn objective(&self, params: &[Vec<f32>], input: &Tensor) -> Result<f64> {
        let mut saved: Saved = None;
        let mut ctx = Ctx {
            batch: self.batch,
            training: true,
            rng_seed: self.seed,
            saved: &mut saved,
        };
        let p = Params::new(params.iter().map(Vec::as_slice).collect());
        let out = self.module.forward(&mut ctx, &p, input)?;
        if out.numel() != self.proj.len() {
            return Err(Error::Invalid(
                "gradcheck: output size changed between calls".into(),
            ));
        }
        Ok(out
            .data
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

/// Runs the check. `params` holds the module's parameters then its shared ones, in
/// [`Params`] order; they are perturbed during the check and restored afterwards.
pub fn check(
    module: &dyn Module,
    batch: &Batch,
    params: &mut [Vec<f32>],
    input: &Tensor,
    opts: &Options,
) -> Result<Report> {
    let mut saved: Saved = None;
    let out = {
        let mut ctx = Ctx {
            batch,
            training: true,
            rng_seed: opts.seed,
            saved: &mut saved,
        };
        module.forward(
            &mut ctx,
            &Params::new(params.iter().map(Vec::as_slice).collect()),
            input,
        )?
    };
    let proj: Vec<f64> = if out.numel() == 1 {
        vec![1.0]
    } else {
        (0..out.numel())
            .map(|i| rng::normal(opts.seed ^ 0xA5A5, i as u64))
            .collect()
    };
    let grad_out = Tensor::new(out.shape.clone(), proj.iter().map(|&r| r as f32).collect())?;
    let mut grads: Vec<Vec<f32>> = params.iter().map(|p| vec![0.0; p.len()]).collect();
    let dx = {
        let mut ctx = Ctx {
            batch,
            training: true,
            rng_seed: opts.seed,
            saved: &mut saved,
        };
        let p = Params::new(params.iter().map(Vec::as_slice).collect());
        let mut g = Grads::new(grads.iter_mut().map(Vec::as_mut_slice).collect());
        module.backward(&mut ctx, &p, &mut g, &grad_out)?
    };
    if input.numel() > 0 && dx.numel() != input.numel() {
        return Err(Error::Shape {
            op: "gradcheck",
            expected: format!("an input gradient of {} elements", input.numel()),
            got: format!("{}", dx.numel()),
        });
    }
    let probe = Probe {
        module,
        batch,
        seed: opts.seed,
        proj,
    };
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
                let l = probe.objective(params, input);
                params[i][j] = old;
                Ok((l?, step))
            })?;
            record(&mut rep, f64::from(grads[i][j]), num, opts);
        }
        reports.push(rep);
    }
    if input.numel() > 0 {
        let mut x = input.clone();
        let mut rep = TensorReport {
            name: "input".into(),
            checked: 0,
            max_abs: 0.0,
            max_rel: 0.0,
            failures: 0,
        };
        for j in probe_indices(x.numel(), opts.max_per_tensor) {
            let num = central(opts.eps, &mut |d| {
                let old = x.data[j];
                x.data[j] = old + d;
                let step = f64::from(x.data[j]) - f64::from(old);
                let l = probe.objective(params, &x);
                x.data[j] = old;
                Ok((l?, step))
            })?;
            record(&mut rep, f64::from(dx.data[j]), num, opts);
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
