//! Loss scaling for fp16, with DeepSpeed's dynamic-scaler semantics.
//!
//! Dynamic: on overflow the step is skipped; if hysteresis is used up the scale halves (not
//! below `min_loss_scale`; overflowing while already at the minimum is a fatal error), else
//! hysteresis is decremented. Without overflow the scale doubles every `loss_scale_window`
//! iterations counted from the last overflow (refilling hysteresis), and
//! `consecutive_hysteresis` refills hysteresis on every clean iteration.

use ferrozero_config::resolved::LossScaling;

use crate::{Error, Result};

/// What the scaler decided for one iteration.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScaleDecision {
    /// The optimizer step must be skipped (gradients overflowed).
    pub skip_step: bool,
    /// The scale that was in force for this iteration's backward.
    pub scale_used: f64,
}

/// A loss scaler: none (1.0), static, or dynamic.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum LossScaler {
    /// No scaling (f32 and bf16): overflow still skips the step.
    None,
    /// A fixed scale.
    Static(f64),
    /// DeepSpeed's dynamic scaler.
    Dynamic(DynamicScaler),
}

/// State of the dynamic scaler.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct DynamicScaler {
    scale: f64,
    min_scale: f64,
    window: u64,
    hysteresis: u32,
    cur_hysteresis: u32,
    consecutive_hysteresis: bool,
    iter: i64,
    last_overflow_iter: i64,
}

impl LossScaler {
    /// Builds the scaler for fp16 settings, or `None` for other precisions.
    pub fn from_config(cfg: Option<&LossScaling>) -> Self {
        match cfg {
            None => LossScaler::None,
            Some(LossScaling::Static(s)) => LossScaler::Static(*s),
            Some(LossScaling::Dynamic {
                initial_scale_power,
                loss_scale_window,
                hysteresis,
                consecutive_hysteresis,
                min_loss_scale,
            }) => LossScaler::Dynamic(DynamicScaler {
                scale: 2f64.powi(*initial_scale_power as i32),
                min_scale: *min_loss_scale,
                window: (*loss_scale_window).max(1),
                hysteresis: (*hysteresis).max(1),
                cur_hysteresis: (*hysteresis).max(1),
                consecutive_hysteresis: *consecutive_hysteresis,
                iter: 0,
                last_overflow_iter: -1,
            }),
        }
    }

    /// The scale to multiply the loss by now.
    pub fn scale(&self) -> f64 {
        match self {
            LossScaler::None => 1.0,
            LossScaler::Static(s) => *s,
            LossScaler::Dynamic(d) => d.scale,
        }
    }

    /// Records one iteration's outcome; fails when a dynamic scale must drop below its floor.
    pub fn update(&mut self, overflow: bool) -> Result<ScaleDecision> {
        let scale_used = self.scale();
        if let LossScaler::Dynamic(d) = self {
            d.update(overflow)?;
        }
        Ok(ScaleDecision {
            skip_step: overflow,
            scale_used,
        })
    }
}

impl DynamicScaler {
    fn update(&mut self, overflow: bool) -> Result<()> {
        if overflow {
            if self.cur_hysteresis <= 1 {
                if self.scale <= self.min_scale {
                    return Err(Error::Training(format!(
                        "fp16 gradients overflowed with the loss scale already at its minimum \
                         ({}); lower the learning rate, raise min_loss_scale's headroom or use bf16",
                        self.min_scale
                    )));
                }
                self.scale = (self.scale / 2.0).max(self.min_scale);
            } else {
                self.cur_hysteresis -= 1;
            }
            self.last_overflow_iter = self.iter;
        } else {
            if self.consecutive_hysteresis {
                self.cur_hysteresis = self.hysteresis;
            }
            if (self.iter - self.last_overflow_iter) % self.window as i64 == 0 {
                if !self.consecutive_hysteresis {
                    self.cur_hysteresis = self.hysteresis;
                }
                self.scale *= 2.0;
            }
        }
        self.iter += 1;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dynamic(power: u32, window: u64, hyst: u32, consecutive: bool, min: f64) -> LossScaler {
        LossScaler::from_config(Some(&LossScaling::Dynamic {
            initial_scale_power: power,
            loss_scale_window: window,
            hysteresis: hyst,
            consecutive_hysteresis: consecutive,
            min_loss_scale: min,
        }))
    }

    fn run(s: &mut LossScaler, script: &str) -> Vec<(f64, bool)> {
        script
            .chars()
            .map(|c| {
                let d = s.update(c == 'X').unwrap();
                (d.scale_used, d.skip_step)
            })
            .collect()
    }

    #[test]
    fn doubles_after_window_clean_steps() {
        let mut s = dynamic(4, 3, 1, false, 1.0);
        let got = run(&mut s, "......");
        let scales: Vec<f64> = got.iter().map(|g| g.0).collect();
        assert_eq!(scales, vec![16.0, 16.0, 16.0, 32.0, 32.0, 32.0]);
        assert_eq!(s.scale(), 64.0);
    }

    #[test]
    fn hysteresis_delays_the_halving() {
        // hysteresis 2: the first overflow only uses up hysteresis, the second halves.
        let mut s = dynamic(4, 1000, 2, false, 1.0);
        let got = run(&mut s, "XX.X");
        assert_eq!(
            got,
            vec![(16.0, true), (16.0, true), (8.0, false), (8.0, true)]
        );
        assert_eq!(s.scale(), 4.0);
    }

    #[test]
    fn window_counts_from_the_last_overflow() {
        let mut s = dynamic(3, 2, 1, false, 1.0);
        let scales: Vec<f64> = run(&mut s, ".X...").iter().map(|g| g.0).collect();
        // iter0 clean: (0-(-1))%2 != 0; iter1 overflow: 8 -> 4; iter2 clean (1%2);
        // iter3 clean (2%2 == 0) doubles to 8 after it.
        assert_eq!(scales, vec![8.0, 8.0, 4.0, 4.0, 8.0]);
    }

    #[test]
    fn consecutive_hysteresis_refills_on_every_clean_step() {
        let mut s = dynamic(4, 1000, 2, true, 1.0);
        let got = run(&mut s, "X.X.X");
        assert!(got.iter().all(|g| g.0 == 16.0), "{got:?}");
        let mut s = dynamic(4, 1000, 2, false, 1.0);
        let got = run(&mut s, "X.X.X");
        assert_eq!(got.last().unwrap().0, 8.0);
    }

    #[test]
    fn overflow_at_the_minimum_is_fatal() {
        let mut s = dynamic(1, 1000, 1, false, 1.0);
        s.update(true).unwrap(); // 2 -> 1
        assert_eq!(s.scale(), 1.0);
        let err = s.update(true).unwrap_err().to_string();
        assert!(err.contains("minimum"), "{err}");
    }

    #[test]
    fn never_drops_below_the_floor() {
        let mut s = dynamic(2, 1000, 1, false, 3.0);
        s.update(true).unwrap();
        assert_eq!(s.scale(), 3.0);
    }

    #[test]
    fn static_and_none_skip_but_keep_the_scale() {
        let mut s = LossScaler::from_config(Some(&LossScaling::Static(128.0)));
        assert_eq!(
            s.update(true).unwrap(),
            ScaleDecision {
                skip_step: true,
                scale_used: 128.0
            }
        );
        assert_eq!(s.scale(), 128.0);
        let mut n = LossScaler::None;
        assert_eq!(n.update(false).unwrap().scale_used, 1.0);
    }
}
