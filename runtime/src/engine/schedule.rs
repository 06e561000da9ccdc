//! Learning-rate schedules with DeepSpeed's formulas (`WarmupLR`, `WarmupDecayLR`,
//! `WarmupCosineLR`, `OneCycle`).
//!
//! `lr_at(k)` is the learning rate of the optimizer step with 0-based index `k`, i.e. the
//! value DeepSpeed's scheduler holds after `k` calls to `step()` past its initial one.

use ferrozero_config::resolved::{OptimizerConfig, SchedulerConfig, WarmupType};

/// A learning-rate (and, for OneCycle, momentum) schedule.
#[derive(Debug, Clone, PartialEq)]
pub struct Schedule {
    base_lr: f64,
    cfg: Option<SchedulerConfig>,
}

/// Warmup progress in [0, 1] at step `k` of `steps`, DeepSpeed-style: `log(k+1)/log(steps)`
/// or `k/steps`; `steps` is at least 2 so the log form is defined.
fn warmup_gamma(k: u64, steps: u64, kind: WarmupType) -> f64 {
    let steps = steps.max(2);
    match kind {
        WarmupType::Log => ((k + 1) as f64).ln() / (steps as f64).ln(),
        WarmupType::Linear => k as f64 / steps as f64,
    }
}

/// The warmup gamma during the first `steps` steps, `after()` from then on.
fn warmup_then(k: u64, steps: u64, kind: WarmupType, after: impl FnOnce() -> f64) -> f64 {
    if k < steps {
        warmup_gamma(k, steps, kind)
    } else {
        after()
    }
}

impl Schedule {
    /// The schedule for an optimizer config and an optional scheduler.
    pub fn new(opt: &OptimizerConfig, cfg: Option<SchedulerConfig>) -> Self {
        Self {
            base_lr: opt.lr(),
            cfg,
        }
    }

    /// Learning rate of optimizer step `k` (0-based).
    pub fn lr_at(&self, k: u64) -> f64 {
        match &self.cfg {
            None => self.base_lr,
            Some(SchedulerConfig::WarmupLR {
                warmup_min_lr,
                warmup_max_lr,
                warmup_num_steps,
                warmup_type,
            }) => {
                let g = warmup_then(k, *warmup_num_steps, *warmup_type, || 1.0);
                warmup_min_lr + (warmup_max_lr - warmup_min_lr) * g
            }
            Some(SchedulerConfig::WarmupDecayLR {
                total_num_steps,
                warmup_min_lr,
                warmup_max_lr,
                warmup_num_steps,
                warmup_type,
            }) => {
                let g = warmup_then(k, *warmup_num_steps, *warmup_type, || {
                    let left = *total_num_steps as f64 - k as f64;
                    let span = (*total_num_steps as f64 - *warmup_num_steps as f64).max(1.0);
                    (left / span).max(0.0)
                });
                warmup_min_lr + (warmup_max_lr - warmup_min_lr) * g
            }
            Some(SchedulerConfig::WarmupCosineLR {
                total_num_steps,
                warmup_min_ratio,
                warmup_num_steps,
                cos_min_ratio,
                warmup_type,
            }) => {
                self.base_lr
                    * cosine_ratio(
                        k,
                        *total_num_steps,
                        *warmup_min_ratio,
                        *warmup_num_steps,
                        *cos_min_ratio,
                        *warmup_type,
                    )
            }
            Some(c @ SchedulerConfig::OneCycle { .. }) => one_cycle(c, k).0,
        }
    }

    /// OneCycle's momentum (Adam's beta1) at step `k`, when the schedule cycles momentum.
    pub fn momentum_at(&self, k: u64) -> Option<f64> {
        match &self.cfg {
            Some(c @ SchedulerConfig::OneCycle { cycle_momentum, .. }) if *cycle_momentum => {
                Some(one_cycle(c, k).1)
            }
            _ => None,
        }
    }
}

fn cosine_ratio(
    k: u64,
    total: u64,
    warm_min: f64,
    warm: u64,
    cos_min: f64,
    kind: WarmupType,
) -> f64 {
    if k < warm {
        return warm_min + warmup_gamma(k, warm, kind) * (1.0 - warm_min);
    }
    let real_step = (k - warm + 1) as f64;
    let real_total = (total.saturating_sub(warm)).max(1) as f64;
    let r = (1.0 + (std::f64::consts::PI * real_step / real_total).cos()) / 2.0;
    (cos_min + (1.0 - cos_min) * r).max(0.0)
}

/// (lr, momentum) of the 1-cycle policy at step `k`.
fn one_cycle(c: &SchedulerConfig, k: u64) -> (f64, f64) {
    let SchedulerConfig::OneCycle {
        cycle_min_lr,
        cycle_max_lr,
        decay_lr_rate,
        cycle_first_step_size,
        cycle_second_step_size,
        cycle_first_stair_count,
        cycle_second_stair_count,
        decay_step_size,
        cycle_min_mom,
        cycle_max_mom,
        decay_mom_rate,
        ..
    } = c
    else {
        return (0.0, 0.0);
    };
    let total = (*cycle_first_step_size + *cycle_second_step_size).max(1) as f64;
    let step_ratio = *cycle_first_step_size as f64 / total;
    let it = k as f64;
    if it <= total {
        let cycle = (1.0 + it / total).floor();
        let x = 1.0 + it / total - cycle;
        let (mut scale, stairs) = if x <= step_ratio {
            (x / step_ratio, *cycle_first_stair_count)
        } else {
            ((x - 1.0) / (step_ratio - 1.0), *cycle_second_stair_count)
        };
        // DeepSpeed's staircase: a stair count holds lr and momentum flat across each of that
        // many pieces of the half cycle, quantised from the step's offset in the cycle.
        if stairs > 0 {
            let n = stairs as f64;
            let at = it % total;
            let first = *cycle_first_step_size as f64;
            let position = if at <= first {
                at * n / first
            } else {
                (total - at) * n / *cycle_second_step_size as f64
            };
            scale = position.floor() / n;
        }
        let lr = cycle_min_lr + (cycle_max_lr - cycle_min_lr) * scale;
        let mom = cycle_max_mom - (cycle_max_mom - cycle_min_mom) * scale;
        return (lr, mom);
    }
    if *decay_step_size == 0 {
        return (*cycle_min_lr, *cycle_max_mom);
    }
    // Decay after the cycle divides the floor lr, so the schedule keeps falling.
    let interval = (it - total) / *decay_step_size as f64;
    (
        cycle_min_lr / (1.0 + decay_lr_rate * interval),
        cycle_max_mom * (1.0 + decay_mom_rate * interval),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn adam(lr: f64) -> OptimizerConfig {
        OptimizerConfig::Adam {
            lr,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.0,
            adam_w_mode: true,
            bias_correction: true,
        }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-12 * b.abs().max(1.0)
    }

    #[test]
    fn constant_without_scheduler() {
        assert_eq!(Schedule::new(&adam(0.1), None).lr_at(7), 0.1);
    }

    #[test]
    fn warmup_log_and_linear() {
        let s = |t| {
            Schedule::new(
                &adam(1.0),
                Some(SchedulerConfig::WarmupLR {
                    warmup_min_lr: 0.0,
                    warmup_max_lr: 1.0,
                    warmup_num_steps: 10,
                    warmup_type: t,
                }),
            )
        };
        let log = s(WarmupType::Log);
        assert_eq!(log.lr_at(0), 0.0);
        assert!(close(log.lr_at(4), 5f64.ln() / 10f64.ln()));
        assert_eq!(log.lr_at(10), 1.0);
        assert_eq!(log.lr_at(1000), 1.0);
        let lin = s(WarmupType::Linear);
        assert!(close(lin.lr_at(5), 0.5));
    }

    #[test]
    fn warmup_decay_reaches_zero_at_total() {
        let s = Schedule::new(
            &adam(1.0),
            Some(SchedulerConfig::WarmupDecayLR {
                total_num_steps: 20,
                warmup_min_lr: 0.0,
                warmup_max_lr: 2.0,
                warmup_num_steps: 10,
                warmup_type: WarmupType::Linear,
            }),
        );
        assert!(close(s.lr_at(10), 2.0));
        assert!(close(s.lr_at(15), 1.0));
        assert_eq!(s.lr_at(20), 0.0);
        assert_eq!(s.lr_at(25), 0.0);
    }

    #[test]
    fn cosine_ends_at_min_ratio() {
        let s = Schedule::new(
            &adam(2.0),
            Some(SchedulerConfig::WarmupCosineLR {
                total_num_steps: 110,
                warmup_min_ratio: 0.0,
                warmup_num_steps: 10,
                cos_min_ratio: 0.1,
                warmup_type: WarmupType::Linear,
            }),
        );
        assert!(close(s.lr_at(5), 1.0));
        // Halfway through the cosine: ratio = 0.1 + 0.9 * 0.5.
        assert!(close(s.lr_at(59), 2.0 * 0.55));
        assert!(close(s.lr_at(109), 2.0 * 0.1));
    }

    #[test]
    fn one_cycle_rises_falls_and_decays() {
        let c = SchedulerConfig::OneCycle {
            cycle_min_lr: 0.1,
            cycle_max_lr: 1.1,
            decay_lr_rate: 1.0,
            cycle_first_step_size: 10,
            cycle_second_step_size: 10,
            cycle_first_stair_count: 0,
            cycle_second_stair_count: 0,
            decay_step_size: 5,
            cycle_momentum: true,
            cycle_min_mom: 0.8,
            cycle_max_mom: 0.9,
            decay_mom_rate: 0.0,
        };
        let s = Schedule::new(&adam(1.0), Some(c));
        assert!(close(s.lr_at(0), 0.1));
        assert!(close(s.lr_at(10), 1.1));
        assert!(close(s.lr_at(15), 0.6));
        assert!(close(s.momentum_at(10).unwrap(), 0.8));
        assert!(close(s.lr_at(25), 0.1 / 2.0));
    }

    #[test]
    fn one_cycle_stairs_hold_the_rate_flat() {
        let c = |first_stairs, second_stairs| SchedulerConfig::OneCycle {
            cycle_min_lr: 0.1,
            cycle_max_lr: 1.1,
            decay_lr_rate: 0.0,
            cycle_first_step_size: 10,
            cycle_second_step_size: 10,
            cycle_first_stair_count: first_stairs,
            cycle_second_stair_count: second_stairs,
            decay_step_size: 0,
            cycle_momentum: true,
            cycle_min_mom: 0.8,
            cycle_max_mom: 0.9,
            decay_mom_rate: 0.0,
        };
        let s = Schedule::new(&adam(1.0), Some(c(2, 5)));
        // Rising half, two stairs: flat at the minimum, then at the middle, then the peak.
        for (k, lr) in [(0, 0.1), (4, 0.1), (5, 0.6), (9, 0.6), (10, 1.1)] {
            assert!(close(s.lr_at(k), lr), "step {k}: {} != {lr}", s.lr_at(k));
        }
        assert!(close(s.momentum_at(5).unwrap(), 0.85));
        // Falling half, five stairs of two steps.
        for (k, lr) in [(11, 0.9), (12, 0.9), (13, 0.7), (19, 0.1)] {
            assert!(close(s.lr_at(k), lr), "step {k}: {} != {lr}", s.lr_at(k));
        }
        // No stairs: the continuous schedule.
        let s = Schedule::new(&adam(1.0), Some(c(0, 0)));
        assert!(close(s.lr_at(4), 0.5));
    }
}
