//! The views a unit's module reads and writes: its parameters (its group's, then the shared
//! parameters it uses) and its gradients' slots, borrowed from the engine's groups.

use super::group::{compute_view, Group};
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

/// Parameter views for a unit: its own slots, then the shared slots it uses.
pub(super) fn unit_params<'a>(
    groups: &'a [Group],
    unit: usize,
    uses: &[usize],
    shared: Option<usize>,
) -> Result<Params<'a>> {
    let own = compute_view_of(&groups[unit], "a unit")?;
    let mut v = groups[unit]
        .layout
        .slots
        .iter()
        .map(|s| own.range(s.range()))
        .collect::<Result<Vec<View<'_>>>>()?;
    if let Some(s) = shared.filter(|_| !uses.is_empty()) {
        let sh = compute_view_of(&groups[s], "the shared group")?;
        for &i in uses {
            v.push(sh.range(groups[s].layout.slots[i].range())?);
        }
    }
    Ok(Params::new(v))
}

/// Parameter and gradient views for a unit's backward.
pub(super) fn unit_params_and_grads<'a>(
    groups: &'a mut [Group],
    unit: usize,
    uses: &[usize],
    shared: Option<usize>,
) -> Result<(Params<'a>, Grads<'a>)> {
    let (head, tail) = groups.split_at_mut(shared.unwrap_or(groups.len()).max(unit + 1));
    let Group {
        layout,
        params,
        work,
        micro,
        ..
    } = &mut head[unit];
    let own_params = compute_view(params, work)
        .ok_or_else(|| Error::Invalid("unit parameters not gathered".into()))?;
    let own_micro = micro
        .as_mut()
        .ok_or_else(|| Error::Invalid("no gradient buffer".into()))?;
    let mut p = layout
        .slots
        .iter()
        .map(|s| own_params.range(s.range()))
        .collect::<Result<Vec<View<'_>>>>()?;
    let mut g = split_slots(own_micro.view_mut(), layout.slots.iter().map(|s| s.range()))?;
    if let (Some(_), false) = (shared, uses.is_empty()) {
        let Group {
            layout,
            params,
            work,
            micro,
            ..
        } = &mut tail[0];
        let sp = compute_view(params, work)
            .ok_or_else(|| Error::Invalid("shared parameters not gathered".into()))?;
        for &i in uses {
            p.push(sp.range(layout.slots[i].range())?);
        }
        let sm = micro
            .as_mut()
            .ok_or_else(|| Error::Invalid("no shared gradient buffer".into()))?;
        let all = split_slots(sm.view_mut(), layout.slots.iter().map(|s| s.range()))?;
        let mut picked: Vec<Option<ViewMut<'_>>> = all.into_iter().map(Some).collect();
        for &i in uses {
            g.push(picked[i].take().ok_or_else(|| {
                Error::Invalid(format!("shared parameter {i} used twice by one unit"))
            })?);
        }
    }
    Ok((Params::new(p), Grads::new(g)))
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
