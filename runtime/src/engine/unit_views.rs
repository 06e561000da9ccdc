//! The views a unit's module reads and writes: its parameters (its group's, then the shared
//! parameters it uses) and its gradients' slots, borrowed from the engine's groups.

use super::group::{compute_view, Group};
use super::places::Places;
use crate::nn::{Grads, Params};
use crate::tensor::{View, ViewMut};
use crate::{Error, Result};

fn compute_view_of<'a>(g: &'a Group, what: &str) -> Result<View<'a>> {
    g.compute_params().ok_or_else(|| {
        Error::Invalid(format!(
            "parameters of {what} used before they were gathered"
        ))
    })
}

/// Parameter views for a unit: its own slots, then the shared slots it uses, wherever
/// [`Places`] put them.
pub(super) fn unit_params<'a>(
    groups: &'a [Group],
    places: &Places,
    unit: usize,
) -> Result<Params<'a>> {
    let mut v = Vec::with_capacity(places.reads(unit).len());
    for &(g, slot) in places.reads(unit) {
        let what = if places.owns(unit, g) {
            "a unit"
        } else {
            "the shared group"
        };
        let full = compute_view_of(&groups[g], what)?;
        v.push(full.range(groups[g].layout.slots[slot].range())?);
    }
    Ok(Params::new(v))
}

/// One group's views for a unit's backward: every slot's parameters, and its gradients'
/// (none for a frozen group).
type GroupViews<'a> = (Vec<View<'a>>, Vec<Option<ViewMut<'a>>>);

/// Parameter and gradient views for a unit's backward; a frozen parameter lends no gradient.
pub(super) fn unit_params_and_grads<'a>(
    groups: &'a mut [Group],
    places: &Places,
    unit: usize,
) -> Result<(Params<'a>, Grads<'a>)> {
    let used = places.groups(unit);
    let mut lent: Vec<(usize, bool, GroupViews<'a>)> = Vec::with_capacity(used.len());
    for (gi, grp) in groups.iter_mut().enumerate() {
        if !used.contains(&gi) {
            continue;
        }
        let Group {
            layout,
            params,
            work,
            micro,
            frozen,
            ..
        } = grp;
        let full = compute_view(params, work)
            .ok_or_else(|| Error::Invalid(format!("parameters of group {gi} not gathered")))?;
        let p = (layout.slots.iter())
            .map(|s| full.range(s.range()))
            .collect::<Result<Vec<View<'_>>>>()?;
        let g = match (*frozen, micro.as_mut()) {
            (true, _) => layout.slots.iter().map(|_| None).collect(),
            (false, Some(m)) => split_slots(m.view_mut(), layout.slots.iter().map(|s| s.range()))?
                .into_iter()
                .map(Some)
                .collect(),
            (false, None) => {
                return Err(Error::Invalid(format!(
                    "group {gi}: no gradient buffer for a unit's backward"
                )))
            }
        };
        lent.push((gi, *frozen, (p, g)));
    }
    let (mut p, mut g) = (Vec::new(), Vec::new());
    for &(gi, slot) in places.reads(unit) {
        let (_, frozen, (pv, gv)) = (lent.iter_mut())
            .find(|(i, _, _)| *i == gi)
            .ok_or_else(|| Error::Invalid(format!("group {gi} is not among the unit's")))?;
        p.push(pv[slot]);
        let taken = gv[slot].take();
        if taken.is_none() && !*frozen {
            return Err(Error::Invalid(format!(
                "parameter {slot} of group {gi} used twice by one unit"
            )));
        }
        g.push(taken);
    }
    Ok((Params::new(p), Grads::with_frozen(g)))
}

/// Splits a flat buffer into disjoint mutable views for consecutive, ordered ranges.
fn split_slots<'a>(
    buf: ViewMut<'a>,
    ranges: impl Iterator<Item = std::ops::Range<usize>>,
) -> Result<Vec<ViewMut<'a>>> {
    let mut rest = buf;
    let mut consumed = 0;
    let mut out = Vec::new();
    for r in ranges {
        let (_, tail) = rest.split_at(r.start - consumed)?;
        let (slot, tail) = tail.split_at(r.len())?;
        out.push(slot);
        rest = tail;
        consumed = r.end;
    }
    Ok(out)
}
