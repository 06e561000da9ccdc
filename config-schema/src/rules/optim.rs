//! Optimizer and schedule rules: parameters in range, schedules that can actually run.

use super::{conflict, invalid};
use crate::model::{AutoOr, Config, SchedulerType};
use crate::reader::Cx;

pub(super) fn check_optimizer(cx: &mut Cx<'_>, c: &Config) {
    let Some(o) = &c.optimizer else { return };
    let p = &o.params;
    let base = "optimizer.params";
    for (key, v) in [
        ("lr", p.lr),
        ("eps", p.eps),
        ("weight_decay", p.weight_decay),
    ] {
        if let Some(AutoOr::Value(v)) = v {
            if v < 0.0 {
                invalid(
                    cx,
                    &format!("{base}.{key}"),
                    format!("must not be negative, found {v}"),
                    None,
                );
            }
        }
    }
    if let Some(AutoOr::Value([b1, b2])) = p.betas {
        if !(0.0..1.0).contains(&b1) || !(0.0..1.0).contains(&b2) {
            invalid(
                cx,
                &format!("{base}.betas"),
                format!("each beta must be in [0, 1), found [{b1}, {b2}]"),
                None,
            );
        }
    }
}

pub(super) fn check_scheduler(cx: &mut Cx<'_>, c: &Config) {
    let Some(s) = &c.scheduler else { return };
    let p = &s.params;
    let base = "scheduler.params";
    let needs_total = matches!(
        s.kind,
        SchedulerType::WarmupDecayLR | SchedulerType::WarmupCosineLR
    );
    if needs_total && p.total_num_steps.is_none() {
        invalid(
            cx,
            base,
            format!("{:?} needs `total_num_steps`", s.kind),
            Some("add `total_num_steps` to scheduler.params"),
        );
    }
    if let (Some(AutoOr::Value(w)), Some(AutoOr::Value(t))) =
        (p.warmup_num_steps, p.total_num_steps)
    {
        if w > t {
            conflict(
                cx,
                &format!("{base}.warmup_num_steps"),
                "warmup is longer than the whole schedule",
                format!("warmup_num_steps = {w}, total_num_steps = {t}"),
            );
        }
    }
    if let (Some(AutoOr::Value(lo)), Some(AutoOr::Value(hi))) = (p.warmup_min_lr, p.warmup_max_lr) {
        if lo > hi {
            conflict(
                cx,
                &format!("{base}.warmup_min_lr"),
                "warmup_min_lr is above warmup_max_lr",
                format!("warmup_min_lr = {lo}, warmup_max_lr = {hi}"),
            );
        }
    }
    if s.kind == SchedulerType::OneCycle {
        match (p.cycle_min_lr, p.cycle_max_lr) {
            (Some(lo), Some(hi)) if lo > hi => conflict(
                cx,
                &format!("{base}.cycle_min_lr"),
                "cycle_min_lr is above cycle_max_lr",
                format!("cycle_min_lr = {lo}, cycle_max_lr = {hi}"),
            ),
            (Some(_), Some(_)) => {}
            _ => invalid(
                cx,
                base,
                "OneCycle needs `cycle_min_lr` and `cycle_max_lr`".into(),
                None,
            ),
        }
        if let (Some(lo), Some(hi)) = (p.cycle_min_mom, p.cycle_max_mom) {
            if lo > hi {
                conflict(
                    cx,
                    &format!("{base}.cycle_min_mom"),
                    "cycle_min_mom is above cycle_max_mom",
                    format!("cycle_min_mom = {lo}, cycle_max_mom = {hi}"),
                );
            }
        }
    }
    for (key, v) in [
        ("warmup_min_ratio", p.warmup_min_ratio),
        ("cos_min_ratio", p.cos_min_ratio),
    ] {
        if let Some(v) = v.filter(|v| !(0.0..=1.0).contains(v)) {
            invalid(
                cx,
                &format!("{base}.{key}"),
                format!("must be in [0, 1], found {v}"),
                None,
            );
        }
    }
}
