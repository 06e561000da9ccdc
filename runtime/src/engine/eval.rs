//! Evaluation: forward without gradients, loss and teacher-forced predictions.

use super::core::Engine;
use crate::nn::{Batch, BatchIds, Ctx};
use crate::tensor::Tensor;
use crate::Result;

/// One evaluation batch's outcome on this rank.
#[derive(Debug, Clone, PartialEq)]
pub struct Evaluation {
    /// Sum of token losses.
    pub loss_sum: f64,
    /// Target tokens counted.
    pub tokens: u64,
    /// Arg-max prediction at every position (when the model's last unit predicts).
    pub predictions: Option<Vec<u32>>,
}

impl Engine {
    /// Evaluates one batch (collective in stage 3: every rank must call it).
    pub fn evaluate(&mut self, batch: &Batch) -> Result<Evaluation> {
        let n = self.model.units.len();
        let ids = BatchIds::new(&*self.be, batch)?;
        let mut x = Tensor::default();
        let mut predictions = None;
        for unit in 0..n {
            self.gather_unit(unit, false)?;
            let r = self.eval_unit(unit, (batch, &ids), &x, unit + 1 == n);
            self.release_unit(unit);
            let (out, pred) = r?;
            predictions = predictions.or(pred);
            x = out;
        }
        Ok(Evaluation {
            loss_sum: x.to_vec_f32()?.first().copied().unwrap_or(0.0) as f64,
            tokens: batch.valid_targets() as u64,
            predictions,
        })
    }

    fn eval_unit(
        &mut self,
        unit: usize,
        (batch, ids): (&Batch, &BatchIds),
        x: &Tensor,
        last: bool,
    ) -> Result<(Tensor, Option<Vec<u32>>)> {
        let out = self.run_unit_forward(unit, (batch, ids), x, false)?;
        if !last {
            return Ok((out, None));
        }
        let shared = self.shared_index();
        let Self {
            model, groups, be, ..
        } = self;
        let u = &model.units[unit];
        let params = super::passes::unit_params(groups, unit, &u.uses_shared, shared)?;
        let mut saved = None;
        let mut ctx = Ctx {
            be: &**be,
            batch,
            ids,
            training: false,
            rng_seed: 0,
            saved: &mut saved,
        };
        Ok((out, u.module.predict(&mut ctx, &params, x)?))
    }
}
