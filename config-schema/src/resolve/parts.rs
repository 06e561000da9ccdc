//! Resolution of the sections: ZeRO (stage defaults and `"auto"` buckets), precision, optimizer
//! and scheduler.

use super::{offload, to_usize, Resolver};
use crate::diagnostic::DiagnosticKind;
use crate::model::{AutoOr, OptimizerType, SchedulerType, WarmupKind};
use crate::resolved::*;

/// `zero_optimization`; `"auto"` buckets follow Hugging Face: reduce = h², prefetch = 0.9·h²,
/// persistence = 10·h.
pub(super) fn zero(r: &mut Resolver<'_>) -> ZeroConfig {
    let z = &r.config.zero_optimization;
    let stage = match z.stage {
        0 => ZeroStage::Stage0,
        1 => ZeroStage::Stage1,
        2 => ZeroStage::Stage2,
        _ => ZeroStage::Stage3,
    };
    let overlap_comm = z.overlap_comm.unwrap_or_else(|| {
        let on = stage == ZeroStage::Stage3;
        r.decide(
            "zero_optimization.overlap_comm",
            on,
            "DeepSpeed's default: on only at stage 3",
        );
        on
    });
    let h = r.ctx.hidden_size.map(|h| h as u64);
    let bucket =
        |r: &mut Resolver<'_>, key: &str, v: AutoOr<u64>, f: fn(u64) -> u64, rule: &str| -> usize {
            let path = format!("zero_optimization.{key}");
            match (v, h) {
                (AutoOr::Value(v), _) => to_usize(v),
                (AutoOr::Auto, Some(h)) => {
                    let v = f(h);
                    r.decide(&path, v, rule);
                    to_usize(v)
                }
                (AutoOr::Auto, None) => {
                    r.missing(&path, "the model's hidden size is not known");
                    0
                }
            }
        };
    let reduce = bucket(
        r,
        "reduce_bucket_size",
        z.reduce_bucket_size,
        |h| h.saturating_mul(h),
        "\"auto\": hidden_size²",
    );
    let prefetch = bucket(
        r,
        "stage3_prefetch_bucket_size",
        z.stage3_prefetch_bucket_size,
        |h| (0.9 * (h as f64) * (h as f64)) as u64,
        "\"auto\": 0.9 × hidden_size²",
    );
    let persistence = bucket(
        r,
        "stage3_param_persistence_threshold",
        z.stage3_param_persistence_threshold,
        |h| h.saturating_mul(10),
        "\"auto\": 10 × hidden_size",
    );
    ZeroConfig {
        stage,
        overlap_comm,
        reduce_scatter: z.reduce_scatter,
        reduce_bucket_size: whole_unit(r, "reduce_bucket_size", reduce),
        allgather_bucket_size: whole_unit(
            r,
            "allgather_bucket_size",
            to_usize(z.allgather_bucket_size),
        ),
        sub_group_size: to_usize(z.sub_group_size),
        prefetch_bucket_size: prefetch,
        param_persistence_threshold: persistence,
        max_live_parameters: to_usize(z.stage3_max_live_parameters),
        max_reuse_distance: to_usize(z.stage3_max_reuse_distance),
        hpz_partition_size: to_usize(z.zero_hpz_partition_size),
        quantized_weights: z.zero_quantized_weights && stage == ZeroStage::Stage3,
        quantized_nontrainable_weights: z.zero_quantized_nontrainable_weights
            && stage == ZeroStage::Stage3,
        quantized_gradients: z.zero_quantized_gradients && stage == ZeroStage::Stage3,
        mics_shard_size: usize::try_from(z.mics_shard_size).unwrap_or(0),
        offload_param: offload(z.offload_param.as_ref(), 5),
        offload_optimizer: offload(z.offload_optimizer.as_ref(), 4),
    }
}

/// Elements in a bucket that is never split: a unit's whole buffer (large enough that twice
/// it cannot overflow).
pub(crate) const WHOLE_UNIT: usize = 1 << 60;

/// A bucket size of 0 (DeepSpeed: each parameter in its own bucket) becomes one collective per
/// unit: ferrozero's buckets split a unit's buffer, and 0-element pieces are not a schedule.
fn whole_unit(r: &mut Resolver<'_>, key: &str, v: usize) -> usize {
    if v != 0 {
        return v;
    }
    r.decide(
        &format!("zero_optimization.{key}"),
        "a unit's whole buffer",
        "0: DeepSpeed buckets each parameter alone; ferrozero moves each unit's gradients or parameters in one collective",
    );
    WHOLE_UNIT
}

/// `fp16` / `bf16`; `"auto"` means off, as in Hugging Face without `--fp16`/`--bf16`.
pub(super) fn precision(r: &mut Resolver<'_>) -> Precision {
    let enabled = |r: &mut Resolver<'_>, path: &str, v: AutoOr<bool>| match v {
        AutoOr::Value(b) => b,
        AutoOr::Auto => {
            r.decide(path, false, "\"auto\": no mixed precision requested");
            false
        }
    };
    let fp16 = enabled(r, "fp16.enabled", r.config.fp16.enabled);
    let bf16 = enabled(r, "bf16.enabled", r.config.bf16.enabled);
    let f = &r.config.fp16;
    match (fp16, bf16) {
        (true, _) if f.loss_scale > 0.0 => Precision::Fp16(LossScaling::Static(f.loss_scale)),
        (true, _) => Precision::Fp16(LossScaling::Dynamic {
            initial_scale_power: f.initial_scale_power,
            loss_scale_window: f.loss_scale_window,
            hysteresis: f.hysteresis,
            consecutive_hysteresis: f.consecutive_hysteresis,
            min_loss_scale: f.min_loss_scale,
        }),
        (false, true) => Precision::Bf16,
        (false, false) => Precision::F32,
    }
}

fn param(
    r: &mut Resolver<'_>,
    key: &str,
    v: Option<AutoOr<f64>>,
    default: f64,
    auto: Option<f64>,
) -> f64 {
    let path = format!("optimizer.params.{key}");
    match (v, auto) {
        (None, _) => default,
        (Some(AutoOr::Value(v)), _) => v,
        (Some(AutoOr::Auto), Some(a)) => {
            r.decide(
                &path,
                a,
                "\"auto\": Hugging Face's TrainingArguments default",
            );
            a
        }
        (Some(AutoOr::Auto), None) => {
            r.missing(&path, "ferrozero has no trainer arguments to take it from");
            default
        }
    }
}

/// `optimizer`; DeepSpeed's `"Adam"` is AdamW unless `adam_w_mode = false`.
pub(super) fn optimizer(r: &mut Resolver<'_>) -> Option<OptimizerConfig> {
    let Some(o) = r.config.optimizer.clone() else {
        r.fail(
            DiagnosticKind::InvalidValue,
            "optimizer",
            "no optimizer is configured".into(),
            Some("add an `[optimizer]` table, e.g. type = \"AdamW\" with params.lr".into()),
            vec![],
        );
        return None;
    };
    let p = &o.params;
    let betas = |r: &mut Resolver<'_>, default: [f64; 2]| match p.betas {
        None => default,
        Some(AutoOr::Value(b)) => b,
        Some(AutoOr::Auto) => {
            r.decide(
                "optimizer.params.betas",
                "[0.9, 0.999]",
                "\"auto\": Hugging Face's TrainingArguments default",
            );
            [0.9, 0.999]
        }
    };
    Some(match o.kind {
        OptimizerType::Adam | OptimizerType::AdamW => {
            let [b1, b2] = betas(r, [0.9, 0.999]);
            OptimizerConfig::Adam {
                lr: param(r, "lr", p.lr, 1e-3, None),
                betas: (b1, b2),
                eps: param(r, "eps", p.eps, 1e-8, Some(1e-8)),
                weight_decay: param(r, "weight_decay", p.weight_decay, 0.0, Some(0.0)),
                adam_w_mode: o.kind == OptimizerType::AdamW || p.adam_w_mode.unwrap_or(true),
                bias_correction: p.bias_correction.unwrap_or(true),
            }
        }
        OptimizerType::Sgd => OptimizerConfig::Sgd {
            lr: param(r, "lr", p.lr, 1e-3, None),
            momentum: p.momentum.unwrap_or(0.0),
            dampening: p.dampening.unwrap_or(0.0),
            weight_decay: param(r, "weight_decay", p.weight_decay, 0.0, Some(0.0)),
            nesterov: p.nesterov.unwrap_or(false),
        },
        OptimizerType::Lion => {
            let [b1, b2] = betas(r, [0.9, 0.99]);
            OptimizerConfig::Lion {
                lr: param(r, "lr", p.lr, 1e-4, None),
                betas: (b1, b2),
                weight_decay: param(r, "weight_decay", p.weight_decay, 0.0, Some(0.0)),
            }
        }
        OptimizerType::Lamb => {
            let [b1, b2] = betas(r, [0.9, 0.999]);
            OptimizerConfig::Lamb {
                lr: param(r, "lr", p.lr, 1e-3, None),
                betas: (b1, b2),
                eps: param(r, "eps", p.eps, 1e-8, Some(1e-8)),
                eps_inside_sqrt: p.eps_inside_sqrt.unwrap_or(false),
                weight_decay: param(r, "weight_decay", p.weight_decay, 0.0, Some(0.0)),
                bias_correction: p.bias_correction.unwrap_or(true),
                max_coeff: p.max_coeff.unwrap_or(10.0),
                min_coeff: p.min_coeff.unwrap_or(0.01),
            }
        }
    })
}

fn steps(r: &mut Resolver<'_>, key: &str, v: Option<AutoOr<u64>>, default: u64) -> u64 {
    match v {
        None => default,
        Some(AutoOr::Value(v)) => v,
        Some(AutoOr::Auto) => {
            r.missing(
                &format!("scheduler.params.{key}"),
                "ferrozero does not know the run's length",
            );
            default
        }
    }
}

/// `scheduler`; `warmup_max_lr = "auto"` takes the optimizer's lr, `warmup_min_lr = "auto"` 0.
pub(super) fn scheduler(r: &mut Resolver<'_>, lr: f64) -> Option<SchedulerConfig> {
    let s = r.config.scheduler.clone()?;
    let p = &s.params;
    let warmup_type = match p.warmup_type.unwrap_or(WarmupKind::Log) {
        WarmupKind::Log => WarmupType::Log,
        WarmupKind::Linear => WarmupType::Linear,
    };
    let lr_param = |r: &mut Resolver<'_>,
                    key: &str,
                    v: Option<AutoOr<f64>>,
                    default: f64,
                    auto: f64| match v {
        None => default,
        Some(AutoOr::Value(v)) => v,
        Some(AutoOr::Auto) => {
            r.decide(
                &format!("scheduler.params.{key}"),
                auto,
                "\"auto\": Hugging Face's rule",
            );
            auto
        }
    };
    let warmup_min_lr = lr_param(r, "warmup_min_lr", p.warmup_min_lr, 0.0, 0.0);
    let warmup_max_lr = lr_param(r, "warmup_max_lr", p.warmup_max_lr, 0.001, lr);
    let warmup_num_steps = steps(r, "warmup_num_steps", p.warmup_num_steps, 1000);
    let total_num_steps = steps(r, "total_num_steps", p.total_num_steps, 0);
    if warmup_num_steps > total_num_steps
        && matches!(
            s.kind,
            SchedulerType::WarmupDecayLR | SchedulerType::WarmupCosineLR
        )
        && total_num_steps > 0
    {
        r.fail(
            DiagnosticKind::Conflict,
            "scheduler.params.warmup_num_steps",
            "warmup is longer than the whole schedule".into(),
            None,
            vec![format!(
                "warmup_num_steps = {warmup_num_steps}, total_num_steps = {total_num_steps}"
            )],
        );
    }
    Some(match s.kind {
        SchedulerType::WarmupLR => SchedulerConfig::WarmupLR {
            warmup_min_lr,
            warmup_max_lr,
            warmup_num_steps,
            warmup_type,
        },
        SchedulerType::WarmupDecayLR => SchedulerConfig::WarmupDecayLR {
            total_num_steps,
            warmup_min_lr,
            warmup_max_lr,
            warmup_num_steps,
            warmup_type,
        },
        SchedulerType::WarmupCosineLR => SchedulerConfig::WarmupCosineLR {
            total_num_steps,
            warmup_min_ratio: p.warmup_min_ratio.unwrap_or(0.0),
            warmup_num_steps,
            cos_min_ratio: p.cos_min_ratio.unwrap_or(0.0001),
            warmup_type,
        },
        SchedulerType::OneCycle => {
            let first = p.cycle_first_step_size.unwrap_or(2000);
            let first_stair = p.cycle_first_stair_count.unwrap_or(0);
            SchedulerConfig::OneCycle {
                cycle_min_lr: p.cycle_min_lr.unwrap_or(0.0),
                cycle_max_lr: p.cycle_max_lr.unwrap_or(0.0),
                decay_lr_rate: p.decay_lr_rate.unwrap_or(0.0),
                cycle_first_step_size: first,
                cycle_second_step_size: p.cycle_second_step_size.unwrap_or(first),
                cycle_first_stair_count: first_stair,
                cycle_second_stair_count: p.cycle_second_stair_count.unwrap_or(first_stair),
                decay_step_size: p.decay_step_size.unwrap_or(0),
                cycle_momentum: p.cycle_momentum.unwrap_or(true),
                cycle_min_mom: p.cycle_min_mom.unwrap_or(0.8),
                cycle_max_mom: p.cycle_max_mom.unwrap_or(0.9),
                decay_mom_rate: p.decay_mom_rate.unwrap_or(0.0),
            }
        }
    })
}

/// `data_types.grad_accum_dtype`, against the resolved precision: whether micro-step gradients
/// accumulate in f32 although the run is half precision (the rules reported every other
/// dtype, and the clash with `bf16_master_weights_and_grads`, when the file was read).
pub(super) fn grad_accum_f32(r: &Resolver<'_>, precision: &Precision, bf16: Bf16State) -> bool {
    *precision != Precision::F32
        && r.config.data_types.grad_accum_dtype == Some(CommDataType::Fp32)
        && !bf16.master_weights_and_grads
}
