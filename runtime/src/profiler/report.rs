//! The profile of one step: rows per module (each split by kernel family) and per family,
//! built from the recorder's cells; rendered as a table in `table`.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::Serialize;

use super::record::{Cell, Family, BACKGROUND, ENGINE, OPTIMIZER};

/// The module the time no operation accounts for goes to: the engine's own host work
/// (gathers, reductions, bookkeeping) between the training thread's operations.
pub const OTHER: &str = "other";

/// One kernel family's figures, inside a module or over the whole step.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FamilyRow {
    /// The family.
    pub family: Family,
    /// Operations.
    pub calls: u64,
    /// FLOPs counted.
    pub flops: u64,
    /// Seconds.
    pub seconds: f64,
    /// `flops / seconds / 1e12`.
    pub tflops_per_s: f64,
    /// `seconds` over the step's, in percent.
    pub percent_of_step: f64,
}

/// One module: a unit of the model (`embed`, `h.0`, ..., `head`), `optimizer` (the
/// training thread's updates), `engine` (operations outside every unit), `background`
/// (operations of other threads, overlapping the rest) or `other` (time outside every
/// operation).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModuleRow {
    /// The module's name.
    pub name: String,
    /// Parameters the module owns (shared ones count in the model's total only).
    pub params: u64,
    /// Operations.
    pub calls: u64,
    /// FLOPs counted.
    pub flops: u64,
    /// Seconds.
    pub seconds: f64,
    /// `flops / seconds / 1e12`.
    pub tflops_per_s: f64,
    /// `seconds` over the step's, in percent.
    pub percent_of_step: f64,
    /// The module's time and FLOPs by kernel family.
    pub families: Vec<FamilyRow>,
}

/// The profile of one optimizer step on one rank.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FlopsProfile {
    /// The step profiled (1-based).
    pub step: u64,
    /// The rank that measured it.
    pub rank: usize,
    /// The device, as its backend names it.
    pub device: String,
    /// The model's parameters.
    pub params: u64,
    /// Wall time of the step, seconds (first forward to the end of the update).
    pub step_seconds: f64,
    /// FLOPs counted over the step.
    pub flops: u64,
    /// `flops / step_seconds / 1e12`.
    pub tflops_per_s: f64,
    /// Modules in execution order, then `optimizer`, `engine`, `other`, `background`.
    pub modules: Vec<ModuleRow>,
    /// Every kernel family over the whole step (communication as the communicator timed it;
    /// collectives on the communication worker overlap the rest).
    pub families: Vec<FamilyRow>,
}

pub(super) fn tflops(flops: u64, seconds: f64) -> f64 {
    if seconds > 0.0 {
        flops as f64 / seconds / 1e12
    } else {
        0.0
    }
}

fn family_row(family: Family, c: &Cell, step: f64) -> FamilyRow {
    FamilyRow {
        family,
        calls: c.calls,
        flops: c.flops,
        seconds: c.seconds,
        tflops_per_s: tflops(c.flops, c.seconds),
        percent_of_step: percent(c.seconds, step),
    }
}

fn percent(seconds: f64, step: f64) -> f64 {
    if step > 0.0 {
        100.0 * seconds / step
    } else {
        0.0
    }
}

/// What the profile is built from besides the cells.
pub(super) struct Measured {
    pub step: u64,
    pub rank: usize,
    pub device: String,
    pub params: u64,
    /// Units in execution order with the parameters each owns.
    pub units: Vec<(Arc<str>, u64)>,
    pub step_seconds: f64,
    pub comm_seconds: f64,
    pub comm_calls: u64,
    /// The engine's time for the update on the training thread.
    pub optimizer_seconds: f64,
}

impl FlopsProfile {
    pub(super) fn build(m: Measured, mut cells: BTreeMap<(Arc<str>, Family), Cell>) -> Self {
        let step = m.step_seconds;
        let update = cells
            .entry((Arc::from(OPTIMIZER), Family::Optimizer))
            .or_default();
        // Host kernels updated what the backend did not see: their time is the update's rest.
        update.seconds = update.seconds.max(m.optimizer_seconds);
        if update.seconds == 0.0 && update.calls == 0 {
            cells.remove(&(Arc::from(OPTIMIZER), Family::Optimizer));
        }
        let mut by_module: BTreeMap<Arc<str>, Vec<(Family, Cell)>> = BTreeMap::new();
        let mut by_family: BTreeMap<Family, Cell> = BTreeMap::new();
        for ((module, family), c) in &cells {
            by_module
                .entry(module.clone())
                .or_default()
                .push((*family, *c));
            by_family.entry(*family).or_default().add(c);
        }
        let row = |name: &str, params: u64| {
            let cells = by_module.get(name).map_or(&[][..], Vec::as_slice);
            let mut total = Cell::default();
            cells.iter().for_each(|(_, c)| total.add(c));
            ModuleRow {
                name: name.to_string(),
                params,
                calls: total.calls,
                flops: total.flops,
                seconds: total.seconds,
                tflops_per_s: tflops(total.flops, total.seconds),
                percent_of_step: percent(total.seconds, step),
                families: cells.iter().map(|(f, c)| family_row(*f, c, step)).collect(),
            }
        };
        let mut modules: Vec<ModuleRow> = m.units.iter().map(|(n, p)| row(n, *p)).collect();
        for name in [OPTIMIZER, ENGINE] {
            if by_module.contains_key(name) {
                modules.push(row(name, 0));
            }
        }
        let accounted: f64 = modules.iter().map(|r| r.seconds).sum();
        let mut other = row(OTHER, 0);
        other.seconds = (step - accounted).max(0.0);
        other.percent_of_step = percent(other.seconds, step);
        modules.push(other);
        if by_module.contains_key(BACKGROUND) {
            modules.push(row(BACKGROUND, 0));
        }
        let comm = Cell {
            calls: m.comm_calls,
            flops: 0,
            seconds: m.comm_seconds,
        };
        by_family.insert(Family::Communication, comm);
        let flops = by_family.values().map(|c| c.flops).sum();
        FlopsProfile {
            step: m.step,
            rank: m.rank,
            device: m.device,
            params: m.params,
            step_seconds: step,
            flops,
            tflops_per_s: tflops(flops, step),
            modules,
            families: Family::ALL
                .iter()
                .filter_map(|f| by_family.get(f).map(|c| family_row(*f, c, step)))
                .collect(),
        }
    }

    /// The module rows whose time is the training thread's: every row but `background`.
    /// Their shares sum to 100% of the step.
    pub fn training_thread_modules(&self) -> impl Iterator<Item = &ModuleRow> {
        self.modules.iter().filter(|m| m.name != BACKGROUND)
    }
}
