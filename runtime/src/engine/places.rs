//! Where each parameter a unit reads lives: which group, which slot.
//!
//! A unit's parameters are one group when they all train or are all frozen. A unit with
//! both keeps the trainable ones in its own group and the frozen ones in a group of their
//! own (after the shared group), so a frozen parameter never has a gradient, a master copy
//! or optimizer state beside it, yet is sharded, gathered, released and offloaded like any
//! other. The shared (tied) parameters split the same way. Without frozen parameters the
//! groups are exactly one per unit, then the shared group.

use crate::nn::{Model, ParamSpec};

/// One group's parameters and whether they are frozen.
#[derive(Debug, Clone)]
pub(super) struct GroupSpec {
    /// The parameters, in layout order.
    pub specs: Vec<ParamSpec>,
    /// Whether they are frozen (all or none of a group's are).
    pub frozen: bool,
}

/// Per unit: the groups it reads and the (group, slot) of every parameter it reads.
#[derive(Debug, Clone, Default)]
pub(super) struct Places {
    /// Per unit, its own parameters in declaration order then the shared ones it uses.
    reads: Vec<Vec<(usize, usize)>>,
    /// Per unit, the groups it reads: its own, its frozen part, the shared group and its
    /// frozen part (those that exist and it reads).
    groups: Vec<Vec<usize>>,
    /// Per unit, how many of `groups` are its own (the rest are shared with other units).
    own: Vec<usize>,
}

/// A list of parameters split by frozenness: (trainable, frozen), each with the declared
/// index of every parameter.
type Split = (Vec<(usize, ParamSpec)>, Vec<(usize, ParamSpec)>);

fn split(model: &Model, specs: Vec<ParamSpec>) -> Split {
    specs
        .into_iter()
        .enumerate()
        .partition(|(_, s)| !model.is_frozen(&s.name))
}

/// Lays a split list out: the first group (trainable ones, or all when none trains) at
/// `first`, the frozen rest, when there is one, as a new group pushed on `extra`. Returns each
/// declared parameter's (group, slot).
fn lay_out(
    (train, frozen): Split,
    first: usize,
    extra: &mut Vec<GroupSpec>,
    extra_base: usize,
) -> (GroupSpec, Option<usize>, Vec<(usize, usize)>) {
    let n = train.len() + frozen.len();
    let mut at = vec![(first, 0); n];
    if train.is_empty() {
        for (slot, (i, _)) in frozen.iter().enumerate() {
            at[*i] = (first, slot);
        }
        let specs: Vec<ParamSpec> = frozen.into_iter().map(|(_, s)| s).collect();
        let frozen = !specs.is_empty();
        return (GroupSpec { specs, frozen }, None, at);
    }
    for (slot, (i, _)) in train.iter().enumerate() {
        at[*i] = (first, slot);
    }
    let mut second = None;
    if !frozen.is_empty() {
        let g = extra_base + extra.len();
        for (slot, (i, _)) in frozen.iter().enumerate() {
            at[*i] = (g, slot);
        }
        extra.push(GroupSpec {
            specs: frozen.into_iter().map(|(_, s)| s).collect(),
            frozen: true,
        });
        second = Some(g);
    }
    let specs = train.into_iter().map(|(_, s)| s).collect();
    let spec = GroupSpec {
        specs,
        frozen: false,
    };
    (spec, second, at)
}

impl Places {
    /// The groups of `model` (one per unit, the shared group, then the frozen parts of
    /// mixed units and of a mixed shared group) and where each unit's parameters sit.
    pub(super) fn plan(model: &Model) -> (Vec<GroupSpec>, Places) {
        let n = model.units.len();
        let has_shared = !model.shared.is_empty();
        let extra_base = n + usize::from(has_shared);
        let mut extra = Vec::new();
        let mut firsts = Vec::with_capacity(extra_base);
        let mut own_at = Vec::with_capacity(n);
        let mut own_extra = Vec::with_capacity(n);
        for (u, unit) in model.units.iter().enumerate() {
            let s = split(model, unit.module.param_specs());
            let (first, second, at) = lay_out(s, u, &mut extra, extra_base);
            firsts.push(first);
            own_at.push(at);
            own_extra.push(second);
        }
        let (shared_at, shared_extra) = match has_shared {
            true => {
                let s = split(model, model.shared.clone());
                let (first, second, at) = lay_out(s, n, &mut extra, extra_base);
                firsts.push(first);
                (at, second)
            }
            false => (Vec::new(), None),
        };
        let mut places = Places::default();
        for (u, unit) in model.units.iter().enumerate() {
            let mut reads = own_at[u].clone();
            reads.extend(unit.uses_shared.iter().map(|&i| shared_at[i]));
            let mut groups: Vec<usize> = std::iter::once(u).chain(own_extra[u]).collect();
            places.own.push(groups.len());
            if !unit.uses_shared.is_empty() {
                groups.push(n);
                groups.extend(shared_extra);
            }
            places.reads.push(reads);
            places.groups.push(groups);
        }
        firsts.extend(extra);
        (firsts, places)
    }

    /// The (group, slot) of every parameter `unit` reads, in the order its views are lent.
    pub(super) fn reads(&self, unit: usize) -> &[(usize, usize)] {
        &self.reads[unit]
    }

    /// The groups `unit` reads, in the order they are gathered.
    pub(super) fn groups(&self, unit: usize) -> &[usize] {
        &self.groups[unit]
    }

    /// Whether group `g` belongs to `unit` alone (not the shared group or its frozen part).
    pub(super) fn owns(&self, unit: usize, g: usize) -> bool {
        self.groups[unit][..self.own[unit]].contains(&g)
    }

    /// `unit`'s own frozen group, when its parameters are part frozen, part trainable.
    pub(super) fn frozen_part(&self, unit: usize) -> Option<usize> {
        self.groups[unit][..self.own[unit]].get(1).copied()
    }
}
